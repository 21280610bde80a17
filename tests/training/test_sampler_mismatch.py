"""The sampler-trainer mismatch on the local engines: logged every step, and truncated IS available
(algo.tis.cap) on fast and hf as on vLLM."""

import json

import pytest
import torch

import covey
from covey.config import load_config
from tests.helpers import tiny_overrides


def step_one(run_dir) -> dict:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_the_mismatch_is_logged_and_truncated_is_runs_on_local_engines(tiny_model_dir, tmp_path, engine):
    plain = covey.train(load_config(None, tiny_overrides(tiny_model_dir, tmp_path / "plain", **{
        "rollout.engine": engine, "train.steps": 1})))
    m = step_one(plain.run_dir)
    # fp32 sampling from the trained weights: the sampler's log-probs are the trainer's, up to kernel order
    assert abs(m["sampler/log_ratio_mean"]) < 1e-4 and m["sampler/log_ratio_max"] < 1e-3
    assert m["sampler/beyond_cap_frac"] == 0.0 and "tis/weight_mean" not in m
    corrected = covey.train(load_config(None, tiny_overrides(tiny_model_dir, tmp_path / "tis", **{
        "rollout.engine": engine, "train.steps": 1, "algo.tis.cap": 2})))
    m = step_one(corrected.run_dir)
    assert m["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3) and m["tis/capped_frac"] == 0.0
    assert torch.isfinite(torch.tensor(m["optim/grad_norm"]))


def test_every_decode_path_takes_truncated_is():
    """The static and graph paths record the sampler's log-probs too (tests/rollout/test_static_decode*.py)."""
    for decode in ("plain", "static", "graphs", "compile"):
        assert load_config(None, ["algo.tis.cap=2", f"rollout.decode={decode}"]).algo.tis.cap == 2


def test_mask_truncated_takes_cut_responses_out_of_the_update(tiny_model_dir, tmp_path):
    """4 new tokens: the tiny random model ends no reply that soon, so every response is truncated; with
    algo.mask_truncated no token carries a loss and the gradient is 0, without it the step learns."""
    def grad_norm(folder, *extra):
        result = covey.train(load_config(None, [*tiny_overrides(tiny_model_dir, tmp_path / folder, **{
            "train.steps": 1, "rollout.max_new_tokens": 4, "reward.functions": "tests.helpers:varied_reward",
            "reward.correctness": 0.0}), *extra]))
        m = step_one(result.run_dir)
        assert m["response/truncated_frac"] == 1.0
        return m["optim/grad_norm"]
    assert grad_norm("masked", "algo.mask_truncated=true") == 0.0
    assert grad_norm("plain") > 0.0
