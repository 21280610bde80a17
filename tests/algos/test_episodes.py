"""Multi-turn episodes: every estimator over the model's tokens only, on a two-turn example derived by hand.

An episode's response is the model's turns with the environment's tokens (tool results) between them;
`response_mask` is 1 on the model's tokens only (covey/batch.py). The estimators see the environment's
tokens as holes: no advantage, return or reward there, nothing read there (values and KL estimates at
those positions are garbage, 99 and 7 below, and change nothing), and each recursion runs over the
model's tokens in order, so an episode gives the numbers of the same tokens laid end to end (compacted).

One group of two episodes, L = 7 (t0..t6):

    row A  mask [1, 1, 0, 0, 1, 1, 0]   turn 1 = t0 t1, environment t2 t3, turn 2 = t4 t5, padding t6
    row B  mask [1, 0, 0, 0, 1, 1, 0]   turn 1 = t0,    environment t1 t2 t3, turn 2 = t4 t5
    scores A = 1.0, B = 0.2; 4 model tokens in A, 3 in B (7 in the batch)
"""

import math

import torch

from covey.algos import AdvantageInput, AdvantageOptions, aggregate, compute_advantages, make_normalizer

F64 = torch.float64
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
SCORES = torch.tensor([1.0, 0.2], dtype=F64)
GARBAGE = ~MASK  # environment tokens and padding


def episode(**kw) -> AdvantageInput:
    return AdvantageInput(scores=SCORES, response_mask=MASK, group_ids=torch.tensor([0, 0]), **kw)


def on_model_tokens(row_a: list[float], row_b: list[float]) -> torch.Tensor:
    """(2, 7) with row A's values at t0 t1 t4 t5 and row B's at t0 t4 t5, 0 elsewhere."""
    out = torch.zeros(2, 7, dtype=F64)
    out[0, [0, 1, 4, 5]] = torch.tensor(row_a, dtype=F64)
    out[1, [0, 4, 5]] = torch.tensor(row_b, dtype=F64)
    return out


def compacted(x: torch.Tensor) -> torch.Tensor:
    """The model's tokens of each row laid end to end: (2, 4), row B padded with 0."""
    out = torch.zeros(2, 4, dtype=x.dtype)
    for i in range(2):
        kept = x[i][MASK[i]]
        out[i, :len(kept)] = kept
    return out


def expanded(x: torch.Tensor) -> torch.Tensor:
    """compacted's inverse: (2, 4) back onto the model's tokens of (2, 7)."""
    out = torch.zeros(2, 7, dtype=x.dtype)
    for i in range(2):
        out[i, MASK[i]] = x[i, :int(MASK[i].sum())]
    return out


def test_grpo_one_advantage_per_episode_on_every_model_token():
    # mean (1.0 + 0.2) / 2 = 0.6, population std 0.4 -> A = +1 (row A), -1 (row B), eps 0
    adv, ret, metrics = compute_advantages("grpo", episode(), AdvantageOptions(eps=0.0))
    assert torch.allclose(adv, on_model_tokens([1, 1, 1, 1], [-1, -1, -1]))
    assert torch.allclose(ret, on_model_tokens([1.0] * 4, [0.2] * 3))
    # metrics count model tokens: mean advantage (4 - 3) / 7; mean return (4 * 1.0 + 3 * 0.2) / 7
    assert math.isclose(metrics["advantages/mean"], 1 / 7)
    assert math.isclose(metrics["returns/mean"], 4.6 / 7)


