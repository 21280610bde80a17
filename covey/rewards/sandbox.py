"""Run a model's Python program in a separate, limited process, and a code-execution reward.

Layers, each its own guarantee (`run_python`):

1. A separate process in a new session, killed with SIGKILL (its whole process
   group) when the wall-clock `timeout_s` passes; stdout and stderr go to files.
2. Resource limits set in the child before the program runs: CPU seconds,
   address space (`memory_mb`), file size (`output_bytes`: caps stdout, stderr
   and every file it writes; a larger write kills it with SIGXFSZ), open
   files, no core dumps, and processes (RLIMIT_NPROC, enforced once the child
   runs as an unprivileged user: see 3).
3. Kernel namespaces through util-linux `unshare`, when it works on this
   machine (`isolation()` says): a new network namespace (no interface but a
   down loopback, so no network at all, whatever the program does); a PID
   namespace (when its first process dies the kernel kills every descendant,
   so nothing outlives the run); a mount namespace in which every file system
   is remounted read-only and the working directory is a fresh tmpfs of
   `disk_mb` (so no write outside it, and no disk filling, at the kernel level).
4. A Python audit hook installed before the program starts (`sys.addaudithook`;
   Python code cannot remove it): sockets, subprocesses, fork/exec, os.kill,
   ctypes and cffi are refused, and so is opening a file for writing, or
   creating, deleting, renaming, linking or chmod-ing a path, outside the
   working directory.
5. A fresh working directory, deleted afterwards; `python -I -S -B`
   (no user site, no PYTHON* variables, no .pyc writes); an environment of
   PATH, HOME and TMPDIR only (no tokens of the parent process leak in);
   stdout and stderr read through pipes and cut at `output_bytes` (the
   program is killed when it writes more).

What it is not: a container. Without `unshare` (another OS, no user
namespaces), network and file-system isolation rest on layer 4 alone, which C
code already importable (a compiled extension used in a way the hook does not
see) could bypass. Reading files the user may read is allowed. RLIMIT_NPROC
does not bind root (root ignores it), so as root a fork bomb is stopped by
layer 4, bounded in time by the timeout and cleaned up by the PID namespace,
not capped in count by the kernel. Run hostile code in a VM or gVisor.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from covey.rewards.rules import completion_text

# Runs inside the namespaces before Python: everything read-only, a private tmpfs as the working directory.
MOUNT_PRELUDE = r'''
src=$1 work=$2 size=$3; shift 3
for m in $(findmnt -rn -o TARGET 2>/dev/null); do
  case "$m" in /proc*|/sys*|/dev|/dev/pts*) ;; *) mount -o remount,bind,ro "$m" 2>/dev/null ;; esac
done
mount -t tmpfs -o "size=${size}m,mode=0777" covey-sandbox "$work" 2>/dev/null
cp "$src" "$work/main.py" && exec "$@"
'''


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0
    """Wall-clock limit; the process group is killed after it."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS)."""
    output_bytes: int = 65536
    """Largest stdout, stderr or written file (RLIMIT_FSIZE)."""
    max_processes: int = 16
    """RLIMIT_NPROC for the unprivileged user (fork-bomb limit)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    disk_mb: int = 16
    """Size of the tmpfs working directory (with namespaces)."""


@dataclass
class SandboxResult:
    returncode: int | None  # negative: killed by that signal (e.g. -9 on timeout, -25 SIGXFSZ)
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    isolation: str  # "namespaces" or "audit-hook"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# The child's first code: limits, audit hook, then the program.
# It runs before any user code, with sys.argv = [work_dir, limits..., audit hook on].
BOOTSTRAP = r'''
import os, sys, resource, runpy
work, cpu, mem, fsize, nproc, nofile, hook_on = sys.argv[1], *map(int, sys.argv[2:8])
for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                   (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
    resource.setrlimit(res, (value, value))
os.chdir(work)
WORK = os.path.realpath(work)
DENY = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
        "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.startfile"}
DENY_MODULES = {"ctypes", "_ctypes", "cffi", "_posixsubprocess", "socket", "_socket", "ssl", "_ssl", "mmap"}
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
               "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod", "os.chflags"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
busy = []
def inside(path):
    if isinstance(path, int):
        return True
    path = os.fsdecode(path)
    full = os.path.realpath(os.path.join(os.getcwd(), path))
    return full == WORK or full.startswith(WORK + os.sep)
def hook(event, args):
    if busy:
        return
    busy.append(1)
    try:
        if event in DENY:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in DENY_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in PATH_EVENTS:
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {os.fsdecode(path)!r} is outside the working directory")
    finally:
        busy.pop()
if hook_on:
    sys.addaudithook(hook)
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
'''


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...] | None:
    """The `unshare` command line that works here (network + PID namespaces), or None."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    base = (exe, "--net", "--pid", "--mount", "--fork", "--kill-child")
    for prefix in (base, (*base, "--map-root-user")) if os.geteuid() == 0 else ((*base, "--map-root-user"),):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def isolation() -> str:
    """'namespaces' when kernel network/PID isolation is available, else 'audit-hook'."""
    return "namespaces" if _unshare_prefix() is not None else "audit-hook"


