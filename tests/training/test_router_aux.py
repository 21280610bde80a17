"""The routers' load-balancing loss in the update (model.router_aux_coef) on the tiny MoE models: the hooks
read the routing of the right tokens in every training pass, the step's term does not depend on the
micro-batch size, the key resolves from the model's config, and a 2-step `covey train` logs it (with
the sampler-trainer log-ratio)."""

import copy
import json
import math

import pytest
import torch

from covey.config import Config, ConfigError, load_config
from covey.models.routers import RouterTap, model_router_aux, num_experts, router_aux_coef
from covey.models.tiny import build_tiny_family, build_tiny_model, tiny_family_config, tiny_family_model
from covey.passes import logprobs
from covey.training.plan import make_plan
from covey.training.router_aux import RouterAux, routed_tokens
from covey.training.update import MetricAverager, Optimized, UpdateState, update_policy
from tests.helpers import grouped_rollout, tiny_overrides

MOE = ("qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module", params=MOE)
def moe64(request, tiny_model_dir):
    """A tiny random MoE model of each family in float64 (rounding far below a wrong token's effect)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = tiny_family_model(request.param, len(tokenizer)).to(torch.float64)
    model.set_experts_implementation("eager")  # the grouped-matmul kernel takes no float64
    with torch.no_grad():  # transformers initialises routers at 0: spread them so that routing differs by token
        for name, p in model.named_parameters():
            if "gate.weight" in name or "router.weight" in name:
                p.normal_(0, 1.0)
    return model, tokenizer


def test_routed_tokens_are_the_attended_response_tokens_but_the_last():
    attended = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert routed_tokens(attended).int().tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]


def expected_aux(model, part, tokens=routed_tokens):
    """transformers' own loss (load_balancing_loss_func, in float32, via output_router_logits) over the
    part's `tokens`, from one plain padded forward."""
    ids, mask, resp_len = logprobs.trim(part)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=logprobs.position_ids(mask),
                    output_router_logits=True, use_cache=False)
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[:, -resp_len:] = tokens(part.response_attended[:, :resp_len])
    rows = keep.reshape(-1)
    chosen = tuple(layer[rows] for layer in out.router_logits)
    loss_func = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"]).load_balancing_loss_func
    return float(loss_func(chosen, num_experts(model.config), model.config.num_experts_per_tok)), int(rows.sum())


@pytest.mark.parametrize("mode", ["padded", "packed", "packed_step_prompts"])
def test_hooks_read_the_routing_of_the_response_tokens(moe64, mode, monkeypatch):
    model, tokenizer = moe64
    rollout = grouped_rollout(tokenizer, groups=2, group_size=3)
    if mode == "padded":
        monkeypatch.setattr(logprobs, "packs", lambda model: False)
    prompts = logprobs.encode_prompts(model, rollout, torch.arange(len(rollout))) if mode.endswith("prompts") else None
    assert (prompts is not None) == (mode == "packed_step_prompts")
    tap = RouterTap(model)
    try:
        for micro in torch.arange(len(rollout)).split(4):  # a group split across micro-batches
            part = rollout.select(micro)
            with tap.recording():
                logprobs.policy_logprobs(model, part, 1.0, prompts=(prompts[0], prompts[1][micro]) if prompts else None)
            avg = MetricAverager()
            term = RouterAux(tap, coef=0.5, step_tokens=100).term(part, avg)
            aux, tokens = expected_aux(model, part)
            assert avg.result()["loss/router_aux"] == pytest.approx(aux, rel=1e-6)
            assert float(term.detach()) == pytest.approx(0.5 * tokens / 100 * aux, rel=1e-6)
            every_token, _ = expected_aux(model, part, tokens=lambda attended: attended.bool())
            assert abs(every_token - aux) > 1e-4  # far above the tolerance: one token per row more shows
    finally:
        tap.close()
    with tap.recording() as forwards:  # closed: its hooks are gone
        logprobs.policy_logprobs(model, rollout, 1.0)
    assert forwards == []


def one_step(model, rollout, micro_batch_size: int, coef: float):
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.optim.max_grad_norm, cfg.rollout.max_new_tokens = micro_batch_size, 0.0, 7
    cfg.model.autocast, cfg.model.router_aux_coef = "none", coef
    model = copy.deepcopy(model)
    target = Optimized(model, torch.optim.SGD(model.parameters(), lr=1.0), None, UpdateState())
    metrics = update_policy(target, rollout, make_plan(cfg).update, 0.0, torch.Generator().manual_seed(0))
    return dict(model.named_parameters()), metrics


