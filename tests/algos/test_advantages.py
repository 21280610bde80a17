"""Group-baseline estimators (grpo, grpo_process, rloo, remax) on numbers derived by hand."""

import math

import pytest
import torch

from covey.algos import (
    ESTIMATORS,
    AdvantageInput,
    AdvantageOptions,
    Estimator,
    compute_advantages,
    grpo,
    spread_over_tokens,
    whiten,
)

F64 = torch.float64


def lengths_mask(lengths, width=None):
    width = max(lengths) if width is None else width
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def run(name, scores, lengths, groups, **kw):
    opts = AdvantageOptions(**kw.pop("opts", {}))
    inp = AdvantageInput(scores=torch.tensor(scores, dtype=F64), response_mask=lengths_mask(lengths),
                         group_ids=torch.tensor(groups), **kw)
    return compute_advantages(name, inp, opts)


# Two interleaved groups with arbitrary ids: id 7 holds rewards [1, 0], id 3 holds [2, 4, 6].
SCORES, GROUPS, LENGTHS = [1.0, 2.0, 0.0, 4.0, 6.0], [7, 3, 7, 3, 3], [2, 1, 3, 2, 1]


def test_grpo_group_normalisation_population_std():
    # id 7: mean 0.5, population std 0.5          -> (1-0.5)/0.5 = 1, (0-0.5)/0.5 = -1
    # id 3: mean 4, var (4+0+4)/3 = 8/3, std 1.63299 -> -2/1.63299 = -1.224745, 0, +1.224745
    adv, ret, m = run("grpo", SCORES, LENGTHS, GROUPS, opts=dict(eps=0.0))
    expected = [1.0, -math.sqrt(1.5), -1.0, 0.0, math.sqrt(1.5)]
    for i, (e, t) in enumerate(zip(expected, LENGTHS)):
        assert torch.allclose(adv[i, :t], torch.full((t,), e, dtype=F64)), i   # same value on every token
        assert (adv[i, t:] == 0).all()
        assert torch.allclose(ret[i, :t], torch.full((t,), SCORES[i], dtype=F64))  # returns = raw score
    assert m["groups/num"] == 2.0 and m["groups/zero_std_frac"] == 0.0


def test_grpo_ddof1_matches_torch_std():
    # id 3 with ddof 1: var 8/2 = 4, std 2 -> [-1, 0, 1]; id 7: var 0.5/1, std 0.70711 -> +-0.70711
    adv, _, _ = run("grpo", SCORES, LENGTHS, GROUPS, opts=dict(eps=0.0, ddof=1))
    assert torch.allclose(adv[:, 0], torch.tensor([1 / math.sqrt(2), -1.0, -1 / math.sqrt(2), 0.0, 1.0], dtype=F64))


def test_grpo_eps_is_added_to_std():
    # id 7: 0.5 / (0.5 + 0.1) = 0.8333
    adv, _, _ = run("grpo", SCORES, LENGTHS, GROUPS, opts=dict(eps=0.1))
    assert adv[0, 0].item() == pytest.approx(0.5 / 0.6)


def test_dr_grpo_only_subtracts_group_mean():
    # centred rewards: 1-0.5, 2-4, 0-0.5, 4-4, 6-4
    adv, _, _ = run("grpo", SCORES, LENGTHS, GROUPS, opts=dict(std_normalize=False))
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -2.0, -0.5, 0.0, 2.0], dtype=F64))


def test_grpo_batch_normalisation_group_mean_batch_std():
    # rewards [1, 0, 1, 1], groups [0, 0, 1, 1]: centred [0.5, -0.5, 0, 0] (group 1 all equal -> 0)
    # batch std of the raw rewards: mean 0.75, var (3 * 0.0625 + 0.5625) / 4 = 0.1875, std 0.4330127
    adv, _, _ = run("grpo", [1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1], [0, 0, 1, 1], opts=dict(normalize="batch", eps=0.0))
    s = math.sqrt(0.1875)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0], dtype=F64))