class _CappedReader(threading.Thread):
    """Drains a pipe, keeps the first `limit` bytes, and kills the process group once more arrives."""

    def __init__(self, pipe, limit: int, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.pipe, self.limit, self.proc = pipe, limit, proc
        self.data, self.truncated = bytearray(), False

    def run(self) -> None:
        for chunk in iter(lambda: self.pipe.read(65536), b""):
            room = self.limit - len(self.data)
            self.data += chunk[:max(room, 0)]
            if len(chunk) > room and not self.truncated:
                self.truncated = True
                _kill_group(self.proc)

    def text(self) -> str:
        return self.data.decode(errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _command(prefix, base: Path, work: Path, limits: SandboxLimits, audit_hook: bool) -> list[str]:
    args = [str(work), math.ceil(limits.timeout_s) + 1, limits.memory_mb * 2**20, limits.output_bytes,
            limits.max_processes, limits.open_files, int(audit_hook)]
    python = [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, *map(str, args)]
    if prefix is None:
        return python
    return [*prefix, "sh", "-c", MOUNT_PRELUDE, "sh", str(base / "main.py"), str(work), str(limits.disk_mb), *python]


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None, *,
               audit_hook: bool = True) -> SandboxResult:
    """Run `code` as main.py in a fresh working directory under every available layer.

    `audit_hook=False` removes layer 4 (tests use it to check the kernel layers alone).
    """
    limits = limits or SandboxLimits()
    prefix = _unshare_prefix()
    base = Path(tempfile.mkdtemp(prefix="covey-sandbox-"))
    work = base / "work"
    work.mkdir()
    try:
        (base / "main.py").write_text(code)
        shutil.copy(base / "main.py", work / "main.py")  # what runs without namespaces
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        proc = subprocess.Popen(_command(prefix, base, work, limits, audit_hook), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=env,
                                start_new_session=True)
        readers = [_CappedReader(pipe, limits.output_bytes, proc) for pipe in (proc.stdout, proc.stderr)]
        for reader in readers:
            reader.start()
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:  # it exited without reading its input
            pass
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # on timeout, and any straggler (the PID namespace already took them)
        proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        return SandboxResult(proc.returncode, readers[0].text(), readers[1].text(), timed_out,
                             readers[0].truncated or readers[1].truncated, "namespaces" if prefix else "audit-hook")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- code-execution reward

_FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```), else the whole completion."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


def passed_tests(code: str, tests: list, limits: SandboxLimits | None = None) -> int:
    """How many (stdin, expected stdout) tests the program passes (output compared stripped)."""
    passed = 0
    for stdin, expected in tests:
        result = run_python(code, str(stdin), limits)
        passed += int(result.ok and result.stdout.strip() == str(expected).strip())
    return passed


def code_execution_reward(prompts, completions, tests, **columns) -> list[float]:
    """TRL-shaped: share of a task's tests the completion's program passes, each run sandboxed.

    `tests` is a column: per sample a list of [stdin, expected_stdout] pairs
    (covey.tasks.code writes it).
    """
    out = []
    for completion, cases in zip(completions, tests):
        code = extract_code(completion_text(completion))
        out.append(passed_tests(code, cases) / len(cases) if cases else 0.0)
    return out
