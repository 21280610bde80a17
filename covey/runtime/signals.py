"""Graceful stop on SIGINT / SIGTERM, and the kill points the fault tests use.

The first SIGINT or SIGTERM only raises a flag: the loop finishes the step it
is in, writes a checkpoint and raises `TrainingStopped`, which the CLI turns
into exit code 128 + signal (130 for SIGINT, 143 for SIGTERM). The handlers are
then back to the previous ones, so a second signal stops at once (Ctrl-C twice:
KeyboardInterrupt); the newest complete checkpoint is intact either way, since
checkpoints are written atomically. During the evaluation before training the
flag ends the evaluation between two batches (no step, no checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(RuntimeError):
    """Training stopped on a signal after writing a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint {checkpoint} "
                         "(continue with train.resume=auto)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopFlag:
    """Set by the first stop signal; the loop reads it between steps."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Whether any process got a stop signal: under torchrun every rank stops after the same
        step (one rank leaving the loop alone would leave the others hanging in a collective)."""
        import torch
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        on_gpu = dist.get_backend() == "nccl"
        flag = torch.tensor([float(self.requested)], device=torch.cuda.current_device() if on_gpu else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.signum is None:
            self.signum = signal.SIGTERM  # another rank was signalled
        return flag.item() > 0


class DecodeAborted(RuntimeError):
    """A stop signal arrived while an `abortable` section was decoding: the engine left its loop."""


_ABORTABLE: list[StopFlag] = []


@contextlib.contextmanager
def abortable(flag: StopFlag | None):
    """Within the block, engines leave their decode loop at the next step once `flag` is raised
    (`check_abort`): the evaluation before training, which trains nothing, stops within a step instead of
    after its batch. Training steps are not abortable: the first signal lets the step finish."""
    if flag is None:
        yield
        return
    _ABORTABLE.append(flag)
    try:
        yield
    finally:
        _ABORTABLE.remove(flag)


def check_abort() -> None:
    """Called by the engines at each decode step: DecodeAborted inside an `abortable` block whose flag rose."""
    if _ABORTABLE and _ABORTABLE[-1].requested:
        raise DecodeAborted("stop signal during an abortable decode")


@contextlib.contextmanager
def graceful_stop():
    """Install the SIGINT/SIGTERM flag handlers for the duration of the block.

    Outside the main thread handlers cannot be installed; the flag then never rises.
    """
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    def stop_now(signum, _frame) -> None:
        # Explicit, not "whatever handler was there before": that may be one that ignores signals.
        restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def on_signal(signum, _frame) -> None:
        flag.signum = signum
        for s in STOP_SIGNALS:  # a second signal stops at once
            signal.signal(s, stop_now)
        # os.write, not print: a handler may interrupt a print in progress.
        os.write(2, f"\ncovey: {signal.Signals(signum).name} received: finishing the current step, "
                    "then writing a checkpoint (signal again to stop at once)\n".encode())

    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)
    try:
        yield flag
    finally:
        restore()


# Fault injection for tests/training/test_resume_kill.py only; inert unless these variables are set.
KILL_AT_ENV = "COVEY_TEST_KILL_AT"          # "point@step[,point@step...]": SIGKILL self there
DELAY_ENV = "COVEY_TEST_CHECKPOINT_DELAY"   # seconds to sleep at each checkpoint point


def fault_point(point: str, step: int) -> None:
    """A named place in the run where the kill tests may SIGKILL this process."""
    spec = os.environ.get(KILL_AT_ENV)
    if spec and f"{point}@{step}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    delay = os.environ.get(DELAY_ENV)
    if delay and point.startswith("checkpoint"):
        time.sleep(float(delay))
