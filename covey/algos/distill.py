"""Distillation and supervised losses as pure functions: the supervised warm-up's token loss, on-policy
distillation's per-token advantage, and GKD's generalized Jensen-Shannon divergence.

Every loss here is summed over its tokens and divided by the global ``Normalizer`` of the optimizer step
(covey/algos/aggregation.py), built from the masks of every micro-batch and every process: summing the
micro-batch losses gives the step's loss, whatever the micro-batch size or the process count.

- ``token_nll``: supervised fine-tuning, -log pi_theta(y_t | y_<t) on the trained (assistant) tokens.
- ``reverse_kl_advantages``: on-policy distillation (Agarwal et al. 2023, arXiv:2306.13649; Lu and Thinking
  Machines Lab 2025, "On-Policy Distillation"): the student samples y, the teacher scores it, and each token's
  advantage is the negative sampled-token reverse KL,
      A_t = -(log pi_student(y_t) - log pi_teacher(y_t)) = log pi_teacher(y_t) - log pi_student(y_t),
  given to the policy loss with no discount (each token is credited its own term only). Its expectation
  under the student's samples is -KL(pi_student || pi_teacher) per token.
- ``generalized_jsd``: GKD's divergence (Agarwal et al. 2023, arXiv:2306.13649, eq. 1) between the
  student's and the teacher's next-token distributions over the full vocabulary, or over the teacher's
  top-k tokens, with TRL's conventions:
      M = (1 - beta) p_S + beta p_T
      JSD_beta = beta KL(p_T || M) + (1 - beta) KL(p_S || M)        0 < beta < 1
      beta = 0: KL(p_T || p_S) (forward KL)        beta = 1: KL(p_S || p_T) (reverse KL)
  JSD_beta itself tends to 0 at both ends, so the two ends are defined as the KLs, exactly at 0 and 1 (a
  jump, as TRL's GKDTrainer.generalized_jsd_loss has it). Logits are divided by the temperature first.
  With top_k > 0 both distributions are renormalised over the K = top_k tokens of largest teacher logit at
  that position: p'(v) = p(v) / sum_{u in K} p(u) for v in K (the log-softmax of the k gathered logits),
  for the student as for the teacher, and the divergence is that of the two k-way distributions; tokens
  outside K carry no loss and no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from covey.algos._stats import as_bool_mask, compute_dtype, masked_fill_zero
from covey.algos.aggregation import Normalizer, aggregate


def token_nll(logp: Tensor, mask: Tensor, norm: Normalizer) -> tuple[Tensor, dict]:
    """Supervised loss share of one micro-batch: sum of -logp over `mask` (n, L) / the step's normaliser;
    metrics: the mean -logp of this micro-batch's trained tokens (`sft/loss`: weighted by their count over the
    micro-batches of a token_mean step, the step's loss)."""
    mask = as_bool_mask(mask)
    loss = aggregate(-logp, mask, norm)
    with torch.no_grad():
        count = int(mask.sum())
        nll = float(masked_fill_zero(-logp.detach(), mask).sum()) / count if count else 0.0
    return loss, {"sft/loss": nll}


def reverse_kl_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
    """Per-token advantages (n, L) log pi_teacher - log pi_student at the sampled tokens, 0 outside `mask`,
    and `distill/teacher_kl`: the mean over the masked tokens of log pi_student - log pi_teacher, the
    sampled-token (k1) estimate of KL(pi_student || pi_teacher) per token. No gradient flows through either
    input: the advantage weighs the policy loss, it is not differentiated."""
    mask = as_bool_mask(mask)
    gap = (teacher_logp.detach() - student_logp.detach()).to(compute_dtype(student_logp))
    advantages = masked_fill_zero(gap, mask)
    count = int(mask.sum())
    kl = float(-advantages.sum()) / count if count else 0.0
    return advantages, {"distill/teacher_kl": kl}


def top_k_logits(student_logits: Tensor, teacher_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Both models' logits at the teacher's `top_k` largest logits of each position, (..., k) each (ties:
    torch.topk's order); the whole vocabulary when top_k is 0 or at least the vocabulary's size."""
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_k == 0 or top_k >= teacher_logits.shape[-1]:
        return student_logits, teacher_logits
    index = teacher_logits.topk(top_k, dim=-1).indices
    return student_logits.gather(-1, index), teacher_logits.gather(-1, index)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) over the last dimension from log-probabilities (0 log 0 = 0)."""
    return torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p)).sum(-1)


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0,
                    top_k: int = 0) -> Tensor:
    """GKD's divergence at each position: (..., V) logits -> (...,) in float32 (float64 for float64 logits).
    beta in [0, 1]: 0 is KL(p_T || p_S), 1 is KL(p_S || p_T), in between JSD_beta (module docstring). The
    teacher's side carries no gradient."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models must share the vocabulary")
    dtype = compute_dtype(student_logits)
    student, teacher = top_k_logits(student_logits.to(dtype), teacher_logits.detach().to(dtype), top_k)
    log_s = F.log_softmax(student / temperature, dim=-1)
    log_t = F.log_softmax(teacher / temperature, dim=-1)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    mixture = torch.logsumexp(torch.stack([log_s + math.log1p(-beta), log_t + math.log(beta)]), dim=0)
    return beta * _kl(log_t, mixture) + (1.0 - beta) * _kl(log_s, mixture)


def jsd_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, norm: Normalizer, beta: float,
             temperature: float = 1.0, top_k: int = 0) -> tuple[Tensor, dict]:
    """GKD's loss share of one micro-batch: `generalized_jsd` (n, L) summed over `mask` / the step's
    normaliser (token_mean: TRL's reduction by the global count of trained tokens); metrics: the mean
    divergence of this micro-batch's masked tokens (`distill/jsd`)."""
    mask = as_bool_mask(mask)
    per_token = generalized_jsd(student_logits, teacher_logits, beta, temperature, top_k)
    loss = aggregate(per_token, mask, norm)
    with torch.no_grad():
        count = int(mask.sum())
        mean = float(masked_fill_zero(per_token.detach(), mask).sum()) / count if count else 0.0
    return loss, {"distill/jsd": mean}
