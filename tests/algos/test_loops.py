"""Vectorised estimators against plain-Python-loop references on random inputs (holes in masks included)."""

import math
import random

import pytest
import torch

from covey.algos import AdvantageInput, AdvantageOptions, compute_advantages, group_stats

F64 = torch.float64


def random_batch(seed, n=12, length=9, ids=(-5, 3, 100, 7)):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, length, generator=g) < 0.75
    mask[0] = False                      # an empty response
    mask[1, :] = True                    # a full one
    return AdvantageInput(
        scores=torch.randn(n, generator=g, dtype=F64),
        response_mask=mask,
        group_ids=torch.tensor([ids[i % len(ids)] for i in torch.randperm(n, generator=g).tolist()]),
        values=torch.randn(n, length, generator=g, dtype=F64),
        token_kl=torch.rand(n, length, generator=g, dtype=F64),
        kl_coef=0.3,
    )


def loop_token_rewards(inp, i):
    idx = [t for t in range(inp.response_mask.shape[1]) if inp.response_mask[i, t]]
    r = [-inp.kl_coef * float(inp.token_kl[i, t]) for t in idx]
    if r:
        r[-1] += float(inp.scores[i])
    return idx, r


def loop_gae(inp, gamma, lam):
    n, length = inp.response_mask.shape
    adv, ret = torch.zeros(n, length, dtype=F64), torch.zeros(n, length, dtype=F64)
    for i in range(n):
        idx, r = loop_token_rewards(inp, i)
        v = [float(inp.values[i, t]) for t in idx]
        a_next, out = 0.0, []
        for k in reversed(range(len(idx))):
            v_next = v[k + 1] if k + 1 < len(idx) else 0.0
            a_next = r[k] + gamma * v_next - v[k] + gamma * lam * a_next
            out.append(a_next)
        for k, a in zip(idx, reversed(out)):
            adv[i, k] = a
        for k, a, vv in zip(idx, reversed(out), v):
            ret[i, k] = a + vv
    return adv, ret


def loop_returns(inp, gamma, scores):
    n, length = inp.response_mask.shape
    out = torch.zeros(n, length, dtype=F64)
    for i in range(n):
        saved = inp.scores[i].item()
        inp.scores[i] = scores[i]
        idx, r = loop_token_rewards(inp, i)
        inp.scores[i] = saved
        g = 0.0
        for k in reversed(range(len(idx))):
            g = r[k] + gamma * g
            out[i, idx[k]] = g
    return out


def loop_group_stats(x, ids, ddof):
    mean, std = {}, {}
    for gid in set(ids):
        vals = [v for v, j in zip(x, ids) if j == gid]
        mean[gid] = sum(vals) / len(vals)
        dof = len(vals) - ddof
        std[gid] = math.sqrt(sum((v - mean[gid]) ** 2 for v in vals) / dof) if dof > 0 else 0.0
    return mean, std


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (0.0, 0.5)])
def test_gae_matches_loop(seed, gamma, lam):
    inp = random_batch(seed)
    adv, ret, _ = compute_advantages("gae", inp, AdvantageOptions(gamma=gamma, lam=lam))
    ref_adv, ref_ret = loop_gae(inp, gamma, lam)
    assert torch.allclose(adv, ref_adv) and torch.allclose(ret, ref_ret)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.95, 0.5])
def test_reinforce_pp_returns_match_loop(seed, gamma):
    inp = random_batch(seed)
    _, ret, _ = compute_advantages("reinforce_pp", inp, AdvantageOptions(gamma=gamma))
    assert torch.allclose(ret, loop_returns(inp, gamma, inp.scores.tolist()))
    # baseline variant: subtract the group mean of the scores first
    mean, _ = loop_group_stats(inp.scores.tolist(), inp.group_ids.tolist(), 0)
    centred = [s - mean[j] for s, j in zip(inp.scores.tolist(), inp.group_ids.tolist())]
    _, ret_b, _ = compute_advantages("reinforce_pp_baseline", inp, AdvantageOptions(gamma=gamma))
    assert torch.allclose(ret_b, loop_returns(inp, gamma, centred))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ddof", [0, 1])
