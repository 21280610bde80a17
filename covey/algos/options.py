"""Inputs and options of the advantage estimators and policy losses (options: plain scalars only).

Dimension legend (docs/design.md): N sequences, L response tokens, S reasoning steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero
from covey.config.schema_algo import GmpoOptions, SapoOptions, VespoOptions

TOKEN_CREDITS = ("shared", "uniform", "discounted")
NORMALIZE_MODES = ("auto", "group", "batch", "global_token", "none")
RATIO_LEVELS = ("token", "sequence")
RATIO_AGAINST = ("old", "ref")


def check_choice(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(allowed)}")


@dataclass
class AdvantageInput:
    """Everything an estimator may read. Shapes: N sequences, L response tokens, S steps."""
    scores: Tensor
    """(N,) float outcome reward of each sequence."""
    response_mask: Tensor
    """(N, L) bool or 0/1: tokens that are trained. Holes (masked tokens inside a response) are allowed."""
    group_ids: Tensor
    """(N,) int: sequences sampled from one prompt share an id (any integers, not necessarily contiguous)."""
    values: Tensor | None = None
    """(N, L) critic values V(s_t) aligned with response token t (gae only)."""
    token_kl: Tensor | None = None
    """(N, L) per-token KL estimate to the reference (kl_penalty), for KL-in-reward."""
    kl_coef: float = 0.0
    """beta of KL-in-reward: token reward -= kl_coef * token_kl."""
    baseline_scores: Tensor | None = None
    """(N,) ReMax: reward of the greedy sample of the same prompt."""
    step_scores: Tensor | None = None
    """(N, S) process rewards, one per reasoning step (grpo_process)."""
    step_ends: Tensor | None = None
    """(N, S) int: response-token index (0-based, inclusive) where step s ends."""
    step_mask: Tensor | None = None
    """(N, S) bool or 0/1: real steps (default: all)."""


@dataclass
class AdvantageOptions:
    """Estimator options. Every field is used by at least one estimator; see docs/algorithms.md."""
    gamma: float = 1.0
    """Discount in [0, 1]: returns (reinforce_pp, gae) and token_credit=discounted."""
    lam: float = 0.95
    """GAE lambda in [0, 1]."""
    eps: float = 1e-6
    """Added to every std before dividing."""
    std_normalize: bool = True
    """Divide by the std of the chosen normalisation (False = Dr. GRPO: only subtract the mean)."""
    ddof: int = 0
    """Delta degrees of freedom of every std: 0 = population std (numpy); 1 = torch.std (TRL, verl)."""
    token_credit: str = "shared"
    """Sequence-level estimators: shared (the paper's) | uniform (A/T) | discounted."""
    normalize: str = "auto"
    """auto | group | batch | global_token | none; auto = the estimator's paper default."""

    def validate(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not self.eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        if int(self.ddof) != self.ddof or self.ddof < 0:
            raise ValueError(f"ddof must be a non-negative integer, got {self.ddof}")
        check_choice("token_credit", self.token_credit, TOKEN_CREDITS)
        check_choice("normalize", self.normalize, NORMALIZE_MODES)


@dataclass
class PolicyLossOptions:
    """Options of the policy losses."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio >= 1 - clip_eps_low (>= 0; values >= 1 disable the lower clip)."""
    clip_eps_high: float = 0.2
    """Upper clip: ratio <= 1 + clip_eps_high (>= 0; DeepSeek-R1 uses 10)."""
    dual_clip: float | None = None
    """c > 1: for A < 0 the per-token loss is capped at -c * A (Ye et al. 2020); None = off."""
    ratio_level: str = "token"
    """token | sequence (GSPO: exp of the mean token log-ratio of the sequence)."""
    ratio_against: str = "old"
    """old (sampling policy, PPO/GRPO) | ref (the reference model: not a trust region)."""
    sapo: SapoOptions = field(default_factory=SapoOptions)
    """sapo: the soft gate's temperatures (algo.sapo.*, declared in covey/config/schema_algo.py)."""
    gmpo: GmpoOptions = field(default_factory=GmpoOptions)
    """gmpo: the log-space clip of the token ratios (algo.gmpo.*)."""
    vespo: VespoOptions = field(default_factory=VespoOptions)
    """vespo: the gamma kernel's powers and decays (algo.vespo.*)."""

    def validate(self) -> None:
        if not (self.clip_eps_low >= 0 and self.clip_eps_high >= 0):
            raise ValueError(f"clip eps must be >= 0, got low={self.clip_eps_low} high={self.clip_eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        groups = {"sapo": self.sapo, "gmpo": self.gmpo, "vespo": self.vespo}
        for name in ("sapo.temperature_pos", "sapo.temperature_neg", "vespo.lambda_pos", "vespo.lambda_neg"):
            value = getattr(groups[name.split(".")[0]], name.split(".")[1])
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("gmpo.log_clip_low", "gmpo.log_clip_high", "vespo.k_pos", "vespo.k_neg"):
            value = getattr(groups[name.split(".")[0]], name.split(".")[1])
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_choice("ratio_against", self.ratio_against, RATIO_AGAINST)


@dataclass
class PolicyInputs:
    """What the policy objective and a policy loss read: (n, L) tensors over one micro-batch.

    The token devices arrive as weights of their own, never folded into `advantages`: each loss reads
    them as its registry entry's `token_weights` trait says (covey.algos.loss_registry, WEIGHT_USES).
    """
    logp: Tensor
    """log pi_theta of each sampled token (differentiable)."""
    old_logp: Tensor | None
    """log pi_old, the weights that sampled (detached); None: the current policy's (one step per rollout)."""
    advantages: Tensor
    """A_t, as the estimator gave them."""
    response_mask: Tensor
    """bool or 0/1: the trained tokens."""
    ref_logp: Tensor | None = None
    """log pi_ref (the KL term, ratio_against=ref)."""
    entropy: Tensor | None = None
    """Per-token entropy of pi_theta (the entropy bonus)."""
    kept: Tensor | None = None
    """bool: the tokens whose policy term the token selections keep (high-entropy tokens); None: all."""
    is_weights: Tensor | None = None
    """The sampler correction: pi_old / mu bounded as algo.tis.* says (no gradient); None: off."""
    sample_logp: Tensor | None = None
    """log mu, the sampler's log-prob of each token it drew; None: the engine returned none."""
    cov_tokens: Tensor | None = None
    """bool: the tokens a covariance control acts on (Clip-Cov drops their term, KL-Cov penalises their drift)."""

    def masked(self) -> "PolicyInputs":
        """Every tensor 0 (False) on masked positions, so NaN or inf in padding never reaches an estimator;
        logp and entropy keep their gradient, the rest are detached; ref in logp's dtype."""
        mask = as_bool_mask(self.response_mask)

        def fill(t: Tensor | None, dtype=None) -> Tensor | None:
            return None if t is None else masked_fill_zero(t.detach().to(dtype or t.dtype), mask)

        def select(t: Tensor | None) -> Tensor | None:
            return None if t is None else mask & as_bool_mask(t)
        dtype = self.logp.dtype
        return replace(self, logp=masked_fill_zero(self.logp, mask), old_logp=fill(self.old_logp),
                       advantages=fill(self.advantages), response_mask=mask, ref_logp=fill(self.ref_logp, dtype),
                       entropy=None if self.entropy is None else masked_fill_zero(self.entropy, mask),
                       kept=select(self.kept), is_weights=fill(self.is_weights), sample_logp=fill(self.sample_logp),
                       cov_tokens=select(self.cov_tokens))
