"""LoRA through PEFT on the tiny model: adapters alone train, the reference is the base model itself."""

import pytest
import torch

pytest.importorskip("peft")

from covey.config import ConfigError, as_dict, load_config  # noqa: E402
from covey.models.load import ModelError, load_policy, param_memory_mb  # noqa: E402
from covey.models.lora import BaseModelView, add_adapters, frozen_reference, load_adapted, trainable_names  # noqa: E402
from covey.passes.logprobs import batched_logprobs  # noqa: E402
from covey.training.checkpoint import load_checkpoint, save_checkpoint, save_final  # noqa: E402
from covey.training.loop import open_run, steps  # noqa: E402
from covey.training.plan import make_plan  # noqa: E402
from covey.training.setup import build_run  # noqa: E402
from tests.helpers import tiny_overrides  # noqa: E402

DIGITS = "tests.training.test_torchrun:digit_share:1.0"  # a reward the random model earns unevenly


def lora_config(model_dir, out_dir, **extra):
    keys = {"model.lora_rank": 4, "model.lora_alpha": 8, "optim.lr": 1e-2, "reward.functions": DIGITS,
            "reward.correctness": 0.0, "algo.beta": 0.1, **extra}
    return load_config(None, tiny_overrides(model_dir, out_dir, **keys))


def some_rollout(model_dir):
    """A fixed batch of sampled sequences to score with different models."""
    model, tokenizer = load_policy(model_dir)
    from covey.rollout.hf import HFEngine
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer, max_new_tokens=6)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("What is 2+3?", "7 * 8 = ?")]
    return engine.generate(prompts, 2)


def test_only_adapter_parameters_change_and_adapters_reload(tiny_model_dir, tmp_path):
    cfg = lora_config(tiny_model_dir, tmp_path)
    session = open_run(cfg, evaluate_before=False)
    run = session.run
    assert isinstance(run.reference, BaseModelView) and param_memory_mb(run.reference) == 0  # no second copy
    trainable = set(trainable_names(run.policy))
    assert trainable and all("lora_" in name for name in trainable)
    assert sum(len(g["params"]) for g in run.optimizer.param_groups) == len(trainable)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}

    for step, _ in enumerate(steps(session), 1):
        if step == 2:
            break
    session.close()

    after = run.policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # base weights bit-for-bit unchanged
    assert any("lora_B" in k for k in changed)  # B starts at 0: it moved, so the adapted model differs

    final = save_final(run)
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    reloaded, _ = load_adapted(final)
    rollout = some_rollout(tiny_model_dir)
    assert torch.allclose(batched_logprobs(reloaded, rollout, 1.0, 4), batched_logprobs(run.policy, rollout, 1.0, 4),
                          atol=1e-6)


def test_reference_logprobs_equal_the_base_model(tiny_model_dir):
    base, _ = load_policy(tiny_model_dir)
    rollout = some_rollout(tiny_model_dir)
    base_logp = batched_logprobs(base, rollout, 1.0, 4)
    policy, _ = load_policy(tiny_model_dir)
    policy = add_adapters(policy, rank=4, alpha=8)
    with torch.no_grad():  # adapters as if trained: the policy now differs from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    reference = frozen_reference(policy)
    assert not torch.allclose(batched_logprobs(policy, rollout, 1.0, 4), base_logp, atol=1e-3)
    # equal up to float rounding: MKL may pick another kernel order on another CPU (seen on AMD EPYC)
    torch.testing.assert_close(batched_logprobs(reference, rollout, 1.0, 4), base_logp, rtol=0, atol=1e-5)
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)  # adapters back on


def test_checkpoint_restores_adapters(tiny_model_dir, tmp_path):
    cfg = lora_config(tiny_model_dir, tmp_path)
    run = build_run(make_plan(cfg), tmp_path / "t", 16, record=as_dict(cfg))
    run.logger = None
    with torch.no_grad():
        for name, p in run.policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    saved = {k: v.clone() for k, v in run.policy.state_dict().items()}
    path = save_checkpoint(run, {})
    with torch.no_grad():
        for name, p in run.policy.named_parameters():
            if "lora_" in name:
                p.zero_()
    load_checkpoint(run, path)
    assert all(torch.equal(saved[k], v) for k, v in run.policy.state_dict().items())


def test_lora_config_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="reference is the base model"):
        lora_config(tiny_model_dir, tmp_path, **{"algo.ref_ema": 0.1})
    with pytest.raises(ConfigError, match="lora_rank must be >= 0"):
        lora_config(tiny_model_dir, tmp_path, **{"model.lora_rank": -1})
    policy, _ = load_policy(tiny_model_dir)
    with pytest.raises(ModelError, match="LoRA"):
        add_adapters(policy, 4, 8, "no_such_proj")