def test_grpo_token_credit_ranks_the_model_tokens_only():
    # uniform: A / T with T the model tokens: +1/4 on A's 4, -1/3 on B's 3
    adv, _, _ = compute_advantages("grpo", episode(), AdvantageOptions(eps=0.0, token_credit="uniform"))
    assert torch.allclose(adv, on_model_tokens([0.25] * 4, [-1 / 3] * 3))
    # discounted, gamma 0.5: token of rank k of T gets gamma^(T-k) / sum_j gamma^(T-j), ranks over model tokens:
    # A (T=4): [0.125, 0.25, 0.5, 1] / 1.875 = [1, 2, 4, 8] / 15; B (T=3): -[0.25, 0.5, 1] / 1.75 = -[1, 2, 4] / 7
    adv, _, _ = compute_advantages("grpo", episode(),
                                   AdvantageOptions(eps=0.0, gamma=0.5, token_credit="discounted"))
    assert torch.allclose(adv, on_model_tokens([1 / 15, 2 / 15, 4 / 15, 8 / 15], [-1 / 7, -2 / 7, -4 / 7]))


def test_grpo_global_token_whitens_over_the_model_tokens():
    # centred only: +0.4 on A's 4 tokens, -0.4 on B's 3; whitened over those 7 tokens (population std):
    # a on A, b on B with 4a + 3b = 0 and 4a^2 + 3b^2 = 7 -> a = sqrt(3)/2 = 0.866025, b = -4a/3 = -1.154701
    # (mean 0.4/7, deviations 2.4/7 and -3.2/7, var 53.76/343, std 0.395898)
    adv, _, _ = compute_advantages("grpo", episode(), AdvantageOptions(eps=0.0, normalize="global_token"))
    a = math.sqrt(3) / 2
    assert torch.allclose(adv, on_model_tokens([a] * 4, [-4 * a / 3] * 3))


def test_rloo_and_remax_with_kl_in_the_sequence_reward():
    # token_kl on model tokens: A [0.2, 0.4 | 0.2, 0.0], B [0.4 | 0.2, 0.2]; 7 on every other position
    # kl_coef 0.5: r_A = 1.0 - 0.5 * 0.8 = 0.6, r_B = 0.2 - 0.5 * 0.8 = -0.2 (the 7s would make them -13.4 / -14.2)
    # RLOO, groups of 2: r_i - r_other -> +0.8, -0.8; returns are the sequence rewards
    kl = on_model_tokens([0.2, 0.4, 0.2, 0.0], [0.4, 0.2, 0.2]).masked_fill(GARBAGE, 7.0)
    adv, ret, _ = compute_advantages("rloo", episode(token_kl=kl, kl_coef=0.5))
    assert torch.allclose(adv, on_model_tokens([0.8] * 4, [-0.8] * 3))
    assert torch.allclose(ret, on_model_tokens([0.6] * 4, [-0.2] * 3))
    # ReMax, greedy rewards 0.5 and 0.5, no KL: 1.0 - 0.5 = 0.5, 0.2 - 0.5 = -0.3
    adv, _, _ = compute_advantages("remax", episode(baseline_scores=torch.tensor([0.5, 0.5], dtype=F64)))
    assert torch.allclose(adv, on_model_tokens([0.5] * 4, [-0.3] * 3))


VALUES = on_model_tokens([0.1, 0.2, 0.4, 0.5], [0.3, 0.6, 0.1]).masked_fill(GARBAGE, 99.0)


