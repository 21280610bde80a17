"""Every preset, trained once for two steps on the tiny model through the real CLI (`covey train
PRESET`), gives the metrics it gave when they were pinned, and the run has what a run must have
(the metric keys, the final model, the held-out evaluation; DPO's pairs, PPO's critic). Each preset
is trained once for all the tests here (CI time): the tests that read a run share it.

The pinned numbers guard refactors: a change of layout, plumbing or plan must not change what a
preset computes. They were recorded from `covey train` on this exact setting (fp32, no autocast,
the deterministic `varied_reward`); a formula change that moves them must say why and re-pin them.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from covey.cli.main import main
from covey.config import preset_names
from tests.helpers import tiny_overrides

SETTINGS = {"model.autocast": "none", "rollout.precision": "float32", "optim.lr": 1e-3,
            "reward.functions": "tests.helpers:varied_reward", "train.samples_every": 1}
# The tiny random model never ends an answer within its 8 tokens, so DAPO's overlong filtering would leave
# every token out of the loss (a zero gradient pins nothing); its soft overlong punishment still acts
# (every answer at the budget scores -1 more: the negative rewards below).
PRESET_KEYS = {"dapo": {"algo.mask_truncated": False}}

PINNED = {
    "grpo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": -3.725290298461914e-08,
         "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0, "kl/ref": 0.0,
         "optim/grad_norm": 2.9002251625061035},
        {"reward/mean": 0.4375, "advantages/std": 0.9999971985816956, "advantages/max_abs": 1.4142094850540161,
         "policy/loss": 0.0005708973185392097, "policy/entropy": 6.208218812942505, "policy/clipfrac": 0.0,
         "kl/ref": 0.014271687716245651, "optim/grad_norm": 2.284759998321533},
    ],
    "dr_grpo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.29315099120140076, "advantages/max_abs": 0.5,
         "policy/loss": 0.0, "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0, "kl/ref": 0.0,
         "optim/grad_norm": 0.8243501782417297},
        {"reward/mean": 0.5416666269302368, "advantages/std": 0.28259706497192383,
         "advantages/max_abs": 0.5833333134651184, "policy/loss": 0.0005046729347668588,
         "policy/entropy": 6.20869779586792, "policy/clipfrac": 0.0, "kl/ref": 0.012616730760782957,
         "optim/grad_norm": 0.7339170575141907},
    ],
    "ppo": [
        {"reward/mean": 0.375, "advantages/std": 0.9999961853027344, "advantages/max_abs": 1.9583179950714111,
         "policy/loss": -0.07615368254482746, "policy/entropy": 6.207839488983154, "policy/clipfrac": 0.3515625,
         "kl/ref": 0.0066466741263866425, "optim/grad_norm": 2.417491912841797, "critic/loss": 0.08412604965269566},
        {"reward/mean": 0.5208333134651184, "advantages/std": 0.9999955296516418,
         "advantages/max_abs": 2.0371150970458984, "policy/loss": -0.04606662690639496,
         "policy/entropy": 6.207480072975159, "policy/clipfrac": 0.09375, "kl/ref": 0.004964236170053482,
         "optim/grad_norm": 2.774114340543747, "critic/loss": 0.12067885231226683},
    ],
    "reinforce_pp": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999969005584717,
         "advantages/max_abs": 1.9724764823913574, "policy/loss": 7.450580596923828e-08,
         "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0, "kl/ref": 0.0,
         "optim/grad_norm": 2.6437458992004395},
        {"reward/mean": 0.1666666567325592, "advantages/std": 0.9999939203262329,
         "advantages/max_abs": 2.017557382583618, "policy/loss": -4.470348358154297e-08,
         "policy/entropy": 6.2083775997161865, "policy/clipfrac": 0.0, "kl/ref": 0.0022282376885414124,
         "optim/grad_norm": 2.3727264404296875},
    ],
    "reinforce_pp_baseline": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999964833259583,
         "advantages/max_abs": 1.7055997848510742, "policy/loss": -1.4901161193847656e-08,
         "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0, "kl/ref": 0.0,
         "optim/grad_norm": 2.8120226860046387},
        {"reward/mean": 0.5416666269302368, "advantages/std": 0.9999963045120239,
         "advantages/max_abs": 2.0784127712249756, "policy/loss": -1.0244548320770264e-08,
         "policy/entropy": 6.20869779586792, "policy/clipfrac": 0.0, "kl/ref": -0.011512890458106995,
         "optim/grad_norm": 2.604039430618286},
    ],
    "rloo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.3908679783344269,
         "advantages/max_abs": 0.6666666865348816, "policy/loss": 3.725290298461914e-09,
         "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0, "kl/ref": 0.0,
         "optim/grad_norm": 1.0991337299346924},
        {"reward/mean": 0.5416666269302368, "advantages/std": 0.37679609656333923,
         "advantages/max_abs": 0.7777777314186096, "policy/loss": 0.0005046684964327142,
         "policy/entropy": 6.20869779586792, "policy/clipfrac": 0.0, "kl/ref": 0.01261661946773529,
         "optim/grad_norm": 0.9798243641853333},
    ],
    "remax": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.32742154598236084, "advantages/max_abs": 0.5,
         "policy/loss": 0.14583330787718296, "policy/entropy": 6.206166505813599, "policy/clipfrac": 0.0,
         "kl/ref": 0.0, "optim/grad_norm": 0.9490403532981873},
        {"reward/mean": 0.2708333432674408, "advantages/std": 0.23477976024150848, "advantages/max_abs": 0.5,
         "policy/loss": 0.2295679822564125, "policy/entropy": 6.207754611968994, "policy/clipfrac": 0.0,
         "kl/ref": 0.01003347709774971, "optim/grad_norm": 0.8294277191162109},
    ],
    "dapo": [
        {"reward/mean": -0.6458333134651184, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": 0.004472233355045319,
         "policy/entropy": 6.207651421427727, "policy/clipfrac": 0.09375, "optim/grad_norm": 3.8071944415569305},
        {"reward/mean": -0.5625, "advantages/std": 0.9999960064888, "advantages/max_abs": 1.341633677482605,
         "policy/loss": -0.01151968538761139, "policy/entropy": 6.207583166658878, "policy/clipfrac": 0.015625,
         "optim/grad_norm": 3.834206759929657},
    ],
    "gspo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": 0.0191110260784626,
         "policy/entropy": 6.207259342074394, "policy/clipfrac": 0.375, "optim/grad_norm": 2.3531622886657715},
        {"reward/mean": 0.3958333432674408, "advantages/std": 0.9999973773956299,
         "advantages/max_abs": 1.6329890489578247, "policy/loss": 0.015674239955842495,
         "policy/entropy": 6.204782955348492, "policy/clipfrac": 0.125, "optim/grad_norm": 2.759395979344845},
    ],
    "cispo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": -0.022630512714385986,
         "policy/entropy": 6.207198359072208, "policy/clipfrac": 0.03125, "optim/grad_norm": 3.9525106549263},
        {"reward/mean": 0.4583333730697632, "advantages/std": 0.9999948143959045,
         "advantages/max_abs": 1.6329851150512695, "policy/loss": 0.010736346244812012,
         "policy/entropy": 6.205936551094055, "policy/clipfrac": 0.0, "optim/grad_norm": 3.4032514691352844},
    ],
    "sapo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": -0.046039193868637085,
         "policy/entropy": 6.207185044884682, "policy/clipfrac": 0.0, "optim/grad_norm": 3.9351130723953247},
        {"reward/mean": 0.6041666865348816, "advantages/std": 0.9999929070472717,
         "advantages/max_abs": 1.7320390939712524, "policy/loss": -0.06113700568675995,
         "policy/entropy": 6.20527870208025, "policy/clipfrac": 0.0, "optim/grad_norm": 3.5037477612495422},
    ],
    "gmpo": [
        {"reward/mean": 0.3541666865348816, "advantages/std": 0.9999959468841553,
         "advantages/max_abs": 1.6059012413024902, "policy/loss": -0.0022050291299819946,
         "policy/entropy": 6.207154713571072, "policy/clipfrac": 0.0, "optim/grad_norm": 3.922698974609375},
        {"reward/mean": 0.5625, "advantages/std": 0.9999945759773254, "advantages/max_abs": 1.6059012413024902,
         "policy/loss": -0.00034166499972343445, "policy/entropy": 6.20524537563324, "policy/clipfrac": 0.0,
         "optim/grad_norm": 3.14661568403244},
    ],
    "dpo_iterative": [
        {"reward/mean": 0.3541666865348816, "policy/entropy": 6.206672668457031, "kl/ref": 0.0,
         "optim/grad_norm": 3.3755433559417725, "dpo/loss": 0.6931471824645996},
        {"reward/mean": 0.4375, "policy/entropy": 6.208255290985107, "kl/ref": 0.0123775415122509,
         "optim/grad_norm": 2.576725959777832, "dpo/loss": 0.6820627450942993},
    ],
}


@dataclass
class Run:
    code: int
    """`covey train`'s exit status."""
    folder: Path
    rows: list
    """metrics.jsonl, one dict per line."""

    @property
    def steps(self) -> list[dict]:
        return [row for row in self.rows if "reward/mean" in row]


