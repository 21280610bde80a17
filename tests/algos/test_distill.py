"""The distillation and supervised losses of covey/algos/distill.py on numbers worked by hand (the derivations
are in the comments), their global normalisation over micro-batches, and GKD's divergence against TRL 1.16's
GKDTrainer.generalized_jsd_loss on the same logits (skipped without TRL)."""

import math

import pytest
import torch

from covey.algos import (
    generalized_jsd,
    jsd_loss,
    make_normalizer,
    reverse_kl_advantages,
    token_nll,
    top_k_logits,
)

F64 = torch.float64
LN = math.log

# Two tokens. Student logits (0, 0): p_S = (1/2, 1/2). Teacher logits (ln 3, 0): p_T = (3/4, 1/4).
STUDENT = torch.tensor([0.0, 0.0], dtype=F64)
TEACHER = torch.tensor([LN(3.0), 0.0], dtype=F64)
# KL(p_T || p_S) = 3/4 ln((3/4)/(1/2)) + 1/4 ln((1/4)/(1/2)) = 3/4 ln 1.5 - 1/4 ln 2
#                = 0.75 * 0.4054651 - 0.25 * 0.6931472 = 0.3040988 - 0.1732868 = 0.1308120
FORWARD_KL = 0.1308120
# KL(p_S || p_T) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) = 0.1438410
REVERSE_KL = 0.1438410
# beta = 1/2: M = (1/2)(1/2, 1/2) + (1/2)(3/4, 1/4) = (5/8, 3/8)
# KL(p_T || M) = 3/4 ln((3/4)/(5/8)) + 1/4 ln((1/4)/(3/8)) = 3/4 ln 1.2 + 1/4 ln(2/3)
#              = 0.75 * 0.1823216 - 0.25 * 0.4054651 = 0.1367412 - 0.1013663 = 0.0353749
# KL(p_S || M) = 1/2 ln((1/2)/(5/8)) + 1/2 ln((1/2)/(3/8)) = 1/2 ln 0.8 + 1/2 ln(4/3)
#              = 0.5 * (-0.2231436) + 0.5 * 0.2876821 = 0.0322693
# JSD_1/2 = 1/2 * 0.0353749 + 1/2 * 0.0322693 = 0.0338221
JSD_HALF = 0.0338221


def test_token_nll_by_hand_and_micro_batches_add_up():
    # log-probs (-1, -2, -3 | -0.5, -9, -9) with masks (1, 1, 0 | 1, 0, 0): three trained tokens
    # token_mean: (1 + 2 + 0.5) / 3 = 3.5 / 3 = 1.1666667
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    norm = make_normalizer("token_mean", mask)
    loss, metrics = token_nll(logp, mask, norm)
    assert loss.item() == pytest.approx(3.5 / 3)
    assert metrics["sft/loss"] == pytest.approx(3.5 / 3)
    loss.backward()  # d/d logp = -1/3 on each trained token, 0 elsewhere
    assert logp.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, -1 / 3, 0.0, 0.0])
    # each row alone with the step's normaliser: 3/3 + 0.5/3, summing to the step's loss (a per-micro-batch
    # mean would give (1.5 + 0.5) / 2 = 1.0 instead)
    parts = [token_nll(logp[i:i + 1], mask[i:i + 1], norm)[0].item() for i in range(2)]
    assert parts == pytest.approx([1.0, 0.5 / 3]) and sum(parts) == pytest.approx(3.5 / 3)
    # the micro-batch's own mean -logp: row 0 trains -1 and -2, mean 1.5
    assert token_nll(logp[:1], mask[:1], norm)[1]["sft/loss"] == pytest.approx(1.5)


def test_reverse_kl_advantages_by_hand():
    # student log-probs of the sampled tokens (-1, -2, -4), teacher's (-0.5, -3, -1); the third token masked
    # A = teacher - student = (0.5, -1, 0 masked); teacher_kl = mean(student - teacher) over the two = (-0.5 + 1) / 2
    student = torch.tensor([[-1.0, -2.0, -4.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -1.0]], dtype=F64)
    adv, metrics = reverse_kl_advantages(student, teacher, torch.tensor([[1, 1, 0]]))
    assert adv.tolist() == [[0.5, -1.0, 0.0]]
    assert metrics["distill/teacher_kl"] == pytest.approx(0.25)
    assert not adv.requires_grad  # an advantage weighs the loss; it carries no gradient
    # no trained token: no advantage, KL 0 (not NaN)
    assert reverse_kl_advantages(student, teacher, torch.zeros(1, 3))[1]["distill/teacher_kl"] == 0.0


def test_reverse_kl_advantage_is_zero_where_student_equals_teacher():
    # a student that assigns the teacher's probability to every sampled token has nothing to learn
    logp = torch.tensor([[-0.3, -1.7]])
    adv, metrics = reverse_kl_advantages(logp, logp.clone(), torch.ones(1, 2))
    assert adv.abs().max() == 0 and metrics["distill/teacher_kl"] == 0.0


@pytest.mark.parametrize("beta, expected", [(0.0, FORWARD_KL), (1.0, REVERSE_KL), (0.5, JSD_HALF)])
def test_generalized_jsd_by_hand(beta, expected):
    assert generalized_jsd(STUDENT, TEACHER, beta).item() == pytest.approx(expected, abs=1e-7)