def test_gae_runs_over_the_model_tokens_skipping_the_environment():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45); V after the last model token = 0; score on the last model token
    # row A, model tokens t0 t1 t4 t5 with V [0.1, 0.2, 0.4, 0.5], r [0, 0, 0, 1]:
    #   t5: delta = 1 - 0.5 = 0.5,                A = 0.5
    #   t4: delta = 0.9 * 0.5 - 0.4 = 0.05,       A = 0.05 + 0.45 * 0.5 = 0.275
    #   t1: delta = 0.9 * 0.4 - 0.2 = 0.16,       A = 0.16 + 0.45 * 0.275 = 0.28375   (t1's next state is t4's)
    #   t0: delta = 0.9 * 0.2 - 0.1 = 0.08,       A = 0.08 + 0.45 * 0.28375 = 0.2076875
    #   returns A + V = [0.3076875, 0.48375, 0.675, 1.0]
    # row B, model tokens t0 t4 t5 with V [0.3, 0.6, 0.1], r [0, 0, 0.2]:
    #   t5: delta = 0.2 - 0.1 = 0.1,              A = 0.1
    #   t4: delta = 0.9 * 0.1 - 0.6 = -0.51,      A = -0.51 + 0.45 * 0.1 = -0.465
    #   t0: delta = 0.9 * 0.6 - 0.3 = 0.24,       A = 0.24 + 0.45 * (-0.465) = 0.03075
    #   returns [0.33075, 0.135, 0.2]
    opts = AdvantageOptions(gamma=0.9, lam=0.5)
    adv, ret, _ = compute_advantages("gae", episode(values=VALUES), opts)
    assert torch.allclose(adv, on_model_tokens([0.2076875, 0.28375, 0.275, 0.5], [0.03075, -0.465, 0.1]))
    assert torch.allclose(ret, on_model_tokens([0.3076875, 0.48375, 0.675, 1.0], [0.33075, 0.135, 0.2]))
    # the same tokens compacted give the same numbers
    dense = AdvantageInput(scores=SCORES, response_mask=compacted(MASK.long()).bool(), group_ids=torch.tensor([0, 0]),
                           values=compacted(VALUES))
    dense_adv, dense_ret, _ = compute_advantages("gae", dense, opts)
    assert torch.allclose(expanded(dense_adv), adv) and torch.allclose(expanded(dense_ret), ret)


def test_gae_with_kl_in_the_reward_equals_the_compacted_episode():
    # KL on the model tokens only (7 elsewhere would add -3.5 per environment token); checked against compaction
    kl = on_model_tokens([0.2, 0.4, 0.2, 0.0], [0.4, 0.2, 0.2]).masked_fill(GARBAGE, 7.0)
    opts = AdvantageOptions(gamma=0.9, lam=0.5)
    adv, ret, _ = compute_advantages("gae", episode(values=VALUES, token_kl=kl, kl_coef=0.5), opts)
    dense = AdvantageInput(scores=SCORES, response_mask=compacted(MASK.long()).bool(), group_ids=torch.tensor([0, 0]),
                           values=compacted(VALUES), token_kl=compacted(kl), kl_coef=0.5)
    dense_adv, dense_ret, _ = compute_advantages("gae", dense, opts)
    assert torch.allclose(expanded(dense_adv), adv) and torch.allclose(expanded(dense_ret), ret)
    # row A's last token by hand: r = 1.0 - 0.5 * 0.0 = 1.0, delta = 1.0 - 0.5 = 0.5; t4: r = -0.1,
    # delta = -0.1 + 0.45 - 0.4 = -0.05, A = -0.05 + 0.45 * 0.5 = 0.175
    assert torch.allclose(adv[0, [4, 5]], torch.tensor([0.175, 0.5], dtype=F64))


