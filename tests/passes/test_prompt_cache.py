"""The step's prompts encoded once (covey.passes.prompt_cache) give the same log-probs and update as encoding
them in every micro-batch. In float64, so that a wrong column, prompt or missing gradient shows up as
an error far above rounding (1e-10), not hidden inside float32 noise."""

import contextlib
import copy

import pytest
import torch

from covey.config import Config
from covey.models.load import load_policy
from covey.passes import logprobs
from covey.passes.prompt_cache import EncodedPrompts
from covey.runtime.precision import shared_weight_casts
from covey.training import update
from covey.training.global_batch import global_normalizer
from covey.training.plan import make_plan
from covey.training.update import Optimized, UpdateState, update_policy
from tests.helpers import grouped_rollout


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir)
    return model.to(torch.float64).train(), tokenizer


def rollout_with_advantages(tokenizer, groups=3, group_size=3):
    # prompts of 5, 3 and 4 tokens (left-padded to 5): micro-batches of 2 rows then hold one or two
    # prompts, a group is split across micro-batches, and a micro-batch's width is below the step's
    rollout = grouped_rollout(tokenizer, groups=groups, group_size=group_size)
    rollout.advantages = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(3),
                                     dtype=torch.float64)
    return rollout


def one_step(model, rollout, micro_batch_size, monkeypatch, encode_once: bool):
    """Parameters after one SGD(lr=1) step of update_policy."""
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.optim.max_grad_norm, cfg.rollout.max_new_tokens = micro_batch_size, 0.0, 7
    cfg.model.autocast = "none"
    cfg.algo.entropy_coef = 0.01  # the entropy's gradient goes through the prompt pass too
    model = copy.deepcopy(model)
    with monkeypatch.context() as patch:
        if not encode_once:
            patch.setattr(update, "encode_prompts", lambda *args, **kwargs: None)
        target = Optimized(model, torch.optim.SGD(model.parameters(), lr=1.0), None, UpdateState())
        update_policy(target, rollout, make_plan(cfg).update, 0.0, torch.Generator().manual_seed(0))
    return dict(model.named_parameters())


