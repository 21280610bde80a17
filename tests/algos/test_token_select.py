"""High-entropy token selection and the Clip-Cov / KL-Cov selections, derived by hand."""

from types import SimpleNamespace

import pytest
import torch

from covey import algos
from covey.algos import (
    CovOptions,
    Normalizer,
    ObjectiveOptions,
    PolicyInputs,
    high_entropy_mask,
    select_cov_tokens,
    token_covariance,
)
from covey.algos.token_select import clip_cov_select, kl_cov_select
from covey.config.schema_algo import ClipCovOptions, KLCovOptions

# Entropies of two rows, L = 4; the masked 9.0 must not count.
#   valid values sorted: 0.1, 0.5, 1.0, 2.0, 3.0 (5 tokens)
ENTROPY = torch.tensor([[0.5, 2.0, 1.0, 9.0], [3.0, 0.1, 7.0, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)


def test_high_entropy_quantile_by_hand():
    # quantile 0.4 keeps the top 40%: threshold = the 0.6 quantile, linear interpolation at
    # position 0.6 * (5 - 1) = 2.4 between 1.0 and 2.0: 1.0 + 0.4 * 1.0 = 1.4 -> kept: 2.0 and 3.0
    kept, metrics = high_entropy_mask(ENTROPY, MASK, 0.4)
    assert kept.tolist() == [[False, True, False, False], [True, False, False, False]]
    assert metrics["select/entropy_threshold"] == pytest.approx(1.4)
    assert metrics["select/entropy_kept_frac"] == pytest.approx(2 / 5)


def test_high_entropy_quantile_edges():
    assert high_entropy_mask(ENTROPY, MASK, 1.0)[0].tolist() == MASK.tolist()  # 1 keeps every valid token
    only_top = high_entropy_mask(ENTROPY, MASK, 0.0)[0]  # threshold = max = 3.0
    assert only_top.tolist() == [[False] * 4, [True, False, False, False]]
    ties = high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), 0.2)[0]  # threshold 1.0: every tie kept
    assert bool(ties.all())
    empty = high_entropy_mask(ENTROPY, torch.zeros_like(MASK), 0.2)[0]
    assert not bool(empty.any())
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(ENTROPY, MASK, 1.5)


