"""model.gradient_checkpointing recomputes activations in the backward pass: the same step as
without it (the packed prompt-cache pass is switched off, since checkpointed blocks drop a cache
under grad), on the policy and on PPO's critic."""

import pytest

from covey import train
from covey.config import load_config
from covey.models.critic import ValueModel
from covey.models.load import checkpoints_activations, enable_gradient_checkpointing, load_policy
from covey.models.lora import add_adapters, frozen_reference
from covey.passes.logprobs import packs
from tests.helpers import tiny_overrides

KEYS = ("reward/mean", "optim/grad_norm", "policy/loss", "critic/loss", "critic/grad_norm", "kl/ref")


def test_enabling_it_marks_the_blocks_and_turns_the_packed_pass_off(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir)
    assert packs(model) and not checkpoints_activations(model)
    assert enable_gradient_checkpointing(model)
    assert checkpoints_activations(model) and not packs(model)
    critic = ValueModel.from_policy_path(tiny_model_dir)
    assert enable_gradient_checkpointing(critic) and checkpoints_activations(critic.backbone)


def test_the_lora_reference_view_answers_for_the_policy_it_runs(tiny_model_dir):
    """The LoRA reference runs the policy's own blocks (adapters off): checkpointed, they drop a
    prompt cache too (some transformers versions even without grad), so its passes do not pack."""
    pytest.importorskip("peft")
    policy, _ = load_policy(tiny_model_dir)
    policy = add_adapters(policy, 4, 16, "all-linear")
    reference = frozen_reference(policy)
    assert packs(reference)
    assert enable_gradient_checkpointing(policy)
    assert checkpoints_activations(reference) and not packs(reference)


def test_a_ppo_step_is_the_same_with_and_without_it(tiny_model_dir, tmp_path):
    metrics = []
    for on in ("false", "true"):
        cfg = load_config("ppo", tiny_overrides(tiny_model_dir, tmp_path / on, **{
            "model.autocast": "none", "rollout.precision": "float32", "optim.lr": 1e-3,
            "reward.functions": "tests.helpers:varied_reward", "model.gradient_checkpointing": on}))
        result = train(cfg)
        metrics.append({key: result.metrics[key] for key in KEYS})
    assert metrics[1] == pytest.approx(metrics[0], rel=1e-5, abs=1e-6)
