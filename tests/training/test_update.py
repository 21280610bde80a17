"""The policy update on the tiny model: micro-batch ordering (covey.training.update.by_prompt) groups a
mini-batch by prompt without changing the update; garbage at padded positions never reaches the
trainer's micro-batch loss or its gradient; AdamW's state allocated up front."""

import copy
import math

import pytest
import torch

from covey import algos
from covey.algos import make_normalizer
from covey.config import Config
from covey.models.load import load_policy
from covey.training import update
from covey.training.optim import allocate_adamw_state
from covey.training.plan import make_plan
from covey.training.update import Optimized, UpdateState, by_prompt, update_policy
from tests.helpers import grouped_rollout


def test_by_prompt_puts_groups_together_stably():
    groups = torch.tensor([2, 0, 1, 0, 2, 1, 0])
    batch = torch.tensor([6, 1, 4, 3, 0])
    assert by_prompt(batch, groups).tolist() == [6, 1, 3, 4, 0]  # groups 0, 0, 0, 2, 2 in batch order


def one_update(model, rollout, cfg, order_fn, monkeypatch):
    """Parameters after one SGD(lr=1) step of update_policy with micro-batches in `order_fn`'s order."""
    model = copy.deepcopy(model)
    with monkeypatch.context() as patch:  # undoes only this patch (not conftest's)
        patch.setattr(update, "by_prompt", order_fn)
        target = Optimized(model, torch.optim.SGD(model.parameters(), lr=1.0), None, UpdateState())
        update_policy(target, rollout, make_plan(cfg).update, 0.0, torch.Generator().manual_seed(0))
    return dict(model.named_parameters())


def test_grouped_micro_batches_give_the_same_step_as_interleaved_ones(tiny_model_dir, monkeypatch):
    model, tokenizer = load_policy(tiny_model_dir)
    rollout = grouped_rollout(tokenizer, groups=3, group_size=2)
    shape = rollout.response_ids.shape
    rollout.advantages = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.optim.max_grad_norm, cfg.rollout.max_new_tokens = 2, 0.0, 7
    grouped = one_update(model, rollout, cfg, by_prompt, monkeypatch)
    interleaved = one_update(model, rollout, cfg, lambda batch, groups: batch[torch.tensor([0, 2, 4, 1, 3, 5])],
                             monkeypatch)
    for name, param in grouped.items():
        torch.testing.assert_close(param, interleaved[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(grouped.values(), model.parameters()))  # it did move


def test_adamw_moments_allocated_up_front_give_the_same_steps():
    # allocate_adamw_state must leave AdamW exactly where its own lazy start would: same state
    # entries (dtypes, devices), and bit-equal parameters and moments after several steps
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    runs = []
    for up_front in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.99), weight_decay=0.01, fused=True)
        if up_front:
            allocate_adamw_state(opt)
            assert all(int(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any() for p in params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt.state))
    (lazy, lazy_state), (primed, primed_state) = runs
    for a, b in zip(lazy, primed):
        assert torch.equal(a, b)
        assert lazy_state[a].keys() == primed_state[b].keys()
        for key in lazy_state[a]:
            x, y = lazy_state[a][key], primed_state[b][key]
            assert (x.dtype, x.device) == (y.dtype, y.device) and torch.equal(x, y)


def test_adamw_state_is_left_alone_where_not_fused():
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1, fused=False)
    allocate_adamw_state(opt)
    assert len(opt.state) == 0


