"""SIGKILL at any point, `resume=auto`, and the run ends exactly as an uninterrupted one.

Every run here is a real `python -m covey.cli train` subprocess on the tiny model,
with a checkpoint after every step. Kills land at named points (inside a
checkpoint write, between the write and the rename, before pruning, between
logging a step and checkpointing it; `covey.runtime.signals.fault_point`) and at random
times while checkpoint writes are slowed down. After each kill the run is
resumed until it completes; metrics.jsonl (all fields but time/memory/throughput),
samples.jsonl and the final weights must then equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from covey.runtime.metrics import NONDETERMINISTIC_PREFIXES
from covey.runtime.signals import DELAY_ENV, KILL_AT_ENV
from tests.helpers import tiny_overrides

STEPS = 5




def command(model_dir: str, out_dir: Path) -> list[str]:
    """Every stateful part is on: Adam, warm-up, shuffled mini-batches, adaptive KL, EMA reference."""
    overrides = tiny_overrides(
        model_dir, out_dir, **{
            "train.steps": STEPS, "train.save_every": 1, "train.keep_checkpoints": 2, "train.resume": "auto",
            "train.samples_every": 1, "train.eval_every": 2, "model.threads": 1,
            "algo.epochs": 2, "algo.minibatches": 2, "algo.micro_batch_size": 2, "algo.adaptive_kl.target": 0.05,
            "algo.ref_ema": 0.1, "optim.lr": 1e-3, "optim.warmup_steps": 3,
            "reward.functions": "tests.helpers:varied_reward"})
    return [sys.executable, "-m", "covey.cli", "train", *overrides]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (KILL_AT_ENV, DELAY_ENV)}
    env.update(extra)
    return env


def run_to_end(cmd: list[str], **env) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(**env))
    assert done.returncode == 0, done.stderr[-3000:]


def killed_at(cmd: list[str], point: str) -> None:
    """Run until the named fault point SIGKILLs the process."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(**{KILL_AT_ENV: point}))
    assert done.returncode == -signal.SIGKILL, f"{point} was never reached: {done.stderr[-2000:]}"


def stopped_by_sigterm(cmd: list[str], run_dir: Path) -> int:
    """SIGTERM right after checkpoint 2 appears; returns the step the run stopped at (exit 143)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=clean_env(**{DELAY_ENV: "0.3"}))  # slowed writes: the run cannot end first
    while not (run_dir / "checkpoints" / "step-000002").is_dir():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("covey train: stopped by SIGTERM after step "), line
    step = int(line.split("after step ")[1].split(";")[0])
    newest = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))[-1]
    assert newest == f"step-{step:06d}" and f"checkpoint {run_dir}/checkpoints/{newest}" in line
    return step


def killed_after(cmd: list[str], seconds: float) -> bool:
    """SIGKILL the run after `seconds` with checkpoint writes slowed; False if it finished first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=clean_env(**{DELAY_ENV: "0.3"}))
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def comparable(run_dir: Path) -> dict:
    def rows(name):
        path = run_dir / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    metrics = [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}
               for r in rows("metrics.jsonl")]
    weights = load_file(str(run_dir / "final" / "model.safetensors"))
    return {"metrics": metrics, "samples": rows("samples.jsonl"), "weights": weights}


def assert_same_run(got: dict, want: dict) -> None:
    assert len(got["metrics"]) == len(want["metrics"])
    for a, b in zip(got["metrics"], want["metrics"]):
        assert a == b, f"step {b['step']} differs"
    assert got["samples"] == want["samples"]
    assert got["weights"].keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory) -> dict:
    """The uninterrupted run, and how long it took."""
    out = tmp_path_factory.mktemp("uninterrupted")
    t0 = time.perf_counter()
    run_to_end(command(tiny_model_dir, out))
    result = comparable(out / "t")
    # The run learned something, or the comparison would prove little.
    steps = [r for r in result["metrics"] if "reward/mean" in r]
    assert len(steps) == STEPS and steps[0]["policy/entropy"] != steps[-1]["policy/entropy"]
    assert any(r["optim/grad_norm"] > 0 for r in steps)
    return {**result, "seconds": time.perf_counter() - t0}


def test_kill_mid_checkpoint_write_resumes_exactly(reference_run, tiny_model_dir, tmp_path):
    cmd = command(tiny_model_dir, tmp_path)
    ckpts = tmp_path / "t" / "checkpoints"
    killed_at(cmd, "checkpoint-write@2")  # policy written, trainer state not yet
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-000001"]
    assert [p.name for p in ckpts.glob(".tmp-step-000002-*")], "the half-written checkpoint is hidden"
    run_to_end(cmd)
    assert not list(ckpts.glob(".tmp-*")), "leftovers of the killed write are cleaned"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000004", "step-000005"]
    assert_same_run(comparable(tmp_path / "t"), reference_run)


@pytest.mark.slow
def test_sigterm_then_kill_after_logging_resume_exactly(reference_run, tiny_model_dir, tmp_path):
    cmd = command(tiny_model_dir, tmp_path)
    assert stopped_by_sigterm(cmd, tmp_path / "t") in (2, 3)  # finishes its step, checkpoints, exits 143
    killed_at(cmd, "step-logged@4")  # step 4 logged, its checkpoint not written
    assert json.loads((tmp_path / "t" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    run_to_end(cmd)
    assert_same_run(comparable(tmp_path / "t"), reference_run)


@pytest.mark.slow
def test_kill_at_every_point_and_at_random_times(reference_run, tiny_model_dir, tmp_path):
    cmd = command(tiny_model_dir, tmp_path)
    killed_at(cmd, "checkpoint-rename@1")   # complete in the temporary folder, not renamed
    killed_at(cmd, "checkpoint-prune@3")    # renamed, older ones not yet pruned
    run_to_end(cmd)
    assert_same_run(comparable(tmp_path / "t"), reference_run)

    rng = random.Random(1234)
    for trial in range(2):  # random kills, each trial killed up to twice, then finished
        out = tmp_path / f"random{trial}"
        cmd = command(tiny_model_dir, out)
        for _ in range(2):
            if not killed_after(cmd, rng.uniform(0.4, 1.3) * reference_run["seconds"]):
                break
        run_to_end(cmd)
        assert_same_run(comparable(out / "t"), reference_run)


def measure(trials: int, model_dir: str, out: Path) -> str:
    """`python -m tests.training.test_resume_kill [TRIALS]`: random kills in bulk, with how many hit a write."""
    t0 = time.perf_counter()
    run_to_end(command(model_dir, out / "reference"))
    seconds, want = time.perf_counter() - t0, comparable(out / "reference" / "t")
    rng, kills, mid_write = random.Random(7), 0, 0
    for trial in range(trials):
        cmd = command(model_dir, out / f"trial{trial}")
        ckpts = out / f"trial{trial}" / "t" / "checkpoints"
        for _ in range(2):
            if not killed_after(cmd, rng.uniform(0.4, 1.3) * seconds):
                break
            kills += 1
            mid_write += any(ckpts.glob(".tmp-*"))  # a temporary folder only exists during a write
        run_to_end(cmd)
        assert_same_run(comparable(out / f"trial{trial}" / "t"), want)
    return (f"{trials} trials, {kills} SIGKILLs at random times, {mid_write} of them inside a checkpoint "
            f"write: every resumed run identical to the uninterrupted one")


if __name__ == "__main__":
    import tempfile

    from covey.models.tiny import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 8, str(build_tiny_model(Path(tmp) / "tiny")),
                      Path(tmp)))