def read_rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """trained(preset, **keys): the run of `covey train PRESET` on SETTINGS (+ keys), made on first use
    and shared by every test of this module that asks for it."""
    runs = {}

    def run(preset: str, **keys) -> Run:
        key = (preset, tuple(sorted(keys.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp(preset)
            overrides = {**SETTINGS, **PRESET_KEYS.get(preset, {}), **keys}
            code = main(["train", preset, *tiny_overrides(tiny_model_dir, out, **overrides)])
            runs[key] = Run(code, out / "t", read_rows(out / "t"))
        return runs[key]
    return run


def test_every_preset_is_pinned():
    # wordproblems_gpu is a recipe, the defaults' GRPO (pinned as grpo) on another task: tests/bench/test_gpu_learn.py
    assert set(PINNED) == set(preset_names()) - {"wordproblems_gpu"}


@pytest.mark.parametrize("preset", sorted(PINNED))
def test_preset_metrics_are_pinned(preset, trained):
    run = trained(preset)
    assert run.code == 0
    rows = [row for row in run.rows if row.get("step") in (1, 2) and "final" not in row]
    assert len(rows) == 2
    for row, pinned in zip(rows, PINNED[preset]):
        got = {key: row.get(key) for key in pinned}
        assert got == pytest.approx(pinned, rel=1e-5, abs=1e-6), (preset, row["step"])


@pytest.mark.parametrize("preset", sorted(PINNED))
def test_every_preset_trains_two_steps(preset, trained):
    run = trained(preset)
    assert run.code == 0
    assert [r["step"] for r in run.steps] == [1, 2]
    last = run.steps[-1]
    for key in ("reward/mean", "reward/std", "accuracy", "groups/zero_std_frac", "policy/clipfrac",
                "policy/approx_kl", "policy/entropy", "response/len_mean", "response/len_max",
                "response/truncated_frac", "optim/grad_norm", "optim/lr", "time/generate", "time/score",
                "time/logprobs", "time/update", "throughput/tokens_per_s", "memory/peak_rss_mb"):
        if preset == "dpo_iterative" and key in ("policy/clipfrac", "policy/approx_kl"):
            continue  # DPO has no importance ratio to clip
        assert key in last, key
    if preset == "dpo_iterative":
        assert "dpo/pairs" in last and "memory/params_mb/reference" in last
    if preset == "ppo":
        assert "critic/loss" in last and "critic/explained_var" in last
        assert "memory/params_mb/critic" in last
    assert (run.folder / "final" / "config.json").is_file()
    assert run.rows[-1]["final"] == 1 and "eval/accuracy" in run.rows[-1]


def test_dpo_iterative_trains_on_pairs(trained):
    run = trained("dpo_iterative")
    first = run.steps[0]
    assert first["dpo/pairs"] >= 1 and first["optim/grad_norm"] > 0
    # step 1: the policy still equals the reference, so every margin is 0 and the loss is log 2
    assert first["dpo/loss"] == pytest.approx(0.6931, abs=1e-3) and first["dpo/margin"] == pytest.approx(0, abs=1e-4)
    assert first["kl/ref"] == pytest.approx(0, abs=1e-5)
    assert "advantages/std" not in first  # no advantage estimator runs for DPO
    # sample logs carry the preference label: +1 chosen, -1 rejected, 0 unpaired
    labels = {json.loads(line)["advantage"] for line in (run.folder / "samples.jsonl").read_text().splitlines()}
    assert {-1.0, 1.0} <= labels <= {-1.0, 0.0, 1.0}


def test_grad_variance_does_not_change_training(trained):
    plain, measured = trained("grpo"), trained("grpo", **{"train.grad_var_every": 1})
    assert plain.code == measured.code == 0
    for a, b in zip(plain.steps, measured.steps):
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "kl/ref", "policy/entropy"):
            assert b[key] == a[key], key
        assert "policy/grad_var" not in a
        assert b["policy/grad_var"] >= 0 and 0 <= b["policy/grad_noise_frac"] <= 4 / 3
        assert b["time/grad_var"] > 0