def assert_same_step(step, expected, tolerance):
    assert step.keys() == expected.keys()
    for name, param in step.items():
        torch.testing.assert_close(param, expected[name], atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("micro_batch_size", [2, 4])
def test_update_with_prompts_encoded_once_equals_one_micro_batch(tiny64, monkeypatch, micro_batch_size):
    """With one micro-batch (9 rows) the step's prompts run in one pass either way, at the same width:
    summing the micro-batches' leaf gradients and running one deferred backward must give that step."""
    model, tokenizer = tiny64
    rollout = rollout_with_advantages(tokenizer)
    whole = one_step(model, rollout, 9, monkeypatch, encode_once=False)
    assert_same_step(one_step(model, rollout, micro_batch_size, monkeypatch, encode_once=True), whole, 1e-12)
    # the prompt pass carries gradient: the embeddings of prompt tokens move
    embed = "model.embed_tokens.weight"
    assert not torch.equal(whole[embed], dict(model.named_parameters())[embed])


@pytest.mark.parametrize("micro_batch_size", [2, 4])
def test_update_with_prompts_encoded_once_equals_encoding_per_micro_batch(tiny64, monkeypatch, micro_batch_size):
    """Against prompts encoded in each micro-batch (each at its own width): equal to 1e-6. The packed
    pass itself differs from the padded one by ~6e-8 relative even in float64 (something in it
    computes in float32), and a prompt encoded at another width goes through that differently."""
    model, tokenizer = tiny64
    rollout = rollout_with_advantages(tokenizer)
    assert_same_step(one_step(model, rollout, micro_batch_size, monkeypatch, encode_once=True),
                     one_step(model, rollout, micro_batch_size, monkeypatch, encode_once=False), 1e-6)


def test_batched_logprobs_with_prompts_encoded_once(tiny64, monkeypatch):
    model, tokenizer = tiny64
    rollout = rollout_with_advantages(tokenizer)
    with torch.no_grad():
        once = logprobs.batched_logprobs(model, rollout, 0.7, micro_batch_size=2, precision="none")
        monkeypatch.setattr(logprobs, "encode_prompts", lambda *args, **kwargs: None)
        each = logprobs.batched_logprobs(model, rollout, 0.7, micro_batch_size=2, precision="none")
    torch.testing.assert_close(once, each, atol=1e-10, rtol=1e-10)
    assert once.abs().sum() > 0


def test_views_read_the_right_prompts_and_columns(tiny64):
    """A view of prompts (2, 0) trimmed to 3 columns holds exactly their last 3 cached positions."""
    model, tokenizer = tiny64
    rollout = rollout_with_advantages(tokenizer)
    rows = torch.arange(len(rollout))
    with torch.no_grad():
        encoded, of_row = logprobs.encode_prompts(model, rollout, rows)
        view = encoded.view(torch.tensor([2, 0, 2]), width=3)
    assert view.prompts.tolist() == [0, 2] and view.inverse.tolist() == [1, 0, 1]
    keys, _ = view.cache.layers[0].keys, view.cache.layers[0].values
    full = encoded.tensors[0]  # layer 0 keys, (U, kv_heads, 5, head_dim)
    assert keys.shape[2] == 3
    torch.testing.assert_close(keys, full[[0, 2]][:, :, 2:])
    torch.testing.assert_close(view.head, encoded.tensors[-1][[0, 2]])
    # one encoded prompt per group: the rows of a group share an index, different groups do not
    by_group = {int(g): set(of_row[rollout.group_ids == g].tolist()) for g in rollout.group_ids.unique()}
    assert all(len(indices) == 1 for indices in by_group.values())
    assert len(set.union(*by_group.values())) == 3


def test_collect_adds_each_micro_batch_gradient_at_its_columns(tiny64):
    """Two views of one prompt, of widths 5 and 3: their leaf gradients add up in the last 3 columns."""
    model, tokenizer = tiny64
    rollout = rollout_with_advantages(tokenizer)
    encoded, _ = logprobs.encode_prompts(model, rollout, torch.arange(len(rollout)))
    assert isinstance(encoded, EncodedPrompts) and encoded.differentiable
    wide, narrow = encoded.view(torch.tensor([1]), width=5), encoded.view(torch.tensor([1]), width=3)
    wide.leaves[0].grad = torch.ones_like(wide.leaves[0])
    narrow.leaves[0].grad = 2 * torch.ones_like(narrow.leaves[0])
    encoded.collect()
    summed = encoded.grads[0]
    assert summed[[0, 2]].abs().sum() == 0  # other prompts untouched
    assert torch.all(summed[1, :, :2] == 1) and torch.all(summed[1, :, 2:] == 3)
    assert encoded.pending == []


def test_one_bf16_cast_per_weight_for_the_whole_step(tiny_model_dir, monkeypatch):
    """Under bf16 autocast, shared_weight_casts keeps autocast's weight copies across the step's
    micro-batches (one cast of q_proj's weight instead of one per pass) and changes no gradient."""
    model, tokenizer = load_policy(tiny_model_dir)
    rollout = rollout_with_advantages(tokenizer)
    rollout.advantages = rollout.advantages.float()
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.optim.max_grad_norm, cfg.rollout.max_new_tokens = 2, 0.0, 7
    cfg.model.autocast = "bfloat16"
    weight_shape = list(model.model.layers[0].self_attn.q_proj.weight.shape)

    def gradient_and_casts(shared: bool):
        model.zero_grad(set_to_none=True)
        norm = global_normalizer("token_mean", rollout.response_mask, 7)
        context = shared_weight_casts("bfloat16") if shared else contextlib.nullcontext()
        with torch.profiler.profile(record_shapes=True) as prof, context:
            finite, _ = update.policy_gradient(model, rollout, torch.arange(len(rollout)), norm,
                                               make_plan(cfg).update, 0.0, update.MetricAverager())
        assert finite
        casts = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                    if e.key == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == weight_shape)
        return {n: p.grad.clone() for n, p in model.named_parameters()}, casts

    shared, shared_casts = gradient_and_casts(True)
    separate, separate_casts = gradient_and_casts(False)
    # 9 rows in micro-batches of 2: the prompt pass and 5 packed passes. Every square (64, 64) weight
    # of the tiny model (q_proj and o_proj of 2 layers) is cast once per pass without the shared casts
    # and once per step with them: at least 4 x 5 fewer casts of that shape
    assert separate_casts - shared_casts >= 4 * 5
    for name, grad in shared.items():
        torch.testing.assert_close(grad, separate[name], atol=1e-6, rtol=1e-5, msg=name)