def test_token_credit_uniform_and_discounted():
    # one group [1, 0]: centred [0.5, -0.5] (normalize none); lengths 2 and 4
    # uniform: 0.5/2 = 0.25 per token; -0.5/4 = -0.125 per token
    adv, _, _ = run("grpo", [1.0, 0.0], [2, 4], [0, 0], opts=dict(normalize="none", token_credit="uniform"))
    assert torch.allclose(adv, torch.tensor([[0.25, 0.25, 0, 0], [-0.125] * 4], dtype=F64))
    # discounted, gamma 0.5: T=2 weights (0.5, 1)/1.5 -> 0.5*(1/3, 2/3) = (1/6, 1/3)
    # T=4 weights (0.125, 0.25, 0.5, 1)/1.875 -> -0.5 * (1/15, 2/15, 4/15, 8/15)
    adv, _, _ = run("grpo", [1.0, 0.0], [2, 4], [0, 0],
                    opts=dict(normalize="none", token_credit="discounted", gamma=0.5))
    assert torch.allclose(adv, torch.tensor([[1 / 6, 1 / 3, 0, 0], [-1 / 30, -1 / 15, -2 / 15, -4 / 15]], dtype=F64))
    assert torch.allclose(adv.sum(-1), torch.tensor([0.5, -0.5], dtype=F64))  # credit sums to A_i


def test_discounted_gamma_edge_cases():
    # gamma = 1 equals uniform; gamma = 0 puts all credit on the last token (0^0 = 1)
    uni, _, _ = run("grpo", [1.0, 0.0], [2, 3], [0, 0], opts=dict(normalize="none", token_credit="uniform"))
    g1, _, _ = run("grpo", [1.0, 0.0], [2, 3], [0, 0], opts=dict(normalize="none", token_credit="discounted"))
    assert torch.allclose(uni, g1)
    g0, _, _ = run("grpo", [1.0, 0.0], [2, 3], [0, 0],
                   opts=dict(normalize="none", token_credit="discounted", gamma=0.0))
    assert torch.allclose(g0, torch.tensor([[0, 0.5, 0], [0, 0, -0.5]], dtype=F64))


def test_global_token_worked_example():
    """A worked example that circulates in derivations: rewards 0.8, 0.6, lengths 3, 4, gamma 0.99,
    discounted credit, global-token normalisation.

    Step 1: mean 0.7, A_seq = +0.1, -0.1 (as the circulating example has it).
    Step 2: seq 1 weights 0.99^2, 0.99, 1 = 0.9801, 0.99, 1 (sum 2.9701):
              0.1 * w / 2.9701 = 0.0329989, 0.0333322, 0.0336689
            seq 2 weights 0.970299, 0.9801, 0.99, 1 (sum 3.940399):
             -0.1 * w / 3.940399 = -0.0246244, -0.0248731, -0.0251244, -0.0253781
            (the circulating example agrees to 4 decimals).
    Step 3: the 7 values sum to 0.1 - 0.1 = 0, so mu = 0 exactly.
            sum of squares = 0.00333356 + 0.00250032 = 0.00583387; population variance / 7 = 0.000833410,
            sigma = 0.0288688 (the circulating example says 0.0291).
            normalised = value / 0.0288688:
              seq 1:  1.14306,  1.15461,  1.16627
              seq 2: -0.85297, -0.86159, -0.87029, -0.87908
    The circulating example prints 0.1134, 0.1145, 0.1159 / -0.0846, ... : each value / 0.291 instead of / 0.0291,
    ten times too small.
    """
    adv, _, m = run("grpo", [0.8, 0.6], [3, 4], [0, 0],
                    opts=dict(token_credit="discounted", gamma=0.99, normalize="global_token", eps=0.0))
    expected = torch.tensor([[1.1430621, 1.1546082, 1.1662709, 0.0],
                             [-0.8529742, -0.8615901, -0.8702930, -0.8790839]], dtype=F64)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert m["advantages/mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["advantages/std"] == pytest.approx(1.0)
    # the circulating numbers are off by a factor of ~10
    assert adv[0, 0].item() / 0.1134 == pytest.approx(10.08, abs=0.01)


def test_reference_001_with_unbiased_std_differs():
    # ddof=1 (torch.std): sigma = sqrt(0.00583387 / 6) = 0.0311819 -> seq 1 token 1: 0.0329989 / 0.0311819 = 1.05827
    adv, _, _ = run("grpo", [0.8, 0.6], [3, 4], [0, 0],
                    opts=dict(token_credit="discounted", gamma=0.99, normalize="global_token", eps=0.0, ddof=1))
    assert adv[0, 0].item() == pytest.approx(1.0582699, abs=1e-6)


def test_rloo_leave_one_out_and_singleton():
    # group 0 = [1, 0, 1, 1]: 1 - (0+1+1)/3 = 1/3, 0 - 3/3 = -1, 1/3, 1/3; group 9 is a singleton -> 0
    adv, _, m = run("rloo", [1.0, 0.0, 1.0, 1.0, 5.0], [1] * 5, [0, 0, 0, 0, 9])
    assert torch.allclose(adv[:, 0], torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3, 0.0], dtype=F64))
    assert m["groups/zero_std_frac"] == 0.5  # the singleton counts as a zero-variance group


