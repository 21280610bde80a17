"""The policy objective of one micro-batch: policy loss + KL to the reference + entropy bonus.

    L = policy_loss(logp, old_logp, A, token weights) + kl_coef * aggregate(k(logp, ref_logp))
        - entropy_coef * aggregate(H)  [+ KL-Cov's drift penalty]

(GRPO's KL in the loss: Shao et al. 2024, arXiv:2402.03300; the entropy bonus: Mnih et al. 2016,
arXiv:1602.01783.) Every input is set to 0 on masked positions before any estimator (ratio, exp,
k1..k3) reads it, so NaN or inf in padding never reaches the loss, the metrics or a gradient. The token
devices reach the policy loss as weights of their own (PolicyInputs.kept, .is_weights; Clip-Cov's tokens
leave `kept` here), read as the loss's `token_weights` trait says; the KL and entropy terms are not weighted.
The trainer (covey.training.update.micro_policy_loss) calls this function and composes nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor

from covey.algos.aggregation import Normalizer
from covey.algos.loss_registry import policy_loss
from covey.algos.losses import entropy_loss, kl_loss
from covey.algos.options import PolicyInputs, PolicyLossOptions
from covey.algos.token_select import CovOptions, cov_terms


@dataclass(frozen=True)
class ObjectiveOptions:
    """What the objective adds up, and with which weights."""
    policy_loss: str = "ppo_clip"
    """A POLICY_LOSSES key."""
    loss: PolicyLossOptions = field(default_factory=PolicyLossOptions)
    """The policy loss's options."""
    kl_coef: float = 0.0
    """Weight of the KL term (> 0 and ref_logp given: in the loss; kl/ref is reported whenever ref_logp is)."""
    kl_kind: str = "k3"
    """Per-token KL estimator (KL_ESTIMATORS)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (> 0 and entropy given: in the loss; policy/entropy whenever entropy is)."""
    cov: CovOptions | None = None
    """A covariance control acting on PolicyInputs.cov_tokens (Clip-Cov, KL-Cov); None: off."""


def policy_objective(inp: PolicyInputs, norm: Normalizer,
                     opts: ObjectiveOptions | None = None) -> tuple[Tensor, dict]:
    """Scalar loss of this micro-batch under the step's normaliser, and its metrics.

    The policy loss's metrics (policy/clipfrac*, policy/ratio_*, policy/approx_kl*, adv/*); kl/ref (mean
    estimate over valid tokens) whenever inp.ref_logp is given; policy/entropy whenever inp.entropy is.
    A covariance control's tokens (inp.cov_tokens): Clip-Cov's leave the kept tokens (their policy term
    dropped as the loss's trait says), KL-Cov's carry a drift penalty.
    """
    opts = opts or ObjectiveOptions()
    inp = inp.masked()
    mask = inp.response_mask
    penalty = None
    if opts.cov is not None and inp.cov_tokens is not None:
        old = inp.old_logp if inp.old_logp is not None else inp.logp.detach()
        kept, penalty = cov_terms(opts.cov, inp.logp, old, inp.kept, mask, inp.cov_tokens, norm)
        inp = replace(inp, kept=kept)
    loss, metrics = policy_loss(opts.policy_loss, inp, norm, opts.loss)
    if penalty is not None:
        loss = loss + penalty
    if inp.ref_logp is not None:
        kl_term, kl_metrics = kl_loss(inp.logp, inp.ref_logp, mask, norm, opts.kl_coef, opts.kl_kind)
        metrics.update(kl_metrics)
        if opts.kl_coef > 0:
            loss = loss + kl_term
    if inp.entropy is not None:
        bonus, entropy_metrics = entropy_loss(inp.entropy, mask, norm, opts.entropy_coef)
        metrics.update(entropy_metrics)
        if opts.entropy_coef > 0:
            loss = loss + bonus
    return loss, metrics
