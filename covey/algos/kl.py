"""Per-token KL estimators (Schulman, "Approximating KL divergence", 2020) and KL controllers.

With d = logp - ref_logp = log(pi_theta / pi_ref) on a token sampled from pi_theta,
and r = pi_ref / pi_theta = exp(-d):

    k1  = d                      unbiased for KL(pi_theta || pi_ref), can be negative
    k2  = d^2 / 2                biased, >= 0, gradient = d * grad(logp)
    k3  = r - 1 - log r = exp(-d) + d - 1     unbiased and >= 0
    abs = |d|
    k1_st, k3_st: value of k1 / k3, gradient of k2 (straight-through)

d is clamped to [-clamp, clamp] first, so exp never overflows (the gradient is 0 outside).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _k1(d: Tensor) -> Tensor:
    return d


def _k2(d: Tensor) -> Tensor:
    return 0.5 * d * d


def _k3(d: Tensor) -> Tensor:
    return torch.expm1(-d) + d


def _abs(d: Tensor) -> Tensor:
    return d.abs()


def _straight_through(value_fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def estimator(d: Tensor) -> Tensor:
        k2 = _k2(d)
        return k2 + (value_fn(d) - k2).detach()
    return estimator


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1, "k2": _k2, "k3": _k3, "abs": _abs,
    "k1_st": _straight_through(_k1), "k3_st": _straight_through(_k3),
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3", clamp: float = 20.0) -> Tensor:
    """(N, L) per-token KL estimate of KL(pi_theta || pi_ref) from the log-probs of the sampled tokens."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")
    d = (logp - ref_logp).clamp(min=-clamp, max=clamp)
    return KL_ESTIMATORS[kind](d)


class FixedKLController:
    """Constant beta."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same signature as AdaptiveKLController.update)."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not target > 0 or not horizon > 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """n_steps: samples (or steps, consistently with horizon) since the last update."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