def test_reinforce_pp_returns_over_the_model_tokens_with_kl_in_the_reward():
    # kl_coef 0.5, token_kl as above: r_t = -0.5 * KL_t, + score on the last model token; gamma 0.9
    # row A: r [-0.1, -0.2 | -0.1, 1.0]: G5 = 1.0, G4 = -0.1 + 0.9 = 0.8, G1 = -0.2 + 0.72 = 0.52,
    #        G0 = -0.1 + 0.468 = 0.368
    # row B: r [-0.2 | -0.1, -0.1 + 0.2 = 0.1]: G5 = 0.1, G4 = -0.1 + 0.09 = -0.01, G0 = -0.2 - 0.009 = -0.209
    kl = on_model_tokens([0.2, 0.4, 0.2, 0.0], [0.4, 0.2, 0.2]).masked_fill(GARBAGE, 7.0)
    inp = episode(token_kl=kl, kl_coef=0.5)
    returns = on_model_tokens([0.368, 0.52, 0.8, 1.0], [-0.209, -0.01, 0.1])
    adv, ret, _ = compute_advantages("reinforce_pp", inp, AdvantageOptions(gamma=0.9, normalize="none"))
    assert torch.allclose(ret, returns) and torch.allclose(adv, returns)
    # whitened over the 7 model tokens (the default): mean 2.569 / 7 = 0.367, population var 1.156782 / 7
    # = 0.1652546, std 0.4065152; A = (G - 0.367) / 0.4065152
    adv, _, _ = compute_advantages("reinforce_pp", inp, AdvantageOptions(gamma=0.9, eps=0.0))
    expected = on_model_tokens([0.00246, 0.37637, 1.065151, 1.557138], [-1.416921, -0.927395, -0.656802])
    assert torch.allclose(adv, expected, atol=1e-6)
    # baseline variant: scores minus the group mean 0.6 -> 0.4, -0.4 on the last model token
    # row A: r [-0.1, -0.2 | -0.1, 0.4]: G5 = 0.4, G4 = -0.1 + 0.36 = 0.26, G1 = -0.2 + 0.234 = 0.034,
    #        G0 = -0.1 + 0.0306 = -0.0694
    # row B: r [-0.2 | -0.1, -0.1 - 0.4 = -0.5]: G5 = -0.5, G4 = -0.1 - 0.45 = -0.55, G0 = -0.2 - 0.495 = -0.695
    _, ret, _ = compute_advantages("reinforce_pp_baseline", inp, AdvantageOptions(gamma=0.9, normalize="none"))
    assert torch.allclose(ret, on_model_tokens([-0.0694, 0.034, 0.26, 0.4], [-0.695, -0.55, -0.5]))


def test_grpo_process_one_step_per_model_turn():
    # steps end at each turn's last model token: A at t1 and t5, B at t0 and t5; step rewards A [0.9, 0.1],
    # B [0.5, 0.3]. Group: mean 0.45, population var (0.2025 + 0.1225 + 0.0025 + 0.0225) / 4 = 0.0875,
    # s = sqrt(0.0875) = 0.2958040 -> normalised A [0.45, -0.35] / s, B [0.05, -0.15] / s
    # token advantage = sum over the steps ending at or after it:
    # A: t0 t1 (0.45 - 0.35) / s = 0.338062, t4 t5 -0.35 / s = -1.183216; B: t0 -0.1 / s, t4 t5 -0.15 / s
    inp = episode(step_scores=torch.tensor([[0.9, 0.1], [0.5, 0.3]], dtype=F64),
                  step_ends=torch.tensor([[1, 5], [0, 5]]))
    adv, ret, _ = compute_advantages("grpo_process", inp, AdvantageOptions(eps=0.0))
    s = math.sqrt(0.0875)
    assert torch.allclose(adv, on_model_tokens([0.1 / s, 0.1 / s, -0.35 / s, -0.35 / s],
                                               [-0.1 / s, -0.15 / s, -0.15 / s]))
    # returns: raw step rewards summed the same way: A t0 t1 1.0, t4 t5 0.1; B t0 0.8, t4 t5 0.3
    assert torch.allclose(ret, on_model_tokens([1.0, 1.0, 0.1, 0.1], [0.8, 0.3, 0.3]))


def test_aggregation_counts_the_model_tokens():
    # per-token loss x with 50 on every environment / padding position (read nowhere):
    # token_mean: (1 + 2 + 3 + 4 + 5 + 6 + 7) / 7 = 4; seq_mean_token_mean: (10 / 4 + 18 / 3) / 2 = 4.25;
    # seq_mean_token_sum: (10 + 18) / 2 = 14; constant (max_len 7): 28 / (2 * 7) = 2
    x = on_model_tokens([1, 2, 3, 4], [5, 6, 7]).masked_fill(GARBAGE, 50.0)
    expected = {"token_mean": 4.0, "seq_mean_token_mean": 4.25, "seq_mean_token_sum": 14.0, "constant": 2.0}
    for mode, value in expected.items():
        norm = make_normalizer(mode, MASK)
        assert (norm.total_tokens, norm.num_seqs) == (7, 2)
        assert math.isclose(float(aggregate(x, MASK, norm)), value), mode
