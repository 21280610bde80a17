"""The policy-loss registry: every policy loss by name, with the traits the run's plan reads.

Nothing outside this registry branches on a loss's name: the plan reads `options` (which algo keys
the loss reads; it rejects a key set for a loss that ignores it), `aggregation` (a loss defined with
its own normalisation runs with it), `ratio_level` (a loss defined at one level) and
`sequence_advantage` (a loss that reads one advantage per sequence). A new loss is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from torch import Tensor

from covey.algos.aggregation import Normalizer
from covey.algos.losses import cispo_loss, pg_loss, ppo_clip_loss
from covey.algos.options import PolicyLossOptions
from covey.algos.soft_losses import gmpo_loss, sapo_loss, vespo_loss


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what it is defined with. Callable like its `fn`."""
    fn: Callable[..., "tuple[Tensor, dict]"]
    options: tuple[str, ...] = ()        # the PolicyLossOptions fields (or option groups) it reads: algo keys
    ratio_level: str | None = None       # the ratio level it is defined at; None: opts.ratio_level (if it reads it)
    aggregation: str | None = None       # the aggregation it is defined with; None: the caller's (algo.loss_agg)
    sequence_advantage: bool = False     # reads one advantage per sequence (the mean over its valid tokens)

    def __call__(self, logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor,
                 norm: Normalizer, opts: PolicyLossOptions, ref_logp: Tensor | None = None) -> tuple[Tensor, dict]:
        if self.ratio_level is not None:
            opts = replace(opts, ratio_level=self.ratio_level)
        return self.fn(logp, old_logp, advantages, response_mask, norm, opts, ref_logp=ref_logp)


CLIP = ("clip_eps_low", "clip_eps_high")

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(ppo_clip_loss, options=CLIP + ("dual_clip", "ratio_level", "ratio_against")),
    "pg": PolicyLoss(pg_loss),
    "cispo": PolicyLoss(cispo_loss, options=CLIP + ("ratio_level",)),
    "sapo": PolicyLoss(sapo_loss, options=("sapo", "ratio_level")),
    "gmpo": PolicyLoss(gmpo_loss, options=("gmpo",),
                       aggregation="seq_mean_token_mean", sequence_advantage=True),
    # LUSPO (arXiv:2602.05261): GSPO's clipped sequence ratio, each sequence's term weighted by its length
    # |y_i|, i.e. summed over its tokens and averaged over sequences (TRL 1.16 loss_type="luspo").
    "luspo": PolicyLoss(ppo_clip_loss, options=CLIP + ("dual_clip",), ratio_level="sequence",
                        aggregation="seq_mean_token_sum"),
    "vespo": PolicyLoss(vespo_loss, options=("vespo",)),
}


def policy_loss(name: str, logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor,
                norm: Normalizer, opts: PolicyLossOptions | None = None,
                ref_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """Run policy loss `name` (POLICY_LOSSES): aggregated scalar loss of this micro-batch and its metrics.
    A loss defined with its own aggregation (the entry's `aggregation`) needs a normaliser of that mode."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    entry = POLICY_LOSSES[name]
    if entry.aggregation is not None and norm.mode != entry.aggregation:
        raise ValueError(f"policy loss {name} is defined with aggregation {entry.aggregation}, got a "
                         f"{norm.mode} normaliser")
    return entry(logp, old_logp, advantages, response_mask, norm,
                               opts if opts is not None else PolicyLossOptions(), ref_logp=ref_logp)
