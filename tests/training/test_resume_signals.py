"""Graceful stop: the first SIGINT/SIGTERM finishes the step, checkpoints, exits 130/143;
a second one abandons the step at once (the last checkpoint stays the newest).

The signals are sent by the reward function of step 2, so they arrive mid-step
(the subprocess SIGTERM test is in test_resume_kill.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from covey.cli.main import main
from covey.runtime.metrics import NONDETERMINISTIC_PREFIXES, read_metrics
from covey.training.checkpoint import list_checkpoints
from tests.helpers import tiny_overrides

PLAN = {"calls": 0, "signals": ()}


def signalling_reward(prompts, completions, **_):
    """Varied rewards; on the second training batch (step 2) sends the planned signals to this process.
    A call on one completion (a check of the function before training) is not a training batch."""
    PLAN["calls"] += len(completions) > 1
    if PLAN["calls"] == 2:
        for signum in PLAN["signals"]:
            installed = signal.getsignal(signum)
            # A process-directed signal may land on any thread (the reward timeout's watchdog is one)
            # and wake the main thread only later. Ctrl-C from a terminal reaches the main thread, so
            # deliver there.
            signal.pthread_kill(threading.main_thread().ident, signum)
            # Two signals sent at once would merge into one: wait until covey's handler ran
            # (it puts the previous handler back), as a person pressing Ctrl-C twice does.
            deadline = time.monotonic() + 10
            while signal.getsignal(signum) is installed and time.monotonic() < deadline:
                time.sleep(0.01)
    return [(sum(map(ord, c)) % 5) / 4 for c in completions]


def train(model_dir, out, signals=(), **extra) -> int:
    PLAN.update(calls=0, signals=signals)
    return main(["train", *tiny_overrides(model_dir, out, **{
        "model.threads": 1, "train.steps": 4, "optim.lr": 1e-3, "train.resume": "auto",
        "reward.functions": "tests.training.test_resume_signals:signalling_reward", **extra})])


def deterministic(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}
            for r in read_metrics(run_dir)]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_finishes_the_step_checkpoints_and_resumes_exactly(tiny_model_dir, tmp_path, capsys,
                                                                        signum, code):
    assert train(tiny_model_dir, tmp_path / "whole") == 0
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert train(tiny_model_dir, tmp_path, signals=(signum,)) == code
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers, "handlers restored"
    run_dir = tmp_path / "t"
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"covey train: stopped by {name} after step 2; checkpoint {run_dir}/checkpoints/step-000002 "
        "(continue with train.resume=auto)")
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000002"]  # save_every=0: written for the stop
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert train(tiny_model_dir, tmp_path) == 0
    assert deterministic(run_dir) == deterministic(tmp_path / "whole" / "t")


def test_second_signal_abandons_the_step(tiny_model_dir, tmp_path):
    code = train(tiny_model_dir, tmp_path, signals=(signal.SIGINT, signal.SIGINT), **{"train.save_every": 1})
    assert code == 130
    run_dir = tmp_path / "t"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000001"]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert train(tiny_model_dir, tmp_path, **{"train.save_every": 1}) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4, 4]


def _agree_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from covey.runtime.signals import StopFlag
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flag = StopFlag()
    first = flag.agreed()  # nobody signalled
    if rank == 1:
        flag.signum = signal.SIGINT  # as if rank 1 alone received Ctrl-C
    results.put((rank, first, flag.agreed(), flag.signum))
    dist.destroy_process_group()


def test_under_torchrun_every_rank_stops_when_one_is_signalled():
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == [(0, False, True, signal.SIGTERM), (1, False, True, signal.SIGINT)]


MARKS_ENV = "COVEY_TEST_REWARD_MARKS"


def marking_reward(completions, **_):
    """A slow reward that appends a line to the file named by COVEY_TEST_REWARD_MARKS at every call."""
    with open(os.environ[MARKS_ENV], "a") as fh:
        fh.write(f"{len(completions)}\n")
    time.sleep(0.02)
    return [0.5] * len(completions)


def test_a_stop_signal_during_the_evaluation_before_training_ends_it_between_batches(tiny_model_dir, tmp_path):
    """400 held-out problems one per batch, judged by a slow reward: about 20 s of evaluation. SIGINT once
    it runs: the process ends within seconds, exit 130, no checkpoint (nothing was trained)."""
    marks = tmp_path / "marks"
    keys = tiny_overrides(tiny_model_dir, tmp_path, **{
        "model.threads": 1, "task.eval_size": 400, "rollout.eval_batch_size": 1, "eval.metric": "reward",
        "reward.correctness": 0, "reward.functions": "tests.training.test_resume_signals:marking_reward"})
    env = {**os.environ, MARKS_ENV: str(marks), "COVEY_MALLOC_KEEP": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "covey.cli", "train", *keys], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and (
            not marks.exists() or len(marks.read_text().splitlines()) < 5):  # past any check call: evaluating
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took, calls = time.monotonic() - sent, len(marks.read_text().splitlines())
    assert proc.returncode == 130, err
    assert took < 5 and calls < 200, (took, calls)  # not the whole evaluation
    last = err.strip().splitlines()[-1]
    assert last.startswith("covey train: stopped by SIGINT during the evaluation before training, after "), last
    assert last.endswith(" of 400 held-out problems: nothing was trained, so no checkpoint was written (the same "
                         "command starts the run again)"), last
    assert list_checkpoints(tmp_path / "t") == []


def test_a_stop_signal_inside_one_long_held_out_batch_ends_it_at_the_next_decode_step(tiny_model_dir, tmp_path):
    """One batch of 256 held-out problems with 900 new tokens each: many seconds of decoding in one engine call.
    SIGINT a second into it: the engine leaves its loop at its next step, exit 130 within seconds, no checkpoint."""
    keys = tiny_overrides(tiny_model_dir, tmp_path, **{
        "model.threads": 1, "task.eval_size": 256, "rollout.eval_batch_size": 256,
        "rollout.eval_max_new_tokens": 900})
    env = {**os.environ, "COVEY_MALLOC_KEEP": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "covey.cli", "train", *keys], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the last line before the evaluation starts
        if line.startswith("covey: sampling with"):
            break
    time.sleep(1.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert took < 5, took
    assert err.strip().splitlines()[-1].startswith(
        "covey train: stopped by SIGINT during the evaluation before training, after 0 of 256 held-out problems")
    assert list_checkpoints(tmp_path / "t") == []
