"""Non-finite loss or gradient: the update is skipped and counted, N in a row abort the run,
and no checkpoint ever holds a NaN (the previous one stays the newest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import covey.algos
from covey.cli.main import main
from covey.runtime.metrics import read_metrics
from covey.training import update
from covey.training.checkpoint import list_checkpoints
from tests.helpers import tiny_overrides


class InfGrad(torch.autograd.Function):
    """Identity forward; an infinite gradient backward (a finite loss with a broken gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def poison_policy_loss(monkeypatch, from_call: int, until_call: int = 10**9, kind: str = "nan") -> None:
    """Make micro-batch losses number from_call..until_call non-finite (NaN) or their gradient infinite.

    Each step runs 2 micro-batches (8 sequences, micro_batch_size 4); a poisoned first
    micro-batch ends its step's loop, so step k >= 2 starts at call 2k - 1 when step 2 is poisoned.
    """
    real = update.micro_policy_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if from_call <= calls["n"] <= until_call:
            loss = loss * float("nan") if kind == "nan" else InfGrad.apply(loss)
        return loss, metrics

    monkeypatch.setattr(update, "micro_policy_loss", poisoned)


def train(model_dir, out, **extra) -> int:
    return main(["train", *tiny_overrides(model_dir, out, **{
        "model.threads": 1, "train.save_every": 1, "train.keep_checkpoints": 5, "optim.lr": 1e-3,
        "reward.functions": "tests.helpers:varied_reward", **extra})])


def weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def all_finite(w: dict) -> bool:
    return all(torch.isfinite(t).all() for t in w.values())


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_one_nan_loss_skips_that_update_only(tiny_model_dir, tmp_path, monkeypatch):
    poison_policy_loss(monkeypatch, from_call=3, until_call=3)  # step 2's first micro-batch
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3}) == 0
    run_dir = tmp_path / "t"
    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["optim/skipped_steps"] for r in steps] == [0, 1, 1]
    assert "optim/grad_norm" not in steps[1] and steps[2]["optim/grad_norm"] > 0  # no finite norm
    assert same(weights(run_dir, 1), weights(run_dir, 2)), "the skipped update changed no weight"
    assert not same(weights(run_dir, 2), weights(run_dir, 3)), "training goes on after the skip"
    opt = [torch.load(run_dir / "checkpoints" / f"step-{s:06d}" / "trainer_state.pt", weights_only=False)
           for s in (1, 2)]
    assert opt[0]["scheduler"] == opt[1]["scheduler"], "no scheduler step for a skipped update"
    moments = [o["optimizer"]["state"][0]["exp_avg"] for o in opt]
    assert torch.equal(*moments), "Adam moments untouched by the NaN"


@pytest.mark.parametrize("kind, reason", [("nan", "non-finite loss"), ("inf_grad", "non-finite gradient")])
def test_consecutive_skips_abort_and_no_nan_is_checkpointed(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                             kind, reason):
    poison_policy_loss(monkeypatch, from_call=3, kind=kind)  # from step 2 on
    code = train(tiny_model_dir, tmp_path, **{"train.steps": 6, "optim.max_skipped_steps": 3})
    assert code == 2
    assert last_error(capsys) == (f"covey train: error: policy: 3 consecutive updates skipped ({reason}); "
                                  "aborting (optim.max_skipped_steps); lower optim.lr or check the rewards")
    run_dir = tmp_path / "t"
    assert [r["optim/skipped_steps"] for r in read_metrics(run_dir) if r["step"] > 0] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000001", "step-000002", "step-000003"]
    assert all(all_finite(weights(run_dir, s)) for s in (1, 2, 3))
    assert same(weights(run_dir, 1), weights(run_dir, 3))


def test_critic_skips_are_counted_apart_from_the_policy(tiny_model_dir, tmp_path, monkeypatch, capsys):
    real = covey.algos.value_loss

    def nan_value_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(covey.algos, "value_loss", nan_value_loss)
    code = main(["train", "ppo", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "model.threads": 1, "train.steps": 5, "optim.max_skipped_steps": 3,
        "reward.functions": "tests.helpers:varied_reward"})])
    assert code == 2
    # ppo: 2 epochs x 2 mini-batches = 4 critic updates per step, all skipped: abort in step 1
    assert last_error(capsys).startswith("covey train: error: critic: 3 consecutive updates skipped "
                                         "(non-finite loss)")


def test_nan_weights_stop_the_run_before_any_checkpoint_holds_them(tiny_model_dir, tmp_path, monkeypatch,
                                                                  capsys):
    """An update that leaves NaN in the weights (finite loss and gradient) is caught at save time."""
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def blow_up_on_second(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blow_up_on_second)
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3}) == 2
    assert "refusing to save a checkpoint at step 2: policy parameter" in last_error(capsys)
    assert [p.name for p in list_checkpoints(tmp_path / "t")] == ["step-000001"]
    assert all_finite(weights(tmp_path / "t", 1))
