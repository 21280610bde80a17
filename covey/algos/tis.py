"""Truncated importance sampling (TIS) for a sampler whose log-probs differ from the trainer's.

A fast inference engine (vLLM) samples with its own kernels and its own copy of the
weights, so the behaviour policy mu that drew the tokens is not exactly the policy
pi the trainer evaluates, even right after a weight sync. The policy gradient is then
corrected per token by the importance weight pi/mu, truncated at a cap C so a few
tokens the sampler found very unlikely cannot dominate the batch (Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training"; Ionides 2008
for truncated IS):

    w_t = min( pi_train(y_t) / pi_sampler(y_t), C )          computed in log space, no gradient

`pi_train` is the trainer's log-prob of the sampled token under the weights the
sampler had (pi_old); the loss term of token t is multiplied by w_t.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean
from covey.algos.losses import LOG_RATIO_CLAMP


def truncated_is_weights(train_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor,
                         cap: float) -> tuple[Tensor, dict]:
    """Per-token weights min(exp(train_logp - sampler_logp), cap), (N, L), 0 where masked; and metrics.

    train_logp, sampler_logp: (N, L) log-probs of the sampled tokens; cap >= 1.
    Metrics (means over valid tokens, plain floats):
      tis/weight_mean    mean w
      tis/capped_frac    share of tokens whose ratio exceeded the cap
      tis/ratio_max      largest untruncated ratio
      tis/mismatch_kl    k3 estimate of KL(mu || pi) from the sampler's tokens: r - 1 - log r, r = pi/mu
    """
    if cap < 1:
        raise ValueError(f"truncated IS cap must be >= 1, got {cap}")
    mask = as_bool_mask(response_mask)
    log_ratio = masked_fill_zero((train_logp - sampler_logp).detach(), mask)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weights = masked_fill_zero(ratio.clamp(max=cap), mask)
    wide = torch.float64 if ratio.dtype == torch.float64 else torch.float32
    metrics = {
        "tis/weight_mean": float(masked_mean(weights.to(wide), mask)),
        "tis/capped_frac": float(masked_mean((ratio > cap).to(wide), mask)),
        "tis/ratio_max": float(masked_fill_zero(ratio, mask).max()) if bool(mask.any()) else 0.0,
        "tis/mismatch_kl": float(masked_mean((torch.expm1(log_ratio) - log_ratio).to(wide), mask)),
    }
    return weights, metrics


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