def test_group_statistics_and_grpo_rloo_match_loop(seed, ddof):
    rng = random.Random(seed)
    n = 40
    ids = [rng.choice([-3, 0, 8, 1000, 12]) for _ in range(n)]
    ids[0] = 77                                           # a singleton group
    x = [rng.choice([0.0, 0.5, 1.0]) if rng.random() < 0.5 else rng.gauss(0, 1) for _ in range(n)]
    stats = group_stats(torch.tensor(x, dtype=F64), torch.tensor(ids), ddof)
    mean, std = loop_group_stats(x, ids, ddof)
    assert torch.allclose(stats.mean, torch.tensor([mean[j] for j in ids], dtype=F64))
    assert torch.allclose(stats.std, torch.tensor([std[j] for j in ids], dtype=F64))
    inp = AdvantageInput(scores=torch.tensor(x, dtype=F64), response_mask=torch.ones(n, 1, dtype=torch.bool),
                         group_ids=torch.tensor(ids))
    eps = 1e-6
    adv, _, _ = compute_advantages("grpo", inp, AdvantageOptions(ddof=ddof, eps=eps))
    ref = [(v - mean[j]) / (std[j] + eps) for v, j in zip(x, ids)]
    assert torch.allclose(adv[:, 0], torch.tensor(ref, dtype=F64))
    loo, _, _ = compute_advantages("rloo", inp, AdvantageOptions())
    ref_loo = []
    for i, (v, j) in enumerate(zip(x, ids)):
        others = [w for k, (w, jj) in enumerate(zip(x, ids)) if jj == j and k != i]
        ref_loo.append(v - sum(others) / len(others) if others else 0.0)
    assert torch.allclose(loo[:, 0], torch.tensor(ref_loo, dtype=F64))


@pytest.mark.parametrize("seed", range(3))
def test_discounted_credit_matches_loop(seed):
    inp = random_batch(seed)
    inp.kl_coef = 0.0
    gamma = 0.9
    adv, _, _ = compute_advantages("grpo", inp, AdvantageOptions(token_credit="discounted", gamma=gamma,
                                                                 normalize="none"))
    mean, _ = loop_group_stats(inp.scores.tolist(), inp.group_ids.tolist(), 0)
    for i in range(inp.scores.shape[0]):
        idx = [t for t in range(inp.response_mask.shape[1]) if inp.response_mask[i, t]]
        a = inp.scores[i].item() - mean[inp.group_ids[i].item()]
        total = sum(gamma ** (len(idx) - k) for k in range(1, len(idx) + 1))
        for k, t in enumerate(idx, start=1):
            assert adv[i, t].item() == pytest.approx(gamma ** (len(idx) - k) * a / total)


@pytest.mark.parametrize("seed", range(3))
def test_process_supervision_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, length, steps = 8, 10, 4
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    step_mask = torch.rand(n, steps, generator=g) < 0.8
    ends = (torch.rand(n, steps, generator=g) * lengths[:, None]).long()
    scores = torch.randn(n, steps, generator=g, dtype=F64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    inp = AdvantageInput(scores=torch.zeros(n, dtype=F64), response_mask=mask, group_ids=ids,
                         step_scores=scores, step_ends=ends, step_mask=step_mask)
    eps = 1e-6
    adv, _, _ = compute_advantages("grpo_process", inp, AdvantageOptions(eps=eps))
    flat = [(scores[i, s].item(), ids[i].item()) for i in range(n) for s in range(steps) if step_mask[i, s]]
    mean, std = loop_group_stats([v for v, _ in flat], [j for _, j in flat], 0)
    for i in range(n):
        j = ids[i].item()
        for t in range(length):
            want = 0.0
            if mask[i, t]:
                for s in range(steps):
                    if step_mask[i, s] and ends[i, s] >= t and std[j] > 0:
                        want += (scores[i, s].item() - mean[j]) / (std[j] + eps)
            assert adv[i, t].item() == pytest.approx(want, abs=1e-9)