def test_remax_subtracts_greedy_reward():
    # 1 - 0.5 = 0.5, 0.2 - 0.5 = -0.3
    adv, _, _ = run("remax", [1.0, 0.2], [2, 1], [0, 1], baseline_scores=torch.tensor([0.5, 0.5], dtype=F64))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5], [-0.3, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="baseline_scores"):
        run("remax", [1.0], [1], [0])


def test_sequence_reward_includes_kl_in_reward():
    # scores [1, 0], token_kl 0.1 on each of 2 tokens, kl_coef 0.5: r = 1 - 0.5*0.2 = 0.9, 0 - 0.1 = -0.1
    # Dr. GRPO: mean 0.4 -> 0.5, -0.5; returns = sequence reward on every token
    kl = torch.full((2, 2), 0.1, dtype=F64)
    adv, ret, _ = run("grpo", [1.0, 0.0], [2, 2], [0, 0], token_kl=kl, kl_coef=0.5, opts=dict(std_normalize=False))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[0.9, 0.9], [-0.1, -0.1]], dtype=F64))


def process_input():
    # seq 0 (group 0, 4 tokens): steps r = [1, 0, 1] ending at tokens [0, 1, 3]
    # seq 1 (group 0, 3 tokens): step r = [0] ending at token 2; its 2nd step slot is padding (garbage, masked)
    # seq 2 (group 5, 2 tokens): steps [2, 2] -> an all-equal group -> 0
    return AdvantageInput(
        scores=torch.zeros(3, dtype=F64), response_mask=lengths_mask([4, 3, 2]), group_ids=torch.tensor([0, 0, 5]),
        step_scores=torch.tensor([[1.0, 0.0, 1.0], [0.0, 99.0, 0.0], [2.0, 2.0, 0.0]], dtype=F64),
        step_ends=torch.tensor([[0, 1, 3], [2, 0, 0], [0, 1, 0]]),
        step_mask=torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))


def test_grpo_process_supervision():
    # group 0 steps {1, 0, 1, 0}: mean 0.5, population std 0.5 -> normalised [1, -1, 1] and [-1]
    # seq 0: t0 sums steps ending >= 0: 1 - 1 + 1 = 1; t1: -1 + 1 = 0; t2, t3: 1
    # seq 1: every token <= 2: -1 (position 3 is padding -> 0)
    # returns: raw step rewards summed the same way: seq 0 [2, 1, 1, 1]
    adv, ret, m = compute_advantages("grpo_process", process_input(), AdvantageOptions(eps=0.0))
    assert torch.allclose(adv, torch.tensor([[1, 0, 1, 1], [-1, -1, -1, 0], [0, 0, 0, 0]], dtype=F64))
    assert torch.allclose(ret[0], torch.tensor([2, 1, 1, 1], dtype=F64))
    assert torch.allclose(ret[2], torch.tensor([4, 2, 0, 0], dtype=F64))
    assert m["groups/zero_std_frac"] == 0.5


def test_grpo_process_rejects_bad_steps():
    inp = process_input()
    inp.step_ends = torch.tensor([[0, 1, 4], [2, 0, 0], [0, 1, 0]])  # 4 is past the last token
    with pytest.raises(ValueError, match="step_ends"):
        compute_advantages("grpo_process", inp, AdvantageOptions())
    with pytest.raises(ValueError, match="step_scores"):
        run("grpo_process", [1.0], [2], [0])


