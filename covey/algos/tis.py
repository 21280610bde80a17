"""Importance sampling for a sampler whose log-probs differ from the trainer's (TIS and its masked forms).

A fast inference engine (vLLM, or covey's own engine sampling from a bf16 copy) samples with its own
kernels and its own copy of the weights, so the behaviour policy mu that drew the tokens is not exactly
the policy pi the trainer evaluates, even right after a weight sync. The policy gradient is then
corrected per token by the importance weight pi/mu, bounded at a cap C so a few tokens the sampler
found very unlikely cannot dominate the batch (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; Ionides 2008 for truncated IS). Four modes (TRL's
`vllm_importance_sampling_mode`), with r_t = pi_train(y_t) / pi_sampler(y_t) and, for a sequence,
R = prod_t r_t over its valid tokens (exp of the summed log-ratios), and an optional lower bound c
(TRL's `vllm_importance_sampling_clip_min`; 0 = none):

    token_truncate     w_t = clamp(r_t, c, C)                (truncated IS; covey's algo.tis.cap alone)
    token_mask         w_t = r_t if c <= r_t <= C else 0     (the token leaves the policy loss)
    sequence_truncate  w_t = clamp(R, c, C)                  every token of the sequence
    sequence_mask      w_t = R if c <= R <= C else 0         the whole sequence leaves the policy loss

computed in log space, no gradient. `pi_train` is the trainer's log-prob of the sampled token under
the weights the sampler had (pi_old). The weights reach the policy loss on their own (PolicyInputs.is_weights),
read as its registry trait says: most losses multiply token t's term by w_t. A masked form
drops a token (or sequence) that truncation would keep at weight C (or c): its ratio says the sampler's
tokens are too far from the trainer's policy to be corrected (TRL's definitions, on identical inputs
in tests/algos/test_trl_parity.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean
from covey.algos.losses import LOG_RATIO_CLAMP

TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TIS_DEVICES = {mode: "tis_sequence" if mode.startswith("sequence") else "tis_token" for mode in TIS_MODES}
"""The token device (covey.algos.loss_registry.TOKEN_DEVICES) of each mode: one weight per token or per sequence."""


def importance_weights(train_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor, cap: float,
                       mode: str = "token_truncate", floor: float = 0.0) -> tuple[Tensor, dict]:
    """Per-token weights (N, L) of `mode` (TIS_MODES), 0 where masked; and metrics.

    train_logp, sampler_logp: (N, L) log-probs of the sampled tokens; cap >= 1; 0 <= floor < cap, the
    lower bound (0: none).
    Metrics (means over valid tokens, plain floats):
      tis/weight_mean     mean w
      tis/capped_frac     share of tokens whose ratio (r_t, or their sequence's R) exceeded the cap
      tis/below_min_frac  share of tokens whose ratio (r_t or R) is below the floor (only with floor > 0)
      tis/ratio_max       largest ratio before the cap (r_t or R)
      tis/mismatch_kl     k3 estimate of KL(mu || pi) from the sampler's tokens: r - 1 - log r, per token
    """
    if cap < 1:
        raise ValueError(f"importance sampling cap must be >= 1, got {cap}")
    if not 0 <= floor < cap:
        raise ValueError(f"importance sampling floor must lie in [0, cap={cap:g}), got {floor}")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown tis mode {mode!r}; valid: {', '.join(TIS_MODES)}")
    mask = as_bool_mask(response_mask)
    token = masked_fill_zero((train_logp - sampler_logp).detach(), mask)
    log_ratio = token.sum(-1, keepdim=True).expand_as(token) if mode.startswith("sequence") else token
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    beyond, below = ratio > cap, ratio < floor
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=floor, max=cap)
    else:
        weights = ratio.masked_fill(beyond | below, 0.0)
    weights = masked_fill_zero(weights, mask)
    wide = torch.float64 if ratio.dtype == torch.float64 else torch.float32
    token = token.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        "tis/weight_mean": float(masked_mean(weights.to(wide), mask)),
        "tis/capped_frac": float(masked_mean(beyond.to(wide), mask)),
        "tis/ratio_max": float(masked_fill_zero(ratio, mask).max()) if bool(mask.any()) else 0.0,
        "tis/mismatch_kl": float(masked_mean((torch.expm1(token) - token).to(wide), mask)),
    }
    if floor > 0:
        metrics["tis/below_min_frac"] = float(masked_mean(below.to(wide), mask))
    return weights, metrics


def truncated_is_weights(train_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor,
                         cap: float) -> tuple[Tensor, dict]:
    """Per-token weights min(exp(train_logp - sampler_logp), cap): `importance_weights` in token_truncate."""
    return importance_weights(train_logp, sampler_logp, response_mask, cap, "token_truncate")


def sampler_mismatch(train_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor, cap: float) -> dict:
    """How far the sampler's log-probs are from the trainer's on the sampled tokens, over valid tokens:

      sampler/log_ratio_mean    mean of log pi_train(y_t) - log mu(y_t)
      sampler/log_ratio_max     largest |log pi_train(y_t) - log mu(y_t)|
      sampler/beyond_cap_frac   share of tokens whose ratio pi_train / mu exceeds `cap` (what TIS would truncate)

    Logged for every engine that returns its log-probs, whether or not a correction is applied.
    """
    mask = as_bool_mask(response_mask)
    log_ratio = masked_fill_zero((train_logp.detach() - sampler_logp.detach()).double(), mask)
    if not bool(mask.any()):
        return {}
    return {"sampler/log_ratio_mean": float(masked_mean(log_ratio, mask)),
            "sampler/log_ratio_max": float(log_ratio.abs().max()),
            "sampler/beyond_cap_frac": float(masked_mean((log_ratio > math.log(cap)).double(), mask))}
