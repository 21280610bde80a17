"""The policy objective of one micro-batch: policy loss + KL to the reference + entropy bonus.

    L = policy_loss(logp, old_logp, A) + kl_coef * aggregate(k(logp, ref_logp)) - entropy_coef * aggregate(H)

(GRPO's KL in the loss: Shao et al. 2024, arXiv:2402.03300; the entropy bonus: Mnih et al. 2016,
arXiv:1602.01783.) Every input is set to 0 on masked positions before any estimator (ratio, exp,
k1..k3) reads it, so NaN or inf in padding never reaches the loss, the metrics or a gradient.
The trainer (covey.train.update.micro_policy_loss) calls this function and composes nothing itself.
"""

from __future__ import annotations

from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero
from covey.algos.aggregation import Normalizer
from covey.algos.loss_registry import policy_loss
from covey.algos.losses import entropy_loss, kl_loss
from covey.algos.options import PolicyLossOptions
from covey.algos.token_select import CovOptions, cov_terms


def policy_objective(name: str, logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor,
                     norm: Normalizer, opts: PolicyLossOptions | None = None, *, ref_logp: Tensor | None = None,
                     kl_coef: float = 0.0, kl_kind: str = "k3", entropy: Tensor | None = None,
                     entropy_coef: float = 0.0, cov: CovOptions | None = None,
                     cov_tokens: Tensor | None = None) -> tuple[Tensor, dict]:
    """Scalar loss of this micro-batch under the step's normaliser, and its metrics.

    name: a POLICY_LOSSES key (its metrics: policy/clipfrac*, policy/ratio_*, policy/approx_kl*, adv/*).
    ref_logp: (n, L) reference log-probs; when given, kl/ref (mean estimate over valid tokens) is
        reported, and the term kl_coef * aggregate(k) enters the loss when kl_coef > 0 (kind `kl_kind`).
    entropy: (n, L) per-token entropy; when given, policy/entropy is reported, and the bonus
        -entropy_coef * aggregate(H) enters the loss when entropy_coef > 0.
    cov, cov_tokens: a covariance control (Clip-Cov, KL-Cov: covey.algos.token_select) and the (n, L)
        tokens the rollout-level selection gave it: their policy term dropped, or a drift penalty added.
    """
    mask = as_bool_mask(response_mask)
    logp = masked_fill_zero(logp, mask)
    old = masked_fill_zero(old_logp.detach(), mask) if old_logp is not None else None
    ref = masked_fill_zero(ref_logp.detach().to(logp.dtype), mask) if ref_logp is not None else None
    adv = masked_fill_zero(advantages.detach(), mask)
    penalty = None
    if cov is not None and cov_tokens is not None:
        adv, penalty = cov_terms(cov, logp, old if old is not None else logp.detach(), adv, mask, cov_tokens, norm)
    loss, metrics = policy_loss(name, logp, old, adv, mask, norm, opts, ref_logp=ref)
    if penalty is not None:
        loss = loss + penalty
    if ref is not None:
        kl_term, kl_metrics = kl_loss(logp, ref, mask, norm, kl_coef, kl_kind)
        metrics.update(kl_metrics)
        if kl_coef > 0:
            loss = loss + kl_term
    if entropy is not None:
        bonus, entropy_metrics = entropy_loss(masked_fill_zero(entropy, mask), mask, norm, entropy_coef)
        metrics.update(entropy_metrics)
        if entropy_coef > 0:
            loss = loss + bonus
    return loss, metrics