def poisoned_pass(real, fill):
    """policy_logprobs whose log-probs and entropy carry `fill` at padded response positions, added
    (not written over) so that a gradient reaching those positions flows on into the model."""
    def wrapped(model, part, *args, **kwargs):
        logp, entropy, width = real(model, part, *args, **kwargs)
        pad = ~part.response_mask[:, :width].bool()
        poison = torch.where(pad, torch.tensor(fill), torch.tensor(0.0))
        return logp + poison, entropy + poison.abs(), width
    return wrapped


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_garbage_at_padded_positions_changes_nothing(tiny_model_dir, monkeypatch, fill):
    # The trainer's own micro-batch loss with the KL and the entropy in it: NaN or +inf at padded
    # positions of old_logp, ref_logp, the advantages, the sampler's log-probs, the importance weights and the
    # pass's own log-probs and entropy must
    # give the loss, gradient and metrics of zeros there (every term is masked before any estimator).
    model, tokenizer = load_policy(tiny_model_dir)
    rollout = grouped_rollout(tokenizer, groups=2, group_size=3)
    pad = ~rollout.response_mask.bool()
    assert pad.any()
    with torch.no_grad():
        logp, _, _ = update.policy_logprobs(model, rollout, 1.0)
    g = torch.Generator().manual_seed(3)
    rollout.old_logp = logp + 0.1 * torch.randn(logp.shape, generator=g)
    rollout.ref_logp = logp - 0.3 * torch.rand(logp.shape, generator=g)
    rollout.advantages = torch.randn(logp.shape, generator=g)
    rollout.sample_logp = rollout.old_logp - 0.1 * torch.rand(logp.shape, generator=g)
    rollout.is_weights = torch.rand(logp.shape, generator=g) * 2
    cfg = Config()
    cfg.algo.entropy_coef, cfg.rollout.max_new_tokens = 0.01, rollout.response_ids.shape[1]
    opts = make_plan(cfg).update
    assert opts.kl_in_loss and opts.entropy_coef > 0
    norm = make_normalizer(opts.loss_agg, rollout.response_mask, opts.max_len)

    def loss_and_grads(part):
        model.zero_grad(set_to_none=True)
        loss, metrics = update.micro_policy_loss(model, part, norm, opts, kl_coef=0.04)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], metrics

    clean = copy.copy(rollout)
    for key in ("old_logp", "ref_logp", "advantages", "sample_logp", "is_weights"):
        setattr(clean, key, getattr(rollout, key).masked_fill(pad, 0.0))
        setattr(rollout, key, getattr(rollout, key).masked_fill(pad, fill))
    loss, grads, metrics = loss_and_grads(clean)
    monkeypatch.setattr(update, "policy_logprobs", poisoned_pass(update.policy_logprobs, fill))
    bad_loss, bad_grads, bad_metrics = loss_and_grads(rollout)
    assert torch.isfinite(bad_loss) and all(torch.isfinite(g).all() for g in bad_grads)
    assert torch.equal(bad_loss, loss) and all(torch.equal(a, b) for a, b in zip(bad_grads, grads))
    assert bad_metrics == metrics and {"kl/ref", "policy/entropy"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss", ["ppo_clip", "gmpo", "vespo"])
def test_the_token_devices_reach_the_objective(tiny_model_dir, loss):
    # The rollout's importance weights, kept tokens and sampler log-probs reach the micro-batch loss as the
    # objective's own inputs, never folded into the advantages: the trainer's loss equals policy_objective on the
    # same tensors, and moves when they do. (What each loss does with them: tests/training/test_loss_devices.py.)
    model, tokenizer = load_policy(tiny_model_dir)
    rollout = grouped_rollout(tokenizer, groups=2, group_size=3)
    cfg = Config()
    cfg.algo.policy_loss, cfg.rollout.max_new_tokens = loss, rollout.response_ids.shape[1]
    opts = make_plan(cfg).update
    with torch.no_grad():
        logp, entropy, _ = update.policy_logprobs(model, rollout, opts.temperature, with_entropy=True,
                                                  precision=opts.autocast)
    g = torch.Generator().manual_seed(5)
    rollout.old_logp = logp + 0.1 * torch.randn(logp.shape, generator=g)
    rollout.advantages = torch.randn(logp.shape[0], generator=g)[:, None].expand(logp.shape).clone()
    rollout.sample_logp = rollout.old_logp - 0.3 * torch.rand(logp.shape, generator=g)
    per_sequence = loss == "gmpo"   # gmpo reads one importance weight per sequence
    rollout.is_weights = torch.rand(logp.shape[0] if per_sequence else logp.shape, generator=g) + 0.5
    rollout.is_weights = rollout.is_weights[:, None].expand(logp.shape) if per_sequence else rollout.is_weights
    rollout.kept_tokens = torch.rand(logp.shape, generator=g) > 0.3
    norm = make_normalizer(opts.loss_agg, rollout.response_mask, opts.max_len)
    with torch.no_grad():
        got, _ = update.micro_policy_loss(model, rollout, norm, opts, kl_coef=0.0)
        inp = algos.PolicyInputs(logp, rollout.old_logp, rollout.advantages, rollout.response_mask,
                                 entropy=entropy, kept=rollout.kept_tokens, is_weights=rollout.is_weights,
                                 sample_logp=rollout.sample_logp)
        expected, _ = algos.policy_objective(inp, norm, algos.ObjectiveOptions(loss, opts.loss))
        plain, _ = algos.policy_objective(algos.PolicyInputs(logp, rollout.old_logp, rollout.advantages,
                                                             rollout.response_mask), norm,
                                          algos.ObjectiveOptions(loss, opts.loss))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert abs(float(got) - float(plain)) > 1e-4
