"""Masking invariance and numerical safety of every estimator and loss."""

import pytest
import torch

from covey.algos import (
    AGGREGATIONS,
    ESTIMATORS,
    AdvantageInput,
    AdvantageOptions,
    PolicyInputs,
    PolicyLossOptions,
    compute_advantages,
    entropy_loss,
    kl_loss,
    make_normalizer,
    policy_loss,
    value_loss,
)

F64 = torch.float64
NAMES = list(ESTIMATORS)


def batch(seed=0, n=8, length=6, steps=3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, length, generator=g) < 0.7
    mask[0] = False                                   # an empty response
    step_mask = torch.rand(n, steps, generator=g) < 0.7
    return AdvantageInput(
        scores=torch.randn(n, generator=g, dtype=F64), response_mask=mask,
        group_ids=torch.tensor([4, 4, 9, 9, 9, 1, 1, 2])[:n],
        values=torch.randn(n, length, generator=g, dtype=F64), token_kl=torch.rand(n, length, generator=g, dtype=F64),
        kl_coef=0.2, baseline_scores=torch.randn(n, generator=g, dtype=F64),
        step_scores=torch.randn(n, steps, generator=g, dtype=F64),
        step_ends=torch.randint(0, length, (n, steps), generator=g), step_mask=step_mask)


def for_estimator(name, inp):
    if name == "grpo_process":
        inp.kl_coef = 0.0
    return inp


def garbage_like(x, mask, fill):
    return torch.where(mask, x, torch.full_like(x, fill))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("normalize", ["auto", "global_token"])
@pytest.mark.parametrize("fill", [1e6, float("nan")])
def test_estimators_ignore_masked_positions(name, normalize, fill):
    inp = for_estimator(name, batch())
    opts = AdvantageOptions(normalize=normalize)
    adv, ret, _ = compute_advantages(name, inp, opts)
    m = inp.response_mask
    inp.values = garbage_like(inp.values, m, fill)
    inp.token_kl = garbage_like(inp.token_kl, m, fill)
    inp.step_scores = garbage_like(inp.step_scores, inp.step_mask, fill)
    adv2, ret2, _ = compute_advantages(name, inp, opts)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~m] == 0).all() and (ret[~m] == 0).all() and torch.isfinite(adv).all()