def test_unknown_names_and_bad_options():
    inp = AdvantageInput(scores=torch.ones(2), response_mask=torch.ones(2, 2),
                         group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="valid: grpo, grpo_process, rloo"):
        compute_advantages("ppo", inp, AdvantageOptions())
    for bad in (dict(gamma=1.5), dict(gamma=-0.1), dict(lam=2.0), dict(ddof=-1), dict(token_credit="x"),
                dict(normalize="x"), dict(eps=-1.0)):
        with pytest.raises(ValueError):
            compute_advantages("grpo", inp, AdvantageOptions(**bad))
    with pytest.raises(ValueError, match="token_credit"):
        compute_advantages("reinforce_pp", inp, AdvantageOptions(token_credit="uniform"))
    with pytest.raises(ValueError, match="not defined for estimator 'gae'"):
        compute_advantages("gae", inp, AdvantageOptions(normalize="group"))
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("grpo", AdvantageInput(torch.ones(3), torch.ones(2, 2), torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="token_kl"):
        compute_advantages("grpo", AdvantageInput(torch.ones(2), torch.ones(2, 2), torch.zeros(2, dtype=torch.long),
                                                  kl_coef=0.1))


def test_registry_lists_every_estimator():
    assert set(ESTIMATORS) == {"grpo", "grpo_process", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "gae"}


def test_normalisation_traits_of_each_estimator():
    # what normalize=auto means (each paper's choice), which modes are defined, and which estimators
    # give one advantage per sequence (so token_credit applies): docs/algorithms.md, "normalize"
    every = ("group", "batch", "global_token", "none")
    token_level = ("global_token", "none")
    expected = {"grpo": ("group", every, True), "grpo_process": ("group", every, False),
                "rloo": ("none", every, True), "remax": ("none", every, True),
                "reinforce_pp": ("global_token", token_level, False),
                "reinforce_pp_baseline": ("global_token", token_level, False), "gae": ("none", token_level, False)}
    assert {name: (e.default_normalize, e.allowed_normalize, e.sequence_level)
            for name, e in ESTIMATORS.items()} == expected


def test_an_estimator_function_runs_the_mode_its_entry_resolved():
    inp = AdvantageInput(torch.tensor([1.0, 0.0]), torch.ones(2, 1), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="registry entry"):
        grpo(inp, AdvantageOptions())  # 'auto' is the entry's to resolve
    # called through its entry, grpo's auto is group: (+-0.5) / (0.5 + 1e-6) = +-0.999998
    adv, _, _ = ESTIMATORS["grpo"](inp, AdvantageOptions())
    assert adv[:, 0].tolist() == pytest.approx([0.999998, -0.999998], abs=1e-6)


def minus_half(seen):
    """A sequence-level estimator: A_i = r_i - 0.5, credited to tokens, whitened under global_token."""
    def fn(inp, opts):
        seen.append(opts.normalize)
        mask = inp.response_mask.bool()
        adv = spread_over_tokens(inp.scores.to(F64) - 0.5, mask, opts.token_credit, opts.gamma)
        if opts.normalize == "global_token":
            adv = whiten(adv, mask, ddof=opts.ddof, eps=opts.eps)
        return adv, adv.clone(), {}
    return fn


def test_a_new_estimator_is_one_registry_entry(monkeypatch):
    seen = []
    monkeypatch.setitem(ESTIMATORS, "minus_half", Estimator(minus_half(seen), sequence_level=True,
                                                            default_normalize="none",
                                                            allowed_normalize=("global_token", "none")))
    inp = AdvantageInput(scores=torch.tensor([1.0, 0.2], dtype=F64), response_mask=lengths_mask([2, 1]),
                         group_ids=torch.tensor([0, 0]))
    # auto = its default none; A = (1 - 0.5, 0.2 - 0.5) = (0.5, -0.3), uniform credit: 0.5 / 2 on each of 2 tokens
    adv, _, _ = compute_advantages("minus_half", inp, AdvantageOptions(token_credit="uniform"))
    assert adv.flatten().tolist() == pytest.approx([0.25, 0.25, -0.3, 0.0])
    # global_token whitens the valid tokens (0.25, 0.25, -0.3): the shape (a, a, -2a) after centring
    # (mean 0.2/3; deviations 0.55/3, 0.55/3, -1.1/3), population std 0.55/3 * sqrt(2) -> 1/sqrt2, 1/sqrt2, -sqrt2
    adv, _, _ = compute_advantages("minus_half", inp, AdvantageOptions(token_credit="uniform",
                                                                       normalize="global_token", eps=0.0))
    assert adv.flatten().tolist() == pytest.approx([2 ** -0.5, 2 ** -0.5, -2 ** 0.5, 0.0])
    assert seen == ["none", "global_token"]
    with pytest.raises(ValueError, match="normalize='group' is not defined for estimator 'minus_half'"):
        compute_advantages("minus_half", inp, AdvantageOptions(normalize="group"))
    # a token-level entry (sequence_level False) refuses token_credit: nothing silently ignored
    monkeypatch.setitem(ESTIMATORS, "minus_half", Estimator(minus_half(seen)))
    with pytest.raises(ValueError, match="token_credit='uniform' applies to sequence-level estimators"):
        compute_advantages("minus_half", inp, AdvantageOptions(token_credit="uniform"))


def test_estimators_do_not_track_gradients():
    scores = torch.tensor([1.0, 0.0], requires_grad=True)
    adv, ret, _ = compute_advantages("grpo", AdvantageInput(scores, torch.ones(2, 2), torch.zeros(2, dtype=torch.long)))
    assert not adv.requires_grad and not ret.requires_grad
