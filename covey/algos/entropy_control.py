"""The entropy bonus's coefficient: fixed, or adapted each step toward a target entropy.

Adaptive entropy control (He et al. 2025, Skywork-OR1, arXiv:2505.22312, section 3.2): with e_k the
policy's mean token entropy on the step-k batch, target H*, step size delta and c_0 the initial
coefficient,

    alpha_k   = c_k * 1[e_k <= H*]                      the coefficient of step k's entropy bonus
    c_{k+1}   = c_k + delta   if e_k < H*
              = c_k - delta   if e_k > H*               clipped to [0, c_max]
              = c_k           if e_k = H*

so the bonus acts only while the entropy is at or below the target, and grows the longer it stays
there. (The paper: H* = 0.2, delta = 0.005, c_0 = 0. TRL's `use_adaptive_entropy` applies the previous
step's entropy to the gate and moves c also at e_k = H*.)
"""

from __future__ import annotations


class FixedEntropyController:
    """A constant coefficient."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def observe(self, entropy: float) -> None:
        """No-op (the signature of AdaptiveEntropyController.observe)."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveEntropyController:
    """Skywork-OR1's rule: `observe(e_k)` sets `value` = alpha_k for this step's update and moves c."""

    def __init__(self, init_coef: float, target: float, delta: float, max_coef: float):
        if not (target > 0 and delta > 0 and max_coef >= 0 and 0 <= init_coef <= max_coef):
            raise ValueError(f"adaptive entropy needs target > 0, delta > 0 and 0 <= init <= max, got "
                             f"target={target} delta={delta} init={init_coef} max={max_coef}")
        self.coef = float(init_coef)
        self.value = float(init_coef)
        self.target, self.delta, self.max_coef = float(target), float(delta), float(max_coef)

    def observe(self, entropy: float) -> None:
        self.value = self.coef if entropy <= self.target else 0.0
        if entropy < self.target:
            self.coef = min(self.coef + self.delta, self.max_coef)
        elif entropy > self.target:
            self.coef = max(self.coef - self.delta, 0.0)

    def state_dict(self) -> dict:
        return {"value": self.value, "coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.coef = float(state.get("coef", self.value))