def test_generalized_jsd_tends_to_zero_inside_and_is_the_kl_at_the_ends():
    # beta -> 0: M -> p_S, so JSD = beta KL(p_T||M) + (1-beta) KL(p_S||M) -> 0; at beta = 0 exactly it is the
    # forward KL (TRL's convention): a jump, not a limit
    assert generalized_jsd(STUDENT, TEACHER, 1e-6).item() < 1e-5
    assert generalized_jsd(STUDENT, TEACHER, 1 - 1e-6).item() < 1e-5
    # equal distributions: every beta gives 0
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(TEACHER, TEACHER, beta).item() == pytest.approx(0.0, abs=1e-12)


def test_temperature_divides_the_logits_first():
    # temperature 2 on logits (2 ln 3, 0) is logits (ln 3, 0): the forward KL of the hand-worked pair
    teacher = torch.tensor([2 * LN(3.0), 0.0], dtype=F64)
    assert generalized_jsd(STUDENT, teacher, 0.0, temperature=2.0).item() == pytest.approx(FORWARD_KL, abs=1e-7)


def test_top_k_renormalises_both_models_over_the_teachers_top_k():
    # three tokens; teacher logits (ln 6, ln 2, 0): p_T = (6, 2, 1) / 9, top-2 = tokens {0, 1}
    #   renormalised over them: (6/8, 2/8) = (3/4, 1/4)
    # student logits (0, 0, 5): most of its mass is on token 2, outside the set; over {0, 1}: (1/2, 1/2)
    # so every divergence over the top 2 equals the two-token case worked above
    student = torch.tensor([0.0, 0.0, 5.0], dtype=F64, requires_grad=True)
    teacher = torch.tensor([LN(6.0), LN(2.0), 0.0], dtype=F64)
    for beta, expected in ((0.0, FORWARD_KL), (1.0, REVERSE_KL), (0.5, JSD_HALF)):
        assert generalized_jsd(student, teacher, beta, top_k=2).item() == pytest.approx(expected, abs=1e-7)
    generalized_jsd(student, teacher, 0.5, top_k=2).backward()
    assert student.grad[2] == 0  # a token outside the teacher's top k has no gradient
    # top_k 0 or >= V: the whole vocabulary
    s, t = top_k_logits(student, teacher, 3)
    assert s is student and t is teacher
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        top_k_logits(student, teacher, -1)


def test_forward_kl_gradient_by_hand():
    # d KL(p_T || p_S) / d z_S = p_S - p_T (softmax cross-entropy against the teacher): (1/2 - 3/4, 1/2 - 1/4)
    student = STUDENT.clone().requires_grad_(True)
    generalized_jsd(student, TEACHER, 0.0).backward()
    assert student.grad.tolist() == pytest.approx([-0.25, 0.25])


def test_jsd_loss_global_normaliser_and_mask():
    # two rows of two positions; the pair worked above at (0, 0) and (1, 0), (1, 1) masked, (0, 1) equal logits
    # token_mean over 3 tokens: (FORWARD_KL + 0 + FORWARD_KL) / 3
    student = torch.stack([torch.stack([STUDENT, TEACHER]), torch.stack([STUDENT, STUDENT])])
    teacher = torch.stack([torch.stack([TEACHER, TEACHER]), torch.stack([TEACHER, TEACHER])])
    mask = torch.tensor([[1, 1], [1, 0]])
    norm = make_normalizer("token_mean", mask)
    loss, metrics = jsd_loss(student, teacher, mask, norm, beta=0.0)
    assert loss.item() == pytest.approx(2 * FORWARD_KL / 3, abs=1e-7)
    assert metrics["distill/jsd"] == pytest.approx(2 * FORWARD_KL / 3, abs=1e-7)
    shares = [jsd_loss(student[i:i + 1], teacher[i:i + 1], mask[i:i + 1], norm, 0.0)[0].item() for i in range(2)]
    assert sum(shares) == pytest.approx(loss.item())  # micro-batches add up to the step's loss


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        generalized_jsd(STUDENT, TEACHER, 1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generalized_jsd(STUDENT, TEACHER, 0.5, temperature=0)
    with pytest.raises(ValueError, match="must share the vocabulary"):
        generalized_jsd(STUDENT, torch.zeros(3, dtype=F64), 0.5)


# --------------------------------------------------------------------------- TRL 1.16


def trl_gkd():
    trl = pytest.importorskip("trl", reason="the comparison runs TRL's own loss code (pip install trl==1.16.0)")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"written against TRL 1.16.0's loss code, found {trl.__version__}")
    gkd = pytest.importorskip("trl.experimental.gkd", reason="TRL's GKDTrainer needs its optional dependencies")
    return gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_equals_trl_gkd(beta, temperature):
    """TRL's loss with labels (-100 on padding) is the sum over the labelled positions / their count: covey's
    jsd_loss with the token_mean normaliser of the same mask; the loss and its gradient in the student's
    logits agree in float64."""
    trl_loss = trl_gkd()
    g = torch.Generator().manual_seed(7)
    student = (3 * torch.randn(3, 5, 11, generator=g, dtype=F64)).requires_grad_(True)
    teacher = 3 * torch.randn(3, 5, 11, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    labels = torch.where(mask.bool(), torch.randint(0, 11, (3, 5), generator=g), torch.full((3, 5), -100))
    theirs = trl_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    (their_grad,) = torch.autograd.grad(theirs, student)
    ours, _ = jsd_loss(student, teacher, mask, make_normalizer("token_mean", mask), beta, temperature)
    (our_grad,) = torch.autograd.grad(ours, student)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(our_grad, their_grad, rtol=1e-9, atol=1e-12)
