"""The GPU memory budget of a run read off its loaded policy (covey/training/memory_fit.py), on a CPU with made-up
cards, and train.gpu_memory_gib replacing algo.update_memory_share in configs old and new."""

import pytest
import yaml

from covey.config import ConfigError, as_dict, load_config
from covey.models.load import load_policy
from covey.runtime import budget
from covey.runtime.budget import DoesNotFit
from covey.training import memory_fit
from covey.training.checkpoint import config_differences
from covey.training.plan import make_plan

# fp32 throughout (no autocast, no bf16 sampling copy), so every byte below is fixed.
KEYS = ["model.autocast=none", "rollout.precision=float32", "rollout.max_new_tokens=8"]


def tiny_run(tiny_model_dir, *extra):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *KEYS, *extra])
    policy, _ = load_policy(tiny_model_dir)
    return policy, make_plan(cfg)


def test_the_tiny_grpo_run_priced_by_hand(tiny_model_dir):
    """The tiny Llama: vocabulary 512, hidden 64, MLP 128, 2 layers, 4 heads and 2 key-value heads of 16, tied
    embeddings. Parameters: embedding 512 x 64 = 32768; a layer q 4096 + k 2048 + v 2048 + o 4096 + gate, up,
    down 3 x 8192 + two norms 128 = 36992, x 2 = 73984; final norm 64: 106816, x 4 bytes = 427264; with the
    rotary tables (2 x 8 floats) 427328 bytes of weights. GRPO keeps a reference (beta 0.04): another 427328
    (fp32, no autocast). AdamW: 2 x 427264 = 854528.
    One sequence: a 1-token prompt (the check before the prompts are known) + 8 new tokens = 9 positions; the
    update in fp32 keeps per layer 16 x 64 + 4 x (8 x 64 + 2 x 2 x 16 + 4 x 128) = 1024 + 4352 = 5376, x 2
    layers = 10752 a position (the no-grad pass's 2 x 512 + 6 x 128 + 16 x 64 = 2816 is less): 96768.
    The sampler's row in fp32: 2 x 2 layers x 2 heads x 16 x 4 = 512 + 12 = 524 a position, x 9 = 4716, + 8 x
    512 = 8812; a group of 8 samples: 70496.
    Least: 427328 + 427264 + 854528 + 427328 + 96768 + 70496 = 2303712 bytes."""
    policy, plan = tiny_run(tiny_model_dir)
    shape = memory_fit.run_shape(policy, plan, "cuda", 9)
    assert (shape.weights, shape.trained, shape.trained_bytes, shape.reference) == (427328, 106816, 427264, 427328)
    assert (shape.sampling_copy, shape.activations, shape.kv_cache) == (0, 96768, 70496)
    assert sum(budget.least_parts(shape).values()) == 2_303_712


def test_lora_drops_the_reference_and_trains_the_adapters(tiny_model_dir):
    """r = 4 on every linear: a layer's inputs + outputs are q 128, k 96, v 96, o 128, gate, up, down 3 x 192 =
    1024, x 4 x 2 layers = 8192 adapters (32768 bytes); the reference is the base with adapters off."""
    from covey.models.lora import add_adapters
    policy, plan = tiny_run(tiny_model_dir, "model.lora_rank=4")
    policy = add_adapters(policy, 4, 16, "all-linear")
    shape = memory_fit.run_shape(policy, plan, "cuda", 9)
    assert (shape.trained, shape.trained_bytes, shape.reference) == (8192, 32768, 0)
    assert shape.weights == 427328 + 32768
    assert budget.lora_parameters(policy.config, 4) == 8192


@pytest.fixture
def card(monkeypatch):
    """A made-up GPU: train.gpu_memory_gib=0 resolves to the budget the test sets."""
    budget = {}
    monkeypatch.setattr(memory_fit, "gpu_budget", lambda setting, device: budget["bytes"])
    return budget


def test_a_run_that_cannot_fit_stops_in_one_line_with_what_would_fit(tiny_model_dir, card):
    policy, plan = tiny_run(tiny_model_dir)
    card["bytes"] = 2_303_712  # the least, to the byte (above): it fits
    memory_fit.check_loaded_policy(policy, plan, "cuda", 1)
    card["bytes"] -= 1
    with pytest.raises(DoesNotFit) as err:
        memory_fit.check_loaded_policy(policy, plan, "cuda", 1)
    line = str(err.value)
    assert "\n" not in line and line.startswith("GPU memory: the run needs at least 0.0 GiB (weights 0.0, gradients")
    for setting in ("model.lora_rank=16", "model.gradient_checkpointing=true", "rollout.max_new_tokens=4"):
        assert setting in line
    memory_fit.check_loaded_policy(policy, plan, "cpu", 1)  # no budget on a CPU
    memory_fit.check_loaded_policy(policy, plan, "cuda", 2)  # nor under torchrun


def test_the_retired_key_names_what_replaced_it(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^config key 'algo.update_memory_share' was replaced by "
                                          r"train.gpu_memory_gib \(the GiB a run may take on one GPU"):
        load_config(None, ["algo.update_memory_share=0"])
    with pytest.raises(ConfigError, match="replaced by train.gpu_memory_gib"):
        load_config(None, ["update_memory_share=0.5"])
    old = as_dict(load_config(None, ["train.steps=3"]))
    old["algo"]["update_memory_share"] = 0.5  # as an older run's config.yaml holds it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    cfg = load_config(str(tmp_path / "config.yaml"))
    assert cfg.train.steps == 3 and cfg.train.gpu_memory_gib == 0
    assert ("left out" in capsys.readouterr().err)
    current = as_dict(cfg)
    assert config_differences(old, current) == []  # an older run resumes
    with pytest.raises(ConfigError, match=r"train.gpu_memory_gib must be >= 0"):
        load_config(None, ["train.gpu_memory_gib=-1"])
