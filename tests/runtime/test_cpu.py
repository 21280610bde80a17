"""covey.runtime.cpu: glibc malloc variables and the restart that applies them; the thread setting."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from covey.cli import main
from covey.config import load_config
from covey.runtime.cpu import MALLOC_ENV, apply_cpu_settings, malloc_env

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the MALLOC_* variables are glibc's")


@glibc
def test_malloc_env_adds_the_variables_and_keeps_the_rest():
    env = malloc_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                   "MALLOC_TOP_PAD_": str(256 << 20)}


@pytest.mark.parametrize("environ", [{"COVEY_MALLOC_KEEP": "0"}, {"MALLOC_TOP_PAD_": "0"},
                                     {**MALLOC_ENV}])
def test_malloc_env_is_none_when_off_or_already_set(environ):
    # off by the user, a variable of the user's own (kept as it is), or our own restart
    assert malloc_env(environ) is None


@glibc
def test_entry_restarts_once_with_the_variables(monkeypatch):
    calls = []
    monkeypatch.setattr(main.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(main, "main", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/covey", "train", "steps=3"])
    monkeypatch.delenv("COVEY_MALLOC_KEEP", raising=False)
    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    main.entry()
    (path, argv, env), = calls
    assert path == sys.executable and argv == [sys.executable, "-m", "covey.cli", "train", "steps=3"]
    assert all(env[k] == v for k, v in MALLOC_ENV.items())
    monkeypatch.setenv("COVEY_MALLOC_KEEP", "0")
    assert main.entry() == 0 and len(calls) == 1  # switched off: main() runs in this process


def test_a_torchrun_rank_ends_without_interpreter_teardown(monkeypatch):
    """A finished rank leaves through os._exit with main()'s code (main.exit_without_teardown)."""
    exits = []
    monkeypatch.setattr(main.os, "_exit", exits.append)
    monkeypatch.setattr(main, "main", lambda: 3)
    monkeypatch.setenv("COVEY_MALLOC_KEEP", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    main.entry()
    assert exits == [3]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main.entry() == 3 and exits == [3]  # one process: an ordinary return


@glibc
def test_the_command_line_restarts_with_the_variables_and_runs():
    # The real restart: `entry()` re-executes `python -m covey.cli ...`, whose own `entry()`
    # finds the variables set and runs the command. Without them it would restart forever
    # (and time out), so a normal exit also shows they reached the new process.
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "COVEY_MALLOC_KEEP"}
    code = ("import sys; from covey.cli import main; sys.argv = ['covey', 'advantages', '--estimator', 'grpo', "
            "'--rewards', '1,0', '--lengths', '1,1', '--json']; sys.exit(main.entry())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)


def test_apply_cpu_settings_sets_threads():
    before = torch.get_num_threads()
    try:
        apply_cpu_settings(load_config(None, ["model.threads=1"]).model.threads)
        assert torch.get_num_threads() == 1
        apply_cpu_settings(load_config(None, ["model.threads=0"]).model.threads)  # 0 keeps the current count
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