def test_the_step_term_does_not_depend_on_the_micro_batch_size(moe64):
    """Two identical groups: micro-batches of one group each route as the whole batch does, so with the
    token-share weights the step's router loss, and its gradient, are the whole batch's exactly."""
    model, tokenizer = moe64
    half = grouped_rollout(tokenizer, groups=1, group_size=3)
    rollout = grouped_rollout(tokenizer, groups=1, group_size=3)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        setattr(rollout, name, torch.cat([getattr(half, name)] * 2))
    rollout.group_ids, rollout.truncated = torch.tensor([0, 0, 0, 1, 1, 1]), torch.zeros(6, dtype=torch.bool)
    rollout.completions, rollout.example_index = [""] * 6, [0, 0, 0, 1, 1, 1]
    rollout.advantages = torch.zeros(rollout.response_ids.shape, dtype=torch.float64)  # the router loss alone
    whole, whole_metrics = one_step(model, rollout, 6, coef=1.0)
    split, split_metrics = one_step(model, rollout, 3, coef=1.0)
    untouched, _ = one_step(model, rollout, 6, coef=0.0)
    assert split_metrics["loss/router_aux"] == pytest.approx(whole_metrics["loss/router_aux"], rel=1e-12)
    moved = [name for name in whole if not torch.equal(whole[name], untouched[name])]
    assert any("gate" in name or "router" in name for name in moved)  # the router loss trained the routers
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-12, rtol=1e-12, msg=name)


def test_off_by_default_and_refused_without_experts(tmp_path):
    config = tiny_family_config("qwen3_moe", 64)
    assert router_aux_coef(config, None) == 0.0  # output_router_logits false: transformers adds none either
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    assert router_aux_coef(config, None) == 0.02 and router_aux_coef(config, 0.0) == 0.0
    assert router_aux_coef(config, 0.5) == 0.5
    dense = tiny_family_config("llama", 64)
    assert router_aux_coef(dense, None) == 0.0 and router_aux_coef(dense, 0.0) == 0.0
    with pytest.raises(ConfigError, match=r"model.router_aux_coef=0.01 .* has no experts"):
        router_aux_coef(dense, 0.01)
    folder = build_tiny_model(tmp_path / "llama")
    with pytest.raises(ConfigError, match="has no experts"):  # from config.json alone, before any weight loads
        model_router_aux(str(folder), 0.01)
    assert model_router_aux(str(folder), None) == (0.0, "")
    with pytest.raises(ConfigError, match="algo.learner=dpo does not add it"):
        load_config(None, ["model.router_aux_coef=0.1", "algo.learner=dpo"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(None, ["model.router_aux_coef=-0.1"])
    assert load_config(None, ["model.router_aux_coef=null"]).model.router_aux_coef is None
    assert load_config(None, ["model.router_aux_coef=0.001"]).model.router_aux_coef == 0.001


@pytest.mark.parametrize("family, extra", [
    ("qwen3_moe", {}),
    ("gpt_oss", {"model.lora_rank": 4, "model.lora_alpha": 8}),  # adapters on the experts and the routers
])
def test_two_step_run_logs_the_router_loss_and_the_sampler_mismatch(family, extra, tmp_path, capsys):
    from covey.cli.main import main
    folder = build_tiny_family(tmp_path / family, family)
    overrides = tiny_overrides(str(folder), tmp_path, **{"model.router_aux_coef": 0.01, "optim.lr": 1e-2,
                                                         "reward.functions": "tests.helpers:varied_reward:1.0",
                                                         "reward.correctness": 0.0, **extra})
    assert main(["train", *overrides]) == 0
    assert "router load-balancing loss x 0.01 (model.router_aux_coef)" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss/router_aux" in line or "sampler/log_ratio_mean" in line]
    assert len(steps) == 2
    for line in steps:
        for key in ("loss/router_aux", "sampler/log_ratio_mean", "sampler/log_ratio_max", "sampler/beyond_cap_frac"):
            assert math.isfinite(line[key]), (key, line)
        assert 1.0 <= line["loss/router_aux"] <= 4.0  # between k = 2 (even) and E = 4 (collapsed), with slack