@pytest.mark.parametrize("name", NAMES)
def test_estimators_ignore_padding_columns(name):
    inp = for_estimator(name, batch())
    adv, ret, _ = compute_advantages(name, inp, AdvantageOptions())
    pad = lambda x, v=0.0: torch.cat([x, torch.full((x.shape[0], 3), v, dtype=x.dtype)], -1)  # noqa: E731
    inp.response_mask = pad(inp.response_mask, False)
    inp.values, inp.token_kl = pad(inp.values, 5.0), pad(inp.token_kl, 5.0)
    adv2, ret2, _ = compute_advantages(name, inp, AdvantageOptions())
    assert torch.allclose(adv2[:, :-3], adv) and torch.allclose(ret2[:, :-3], ret)
    assert (adv2[:, -3:] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_all_equal_groups_and_singletons_give_zero(name):
    # every group has equal rewards (0.1 is not exactly representable: the mean is not exactly 0.1)
    n, length = 6, 4
    inp = AdvantageInput(
        scores=torch.full((n,), 0.1), response_mask=torch.ones(n, length), group_ids=torch.tensor([0, 0, 0, 5, 5, 8]),
        values=torch.zeros(n, length), baseline_scores=torch.full((n,), 0.1),
        step_scores=torch.full((n, 2), 0.1), step_ends=torch.tensor([[1, 3]] * n))
    for eps in (0.0, 1e-6):
        adv, _, m = compute_advantages(name, inp, AdvantageOptions(eps=eps))
        assert torch.isfinite(adv).all()
        if name != "gae":   # GAE's advantage is r - V, not group-relative
            assert (adv == 0).all(), name
        if "groups/zero_std_frac" in m:
            assert m["groups/zero_std_frac"] == 1.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ddof", [0, 1])
def test_empty_responses_and_empty_batch(name, ddof):
    inp = for_estimator(name, batch())
    inp.response_mask = torch.zeros_like(inp.response_mask)
    inp.step_mask = torch.zeros_like(inp.step_mask)
    adv, ret, m = compute_advantages(name, inp, AdvantageOptions(ddof=ddof, normalize="auto"))
    assert (adv == 0).all() and (ret == 0).all()
    assert all(v == v for v in m.values())    # no NaN metric
    one = for_estimator(name, batch(n=1))
    adv, _, _ = compute_advantages(name, one, AdvantageOptions(ddof=ddof))
    assert torch.isfinite(adv).all()


def loss_inputs(seed=0, n=4, length=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, length, generator=g) < 0.7
    mask[0] = False
    return dict(
        logp=(torch.randn(n, length, generator=g, dtype=F64) * scale).requires_grad_(True),
        old=torch.randn(n, length, generator=g, dtype=F64) * scale,
        ref=torch.randn(n, length, generator=g, dtype=F64) * scale,
        adv=torch.randn(n, length, generator=g, dtype=F64),
        values=torch.randn(n, length, generator=g, dtype=F64).requires_grad_(True),
        old_values=torch.randn(n, length, generator=g, dtype=F64),
        returns=torch.randn(n, length, generator=g, dtype=F64),
        mask=mask)


def all_losses(d, mode, opts):
    norm = make_normalizer(mode, d["mask"], max_len=5)
    total, metrics = 0.0, {}
    for name in ("ppo_clip", "pg"):
        loss, m = policy_loss(name, PolicyInputs(d["logp"], d["old"], d["adv"], d["mask"], ref_logp=d["ref"]), norm,
                              opts)
        total, metrics = total + loss, {**metrics, **m}
    for kind in ("k1", "k3", "k3_st", "abs"):
        loss, m = kl_loss(d["logp"], d["ref"], d["mask"], norm, 0.1, kind)
        total = total + loss
    loss, m = entropy_loss(d["values"].abs(), d["mask"], norm, 0.01)  # any leaf with garbage where masked
    total = total + loss
    loss, m = value_loss(d["values"], d["old_values"], d["returns"], d["mask"], norm, 0.2)
    total, metrics = total + loss, {**metrics, **m}
    gl, gv = torch.autograd.grad(total, (d["logp"], d["values"]))
    return total, gl, gv, metrics


OPTS = [PolicyLossOptions(), PolicyLossOptions(dual_clip=3.0, ratio_level="sequence"),
        PolicyLossOptions(ratio_against="ref", clip_eps_high=10.0)]


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("opts", OPTS, ids=["token", "gspo_dual", "vs_ref"])
def test_losses_ignore_masked_positions(mode, opts):
    d = loss_inputs()
    total, gl, gv, metrics = all_losses(d, mode, opts)
    m = d["mask"]
    bad = {k: garbage_like(v.detach(), m, float("nan")) for k, v in d.items() if k != "mask"}
    bad["logp"].requires_grad_(True)
    bad["values"].requires_grad_(True)
    total2, gl2, gv2, metrics2 = all_losses({**bad, "mask": m}, mode, opts)
    assert torch.allclose(total, total2)
    assert torch.allclose(gl, gl2) and torch.allclose(gv, gv2)
    assert (gl2[~m] == 0).all() and (gv2[~m] == 0).all()
    assert metrics.keys() == metrics2.keys() and all(metrics[k] == pytest.approx(metrics2[k]) for k in metrics)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("opts", OPTS, ids=["token", "gspo_dual", "vs_ref"])
@pytest.mark.parametrize("log_ratio", [50.0, -50.0])
def test_extreme_log_ratios_stay_finite(mode, opts, log_ratio):
    d = loss_inputs()
    with torch.no_grad():
        d["old"] = d["logp"] - log_ratio
        d["ref"] = d["logp"] - log_ratio
    total, gl, gv, metrics = all_losses(d, mode, opts)
    assert torch.isfinite(total) and torch.isfinite(gl).all() and torch.isfinite(gv).all()
    assert all(v == v and abs(v) != float("inf") for v in metrics.values()), metrics


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_losses_with_an_all_zero_mask(mode):
    d = loss_inputs()
    d["mask"] = torch.zeros_like(d["mask"])
    total, gl, gv, metrics = all_losses(d, mode, PolicyLossOptions())
    assert total.item() == 0.0 and (gl == 0).all() and (gv == 0).all()
    assert all(v == v for v in metrics.values())
