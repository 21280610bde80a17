"""The policy-loss registry: every policy loss by name, with the traits the run's plan reads.

Nothing outside this registry branches on a loss's name: the plan reads `options` (which algo keys
the loss reads; it rejects a key set for a loss that ignores it), `aggregation` (a loss defined with
its own normalisation runs with it), `ratio_level` (a loss defined at one level), `sequence_advantage`
(a loss that reads one advantage per sequence) and `token_weights` (what the loss does with the token
devices' weights: WEIGHT_USES says, for each kind of weight, what it means or why it is refused).
A new loss is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from torch import Tensor

from covey.algos.aggregation import Normalizer
from covey.algos.losses import cispo_loss, pg_loss, ppo_clip_loss
from covey.algos.options import PolicyInputs, PolicyLossOptions
from covey.algos.soft_losses import gmpo_loss, sapo_loss, vespo_loss
from covey.algos.token_select import COV_CONTROLS


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what it is defined with. Callable like its `fn`."""
    fn: Callable[..., "tuple[Tensor, dict]"]
    options: tuple[str, ...] = ()        # the PolicyLossOptions fields (or option groups) it reads: algo keys
    ratio_level: str | None = None       # the ratio level it is defined at; None: opts.ratio_level (if it reads it)
    aggregation: str | None = None       # the aggregation it is defined with; None: the caller's (algo.loss_agg)
    sequence_advantage: bool = False     # reads one advantage per sequence (the mean over its valid tokens)
    token_weights: str = "scale_term"    # what it does with the token devices' weights: a WEIGHT_USES key

    def __call__(self, inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
        if self.ratio_level is not None:
            opts = replace(opts, ratio_level=self.ratio_level)
        return self.fn(inp, norm, opts)


CLIP = ("clip_eps_low", "clip_eps_high")

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(ppo_clip_loss, options=CLIP + ("dual_clip", "ratio_level", "ratio_against")),
    "pg": PolicyLoss(pg_loss),
    "cispo": PolicyLoss(cispo_loss, options=CLIP + ("ratio_level",)),
    "sapo": PolicyLoss(sapo_loss, options=("sapo", "ratio_level")),
    "gmpo": PolicyLoss(gmpo_loss, options=("gmpo",), aggregation="seq_mean_token_mean", sequence_advantage=True,
                       token_weights="select_tokens"),
    # LUSPO (arXiv:2602.05261): GSPO's clipped sequence ratio, each sequence's term weighted by its length
    # |y_i|, i.e. summed over its tokens and averaged over sequences (TRL 1.16 loss_type="luspo").
    "luspo": PolicyLoss(ppo_clip_loss, options=CLIP + ("dual_clip",), ratio_level="sequence",
                        aggregation="seq_mean_token_sum"),
    "vespo": PolicyLoss(vespo_loss, options=("vespo",), token_weights="sampler_in_weight"),
}


@dataclass(frozen=True)
class WeightUse:
    """What one kind of token weight does in a loss, or (refused) why it means nothing there."""
    meaning: str
    refused: bool = False


PENALTY = WeightUse("adds coef |log pi_theta - log pi_old| on the chosen tokens beside the policy term, whatever it is")
SCALED = WeightUse("each token's policy term times its weight (value and gradient; the normaliser unchanged)")

WEIGHT_USES: dict[str, dict[str, WeightUse]] = {
    # token t's term is positively homogeneous in A_t and carries only token t's gradient (A_t f(ratio_t),
    # GSPO's token form included): a weight w_t >= 0 scales it exactly, applied as w_t A_t
    "scale_term": {"token_weight": SCALED, "sequence_weight": SCALED, "selection": SCALED, "penalty": PENALTY},
    # one term per sequence, a geometric mean over its tokens (gmpo)
    "select_tokens": {
        "token_weight": WeightUse("has one term per sequence, the geometric mean of its token ratios: a weight per "
                                  "token has no place in it (averaged over the sequence, it would scale every "
                                  "token's gradient alike); use algo.tis.mode=sequence_truncate or sequence_mask",
                                  refused=True),
        "sequence_weight": WeightUse("the sequence's term times its weight"),
        "selection": WeightUse("the geometric mean taken over the sequence's kept tokens only: a dropped token "
                               "gets no gradient (a sequence with none kept: mean 1, no gradient)"),
        "penalty": PENALTY},
    # a kernel of the sequence's importance weight W = pi_theta / mu, taken against the sampler (vespo)
    "sampler_in_weight": {
        "token_weight": WeightUse("the bounded token ratios pi_old/mu enter the sequence weight W = pi_theta/mu "
                                  "inside the kernel, never the term itself"),
        "sequence_weight": WeightUse("reshapes the whole sequence's weight W = pi_theta/mu with its kernel: a bound "
                                     "on the sequence's ratio would truncate that weight a second time; use "
                                     "algo.tis.mode=token_truncate or token_mask, or algo.tis.cap=0 (the kernel "
                                     "then acts on pi_theta/mu itself wherever the engine returns its log-probs)",
                                     refused=True),
        "selection": SCALED, "penalty": PENALTY},
}
"""token_weights trait -> kind of weight -> what it means. Every trait gives a use for every kind."""

TOKEN_DEVICES: dict[str, str] = {
    "tis_token": "token_weight",         # algo.tis.mode=token_*: one importance weight per token
    "tis_sequence": "sequence_weight",   # algo.tis.mode=sequence_*: one per sequence, on each of its tokens
    "top_entropy": "selection",          # algo.top_entropy_quantile < 1: tokens kept or dropped
    **{name: "selection" if control.drops_policy_term else "penalty"   # algo.cov_control: clip_cov, kl_cov
       for name, control in COV_CONTROLS.items() if control.select is not None},
}
"""Every token device and the kind of weight it hands a loss."""


def token_device_use(loss: str, device: str) -> WeightUse:
    """What token device `device` (TOKEN_DEVICES) does with policy loss `loss`, from the loss's trait."""
    return WEIGHT_USES[POLICY_LOSSES[loss].token_weights][TOKEN_DEVICES[device]]


def policy_loss(name: str, inp: PolicyInputs, norm: Normalizer,
                opts: PolicyLossOptions | None = None) -> tuple[Tensor, dict]:
    """Run policy loss `name` (POLICY_LOSSES) on `inp` (masked: PolicyInputs.masked): aggregated scalar loss of
    this micro-batch and its metrics. A loss defined with its own aggregation (the entry's `aggregation`)
    needs a normaliser of that mode."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    entry = POLICY_LOSSES[name]
    if entry.aggregation is not None and norm.mode != entry.aggregation:
        raise ValueError(f"policy loss {name} is defined with aggregation {entry.aggregation}, got a "
                         f"{norm.mode} normaliser")
    return entry(inp.masked(), norm, opts if opts is not None else PolicyLossOptions())
