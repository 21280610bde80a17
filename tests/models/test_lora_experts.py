"""LoRA on the tiny mixtures of experts: model.lora_targets=all-linear adapts the attention, each expert's
fused weights and the routers (PEFT target_parameters), the experts' adapters receive gradients, and a
saved adapter folder reloads to the same model."""

import pytest
import torch

pytest.importorskip("peft")

from covey.models.load import load_policy  # noqa: E402
from covey.models.lora import add_adapters, frozen_reference, load_adapted, lora_targets  # noqa: E402
from covey.models.tiny import build_tiny_family, tiny_family_model  # noqa: E402

ROUTER = {"qwen3_moe": "mlp.gate.", "gpt_oss": "mlp.router."}


def test_targets_per_family():
    assert lora_targets(tiny_family_model("qwen3_moe", 64), "all-linear") == (
        "all-linear", ["experts.gate_up_proj", "experts.down_proj", "gate.weight"])
    assert lora_targets(tiny_family_model("gpt_oss", 64), "all-linear") == (
        "all-linear", ["experts.gate_up_proj", "experts.down_proj", "router.weight"])
    assert lora_targets(tiny_family_model("llama", 64), "all-linear") == ("all-linear", [])
    assert lora_targets(tiny_family_model("qwen3_5", 64), "all-linear") == ("all-linear", [])  # 3-D convs: no experts
    # a listed name that ends a parameter's name (and no module's) is a target parameter
    assert lora_targets(tiny_family_model("gpt_oss", 64), "q_proj,experts.down_proj") == (["q_proj"],
                                                                                         ["experts.down_proj"])


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_adapters_train(family, tmp_path):
    folder = build_tiny_family(tmp_path / family, family)
    base, tokenizer = load_policy(str(folder))
    policy = add_adapters(base, rank=4, alpha=8)
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in trained)
    experts = {name: p for name, p in trained.items() if ".mlp.experts." in name}
    routers = {name: p for name, p in trained.items() if ROUTER[family] in name}
    layers = policy.config.num_hidden_layers
    # per layer: one A and one B for gate_up_proj and for down_proj (nested wrappers), one pair on the router
    assert len(experts) == 4 * layers and len(routers) == 2 * layers
    assert sum("self_attn.q_proj.lora_" in name for name in trained) == 2 * layers

    ids = torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))

    def backward():
        policy.zero_grad(set_to_none=True)
        policy(input_ids=ids).logits.logsumexp(-1).mean().backward()

    backward()  # B = 0 at the start: B gets the gradient, A's is B^T (...) = 0
    for name, p in experts.items():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == ("lora_B" in name), name
    with torch.no_grad():
        for p in trained.values():
            p -= 0.5 * p.grad if p.grad is not None else 0
    backward()  # B moved: every expert adapter, A included, has a gradient now
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.values())

    reference = frozen_reference(policy)
    with torch.no_grad():
        adapted, base_logits = policy(input_ids=ids).logits, reference(input_ids=ids).logits
        plain, _ = load_policy(str(folder))
        assert torch.equal(base_logits, plain(input_ids=ids).logits)  # adapters off: the base model
        assert not torch.allclose(adapted, base_logits, atol=1e-4)
        policy.save_pretrained(tmp_path / "adapter")
        reloaded, _ = load_adapted(tmp_path / "adapter")
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted)