def test_high_entropy_mask_equals_trl():
    """TRL 1.16's GRPOTrainer.get_high_entropy_mask on identical float64 inputs, one process."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is not installed (pip install trl==1.16.0)")
    one_process = SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t)
    stub = SimpleNamespace(accelerator=one_process)
    gen = torch.Generator().manual_seed(0)
    # values a float32 holds exactly: TRL takes the quantile of `.float()` values
    entropy = (torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3).float().double()
    mask = torch.rand(6, 9, generator=gen) > 0.3
    for quantile in (0.0, 0.2, 0.5, 0.8, 1.0):
        ours = high_entropy_mask(entropy, mask, quantile)[0]
        theirs = trl.GRPOTrainer.get_high_entropy_mask(stub, entropy, mask.double(), 1.0 - quantile)
        assert torch.equal(ours, theirs.bool()), quantile


# Covariance: advantages and log-probs of two rows with two valid tokens each.
#   mean A = (1 + 1 - 1 - 1) / 4 = 0; mean logp = (-1 - 3 - 2 - 2) / 4 = -2
#   cov = (A - 0)(logp + 2): [1 * 1, 1 * -1, -, -1 * 0, -1 * 0] = [[1, -1, 0], [0, 0, 0]]
def test_token_covariance_by_hand():
    adv = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, 5.0]])
    logp = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    cov = token_covariance(adv, logp, mask)
    assert cov.tolist() == [[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]


# Six valid tokens with these covariances; lb = 1, ub = 5 leaves the candidates 2.0, 3.0, 1.5, 4.0.
COV = torch.tensor([[0.5, 2.0, 6.0], [3.0, 1.5, 4.0]], dtype=torch.float64)
ALL = torch.ones(2, 3, dtype=torch.bool)


def test_clip_cov_draws_its_count_among_candidates():
    # count = max(floor(0.34 * 6), 1) = max(2, 1) = 2 of the 4 candidates
    opts = CovOptions(control="clip_cov", clip_cov=ClipCovOptions(ratio=0.34, lb=1.0, ub=5.0))
    candidates = (COV > 1.0) & (COV < 5.0)
    picks = [clip_cov_select(COV, ALL, opts, torch.Generator().manual_seed(s)) for s in range(8)]
    for chosen in picks:
        assert int(chosen.sum()) == 2 and not bool((chosen & ~candidates).any())
    again = clip_cov_select(COV, ALL, opts, torch.Generator().manual_seed(3))
    assert torch.equal(again, picks[3])  # the same seed draws the same tokens (resume is exact)
    assert len({tuple(p.flatten().tolist()) for p in picks}) > 1  # and the draw is random
    tiny = CovOptions(control="clip_cov", clip_cov=ClipCovOptions(ratio=1e-4))  # floor(6e-4) = 0 -> at least 1
    assert int(clip_cov_select(COV, ALL, tiny, torch.Generator().manual_seed(0)).sum()) == 1
    none = CovOptions(control="clip_cov", clip_cov=ClipCovOptions(lb=10.0, ub=20.0))  # no candidate: nothing dropped
    assert not bool(clip_cov_select(COV, ALL, none, torch.Generator()).any())


def test_kl_cov_takes_the_largest():
    # count = max(floor(6 * 0.34), 1) = 2: the covariances 6.0 (0, 2) and 4.0 (1, 2)
    opts = CovOptions(control="kl_cov", kl_cov=KLCovOptions(ratio=0.34))
    assert kl_cov_select(COV, ALL, opts, torch.Generator()).tolist() == [[False, False, True], [False, False, True]]
    # a masked token's covariance never counts: without (0, 2) the two largest are 4.0 and 3.0
    mask = ALL.clone()
    mask[0, 2] = False  # 5 valid tokens: floor(5 * 0.34) = 1 -> the single largest, 4.0
    assert kl_cov_select(COV, mask, opts, torch.Generator()).tolist() == [[False, False, False], [False, False, True]]


def test_select_cov_tokens_metrics():
    adv = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, 5.0]])
    logp = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # covariances [[1, -1], [0, 0]] (test above): KL-Cov with count 1 takes (0, 0)
    chosen, metrics = select_cov_tokens(adv, logp, mask, CovOptions(control="kl_cov"), torch.Generator())
    assert chosen.tolist() == [[True, False, False], [False, False, False]]
    assert metrics == {"select/cov_mean": pytest.approx(0.0), "select/cov_frac": pytest.approx(0.25)}
    assert select_cov_tokens(adv, logp, mask, CovOptions(), torch.Generator()) == (None, {})


def test_clip_cov_drops_the_token_in_the_objective():
    # on-policy ppo_clip, token_mean over 2 tokens: l_t = -A_t * r_t, r = 1
    #   plain:    (-1 - 2) / 2 = -1.5;  Clip-Cov dropping token 1: (-1 - 0) / 2 = -0.5
    #   gradient d/dlogp: -A_t * r_t / 2 = [-0.5, 0] (token 1 detached)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, 2.0]]), torch.ones(1, 2)
    norm = Normalizer("token_mean", 2, 1, 2)
    plain, _ = algos.policy_objective(PolicyInputs(logp, logp.detach(), adv, mask), norm)
    assert float(plain.detach()) == pytest.approx(-1.5)
    chosen = torch.tensor([[False, True]])
    loss, _ = algos.policy_objective(PolicyInputs(logp, logp.detach(), adv, mask, cov_tokens=chosen), norm,
                                     ObjectiveOptions(cov=CovOptions(control="clip_cov")))
    assert float(loss) == pytest.approx(-0.5)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.0])


def test_kl_cov_penalty_in_the_objective():
    # logp = [-1, -2], old = [-1.5, -2]: r = [e^0.5 = 1.6487, 1]; ppo_clip eps 0.2:
    #   token 0 (A = 1): max(-1.6487, -1.2) = -1.2 (clipped); token 1 (A = 2): -2
    #   policy loss (token_mean) = (-1.2 - 2) / 2 = -1.6
    #   KL-Cov on token 0, coef 0.1: 0.1 * |-1 + 1.5| / 2 = 0.025 -> loss -1.575
    #   gradient on token 0: policy 0 (clipped), penalty 0.1 * sign(0.5) / 2 = 0.05;
    #   on token 1: -A r / 2 = -1
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.5, -2.0]]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2)
    loss, _ = algos.policy_objective(PolicyInputs(logp, old, adv, mask, cov_tokens=torch.tensor([[True, False]])),
                                     Normalizer("token_mean", 2, 1, 2),
                                     ObjectiveOptions(cov=CovOptions(control="kl_cov", kl_cov=KLCovOptions(coef=0.1))))
    assert float(loss) == pytest.approx(-1.575)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.05, -1.0])


def test_cov_options_refuse_bad_values():
    with pytest.raises(ValueError, match="cov_control"):
        CovOptions(control="cov").validate()
    with pytest.raises(ValueError, match="clip_cov.lb"):
        CovOptions(control="clip_cov", clip_cov=ClipCovOptions(lb=5.0, ub=1.0)).validate()
