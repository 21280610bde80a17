"""The code sandbox: escapes must fail safely, legitimate programs must run, the reward must score."""

import os
import socket
import subprocess
import threading
import time

import pytest

from covey.rewards.sandbox import (
    SandboxLimits,
    code_execution_reward,
    extract_code,
    isolation,
    passed_tests,
    run_python,
)
from covey.tasks.code import generate_code_tasks

FAST = SandboxLimits(timeout_s=2.0)
needs_namespaces = pytest.mark.skipif(isolation() != "namespaces", reason="unshare namespaces not available here")


@pytest.fixture
def listener():
    """A TCP server on the loopback that records whether anything connected."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(0.2)
    hits, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                hits.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1], hits
    stop.set()
    thread.join()
    sock.close()


def _last_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_normal_program_runs_and_reads_stdin():
    result = run_python("import json, math\nn = int(input())\nprint(json.dumps([n, math.factorial(n)]))", "5\n", FAST)
    assert result.ok and result.stdout == "[5, 120]\n" and not result.output_truncated
    inside = run_python("open('f.txt', 'w').write('kept')\nprint(open('f.txt').read())", limits=FAST)
    assert inside.ok and inside.stdout == "kept\n"  # its own working directory is writable


@pytest.mark.parametrize("hook", [True, pytest.param(False, marks=needs_namespaces)])
def test_network_is_unreachable(listener, hook):
    port, hits = listener
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('CONNECTED')"
    result = run_python(code, limits=FAST, audit_hook=hook)
    assert result.returncode != 0 and "CONNECTED" not in result.stdout
    assert ("PermissionError: sandbox" if hook else "Network is unreachable") in _last_error(result)
    time.sleep(0.3)
    assert hits == []  # nothing reached the listener


@pytest.mark.parametrize("hook", [True, pytest.param(False, marks=needs_namespaces)])
@pytest.mark.parametrize("target", ["/tmp/covey-sandbox-escape.txt", "/dev/shm/covey-sandbox-escape.txt",
                                    "../escape.txt"])
def test_writing_outside_the_working_directory_fails(target, hook, tmp_path):
    result = run_python(f"open({target!r}, 'w').write('x')\nprint('WROTE')", limits=FAST, audit_hook=hook)
    assert result.returncode != 0 and "WROTE" not in result.stdout
    assert ("outside the working directory" if hook else "Read-only file system") in _last_error(result)
    assert not os.path.exists(target)


@pytest.mark.parametrize("code", ["import os\nos.symlink('/etc/passwd', 'p')", "import os\nos.system('true')",
                                  "import subprocess\nsubprocess.run(['true'])", "import ctypes",
                                  "import os\nos.kill(1, 9)", "import os\nos.remove('/etc/hostname')"])
def test_escape_calls_are_refused(code):
    result = run_python(code, limits=FAST)
    assert result.returncode == 1 and "PermissionError: sandbox" in _last_error(result)


def test_fork_bomb_fails_safely():
    t0 = time.perf_counter()
    result = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert result.returncode == 1 and "os.fork is not allowed" in _last_error(result)
    assert time.perf_counter() - t0 < FAST.timeout_s + 3


@needs_namespaces
def test_fork_bomb_without_the_hook_is_stopped_and_cleaned_up():
    """Kernel layers only: the timeout kills the PID namespace, and no process survives it."""
    code = "import os, time\nfor _ in range(6):\n    os.fork()\ntime.sleep(60)"  # 64 sleepers, bounded
    result = run_python(code, limits=SandboxLimits(timeout_s=1.5), audit_hook=False)
    assert result.timed_out and result.returncode == -9
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert left == []


def test_infinite_loop_is_killed_at_the_timeout():
    t0 = time.perf_counter()
    result = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=1.0))
    elapsed = time.perf_counter() - t0
    assert result.timed_out and result.returncode == -9 and not result.ok
    assert 1.0 <= elapsed < 4.0


def test_huge_output_is_cut_and_the_program_killed():
    limits = SandboxLimits(timeout_s=10.0, output_bytes=4096)
    t0 = time.perf_counter()
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=limits)
    assert result.output_truncated and len(result.stdout) == 4096 and set(result.stdout) == {"x"}
    assert result.returncode == -9 and not result.timed_out and time.perf_counter() - t0 < 5


def test_huge_file_and_memory_fail():
    big = run_python("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)", limits=FAST)
    assert big.returncode != 0 and ("File too large" in big.stderr or big.returncode == -25)
    mem = run_python("x = bytearray(4 * 1024**3)\nprint('ALLOCATED')", limits=FAST)
    assert mem.returncode == 1 and "MemoryError" in _last_error(mem)


def test_parent_secrets_do_not_leak(monkeypatch):
    monkeypatch.setenv("COVEY_REWARD_TOKEN", "s3cret")
    result = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert "COVEY_REWARD_TOKEN" not in result.stdout and "s3cret" not in result.stdout


# --------------------------------------------------------------------------- the code task and its reward


def test_extract_code_takes_the_last_fenced_block():
    text = "Try:\n```python\nprint(1)\n```\nBetter:\n```python\nprint(int(input()) * 7)\n```\nDone."
    assert extract_code(text) == "print(int(input()) * 7)\n"
    assert extract_code("print(2)") == "print(2)"


def test_code_reward_scores_share_of_tests_passed():
    ex = next(e for e in generate_code_tasks(34, seed=0) if "sum of the integers" in e.prompt)
    right = "```python\nn = int(input())\nprint(n * (n + 1) // 2)\n```"
    half = "```python\nn = int(input())\nprint(n * (n + 1) // 2 if n % 2 else 0)\n```"
    escape = "```python\nimport socket\n```"
    tests = ex.meta["tests"]
    scores = code_execution_reward(["p"] * 4, [right, half, escape, "while True: pass"], [tests] * 3 + [[]])
    expected_half = sum(int(t[0]) % 2 == 1 for t in tests) / 3
    assert scores == [1.0, pytest.approx(expected_half), 0.0, 0.0]
    assert passed_tests("print(int(input()) * 0)", [["3\n", "0"], ["4\n", "1"]]) == 1


def test_code_tasks_are_distinct_and_deterministic():
    a, b = generate_code_tasks(20, seed=1), generate_code_tasks(20, seed=1)
    assert a == b and len({e.prompt for e in a}) == 20
    assert all(len(e.meta["tests"]) == 3 and e.answer == e.meta["tests"][0][1] for e in a)
    with pytest.raises(ValueError, match="only 34 distinct code problems exist; asked for 35"):
        generate_code_tasks(35, seed=0)
