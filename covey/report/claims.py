"""Claims commonly made about GRPO, PPO, REINFORCE++, DPO and the 2025 policy losses (DAPO, CISPO,
GSPO), each turned into a test on the compare runs.

Each claim names its source: the paper that introduced the algorithm or the argument behind
the claim (DeepSeekMath, Shao et al., 2024, arXiv:2402.03300, for GRPO against PPO; Hu, 2025,
arXiv:2501.03262, for REINFORCE++; Rafailov et al., 2023, arXiv:2305.18290, for DPO; Xu et
al., 2024, arXiv:2404.10719, for PPO against DPO; Yu et al., 2025, arXiv:2503.14476, for DAPO;
MiniMax, 2025, arXiv:2506.13585, for CISPO; Zheng et al., 2025, arXiv:2507.18071, for GSPO). A
size such as "about 50%" or "20-30%" is the figure commonly quoted, not a measurement from the
paper. The papers measured their claims on models of 7-32B over hundreds of steps; on a small
model and a short budget a claim may not show, which is what "inconclusive" says.

Every verdict is computed from the run data (covey.report.data), never written by hand:

- a claim with a stated size ("about 50% less memory") is *supported* when the measured
  size lies within the stated range widened by a tolerance, *not supported* otherwise;
- a directional claim ("A is more stable than B") is a two-sided Welch t-test at 5% on the
  claim's units (seeds, or steps pooled over seeds; the table names them): *supported* when
  the difference is significant in the claimed direction, *not supported* when it is
  significant the other way, *inconclusive* when it is not significant or fewer than two
  units exist on a side;
- a claim whose algorithms are not both in the comparison is *not measured*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from covey.report.data import AlgoData, Stat

# Two-sided 5% critical values of Student's t by degrees of freedom (Welch df is rounded down,
# which errs towards "inconclusive"); between listed values the smaller df is used, 1.96 beyond 120.
T_CRIT = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
          10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
          18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
          26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE, NOT_MEASURED = "supported", "not supported", "inconclusive", "not measured"


@dataclass(frozen=True)
class Verdict:
    verdict: str
    measured: str


def t_critical(df: float) -> float:
    if df < 1:
        return math.inf
    if df > 120:  # inf included (both sides without spread)
        return 1.96
    df = math.floor(df)
    return T_CRIT[max(k for k in T_CRIT if k <= df)]


def welch(a: Stat, b: Stat) -> tuple[float, float]:
    """(t, df) of Welch's test of mean(a) - mean(b); t = +-inf when both sides have zero spread."""
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    diff = a.mean - b.mean
    if va + vb == 0:
        return (math.copysign(math.inf, diff) if diff else 0.0), math.inf
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    return diff / math.sqrt(va + vb), df


def fmt(x: float, unit: str = "", digits: int = 3) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}g}{unit}"


def directional(a: Stat, b: Stat, names: tuple[str, str], what: str, unit: str, units_label: str,
                a_should_be: str) -> Verdict:
    """Welch test of the claim mean(a) < mean(b) (a_should_be='lower') or > ('higher')."""
    text = (f"{what}: {names[0]} {fmt(a.mean, unit)} ± {fmt(a.sd, unit, 2)} vs {names[1]} "
            f"{fmt(b.mean, unit)} ± {fmt(b.sd, unit, 2)} (mean ± sd over {a.n} / {b.n} {units_label})")
    if a.n < 2 or b.n < 2:
        return Verdict(INCONCLUSIVE, text + "; fewer than 2 units on a side")
    t, df = welch(a, b)
    crit = t_critical(df)
    text += f"; Welch t = {fmt(t, digits=3)}, df = {fmt(df, digits=3)}, critical t = {crit:.3g}"
    if abs(t) < crit:
        return Verdict(INCONCLUSIVE, text)
    in_claimed_direction = (t < 0) == (a_should_be == "lower")
    return Verdict(SUPPORTED if in_claimed_direction else NOT_SUPPORTED, text)


def in_range(value: float, low: float, high: float, text: str) -> Verdict:
    if not math.isfinite(value):
        return Verdict(INCONCLUSIVE, text + "; not measured in these runs")
    return Verdict(SUPPORTED if low <= value <= high else NOT_SUPPORTED,
                   text + f"; accepted range {low:.0%} to {high:.0%}")


def saving(small: float, large: float) -> float:
    return 1 - small / large if large and math.isfinite(large) and math.isfinite(small) else float("nan")


# --------------------------------------------------------------------------- the claims

def memory_half(d: dict[str, AlgoData]) -> Verdict:
    g, p = d["grpo"].per_seed("model_state_mb"), d["ppo"].per_seed("model_state_mb")
    gp, pp = d["grpo"].per_seed("params_mb"), d["ppo"].per_seed("params_mb")
    s = saving(g.mean, p.mean)
    text = (f"model state (parameters of every model + optimizer states): GRPO {g.mean:.0f} MB, PPO "
            f"{p.mean:.0f} MB, saving {fmt(s * 100, '%')}; parameters only: {gp.mean:.0f} vs {pp.mean:.0f} MB, "
            f"saving {fmt(saving(gp.mean, pp.mean) * 100, '%')}")
    return in_range(s, 0.35, 0.65, text)


def memory_gpu(d: dict[str, AlgoData]) -> Verdict:
    g, p = d["grpo"].per_seed("peak_rss_mb"), d["ppo"].per_seed("peak_rss_mb")
    s = saving(g.mean, p.mean)
    text = (f"peak resident memory of the training process (CPU stand-in for GPU memory): GRPO {g.mean:.0f} MB, "
            f"PPO {p.mean:.0f} MB, saving {fmt(s * 100, '%')}")
    return in_range(s, 0.15, 0.35, text)


def pooled_metric(metric: str, what: str, unit: str, a_should_be: str) -> Callable:
    def check(d: dict[str, AlgoData], a: str, b: str) -> Verdict:
        return directional(d[a].pooled(metric), d[b].pooled(metric), (a, b), what, unit,
                           "steps x seeds", a_should_be)
    return check


def accuracy_gain(d: dict[str, AlgoData], a: str, b: str) -> Verdict:
    """Held-out accuracy after minus before, per seed, in percentage points."""
    def points(algo: str) -> Stat:
        return Stat([100 * v for v in d[algo].per_seed("acc_gain").values])
    return directional(points(a), points(b), (a, b), "held-out accuracy gain", " pts", "seeds", "higher")


def update_variance(d: dict[str, AlgoData], a: str, b: str) -> Verdict:
    """Trace of the covariance of the mini-batch policy gradient (covey/training/gradvar.py); the noise
    fraction is shown beside it (near 1 means the mini-batch gradient is almost all noise)."""
    va, vb = d[a].pooled("policy/grad_var"), d[b].pooled("policy/grad_var")
    if va.n == 0 and vb.n == 0:
        return Verdict(NOT_MEASURED, "no run measured the policy-gradient variance (train.grad_var_every=0)")
    verdict = directional(va, vb, (a, b), "policy-gradient variance tr(Cov)", "", "measured steps x seeds", "lower")
    fa, fb = d[a].pooled("policy/grad_noise_frac"), d[b].pooled("policy/grad_noise_frac")
    return Verdict(verdict.verdict, verdict.measured + f"; noise fraction {a} {fmt(fa.mean)}, {b} {fmt(fb.mean)}")


def fluctuation(d: dict[str, AlgoData], a: str, b: str) -> Verdict:
    return directional(d[a].pooled_changes("reward/mean"), d[b].pooled_changes("reward/mean"), (a, b),
                       "mean absolute change of the mean reward between consecutive steps", "",
                       "step pairs x seeds",
                       "lower")


@dataclass(frozen=True)
class Claim:
    source: str  # the paper the claim goes back to: name (authors, year, arXiv id)
    text: str
    algos: tuple[str, ...]
    check: Callable


GRPO = "DeepSeekMath (Shao et al., 2024, arXiv:2402.03300)"
REINFORCE_PP = "REINFORCE++ (Hu, 2025, arXiv:2501.03262)"
DPO = "DPO (Rafailov et al., 2023, arXiv:2305.18290)"
PPO_VS_DPO = "Is DPO Superior to PPO? (Xu et al., 2024, arXiv:2404.10719)"
DAPO = "DAPO (Yu et al., 2025, arXiv:2503.14476)"
CISPO = "MiniMax-M1 (MiniMax, 2025, arXiv:2506.13585)"
GSPO = "GSPO (Zheng et al., 2025, arXiv:2507.18071)"

CLAIMS = (
    Claim(GRPO, "GRPO drops the critic and saves about 50% of the model (parameter) memory of PPO",
          ("grpo", "ppo"), lambda d, a, b: memory_half(d)),
    Claim(GRPO, "GRPO needs 20-30% less GPU memory than PPO", ("grpo", "ppo"), lambda d, a, b: memory_gpu(d)),
    Claim(GRPO, "GRPO's group-relative advantages give a lower-variance update than PPO's GAE",
          ("grpo", "ppo"), update_variance),
    Claim(GRPO, "GRPO converges faster than PPO on math (same budget: larger held-out accuracy gain)",
          ("grpo", "ppo"), accuracy_gain),
    Claim(GRPO, "GRPO is more stable than PPO (smaller reward fluctuations)", ("grpo", "ppo"), fluctuation),
    Claim(REINFORCE_PP, "REINFORCE++ is more stable than GRPO", ("reinforce_pp", "grpo"), fluctuation),
    Claim(REINFORCE_PP, "REINFORCE++ is faster than PPO (wall time per step)", ("reinforce_pp", "ppo"),
          pooled_metric("time/step", "seconds per step", " s", "lower")),
    Claim(DPO, "DPO (iterative) is cheaper than PPO (wall time per step)", ("dpo_iterative", "ppo"),
          pooled_metric("time/step", "seconds per step", " s", "lower")),
    Claim(PPO_VS_DPO, "PPO beats (iterative) DPO (same budget: larger held-out accuracy gain)",
          ("ppo", "dpo_iterative"), accuracy_gain),
    Claim(DAPO, "Clip-higher keeps the policy's entropy from collapsing: DAPO's token entropy stays above GRPO's",
          ("dapo", "grpo"), pooled_metric("policy/entropy", "mean token entropy of the sampled answers", " nats",
                                          "higher")),
    Claim(DAPO, "DAPO beats GRPO (same steps: larger held-out accuracy gain)", ("dapo", "grpo"), accuracy_gain),
    Claim(CISPO, "CISPO learns faster than DAPO (same steps: larger held-out accuracy gain)", ("cispo", "dapo"),
          accuracy_gain),
    Claim(CISPO, "CISPO learns faster than GRPO (same steps: larger held-out accuracy gain)", ("cispo", "grpo"),
          accuracy_gain),
    Claim(GSPO, "GSPO clips a far larger share of the tokens than GRPO (whole sequences at a time)",
          ("gspo", "grpo"), pooled_metric("policy/clipfrac", "share of tokens clipped", "", "higher")),
    Claim(GSPO, "GSPO trains more efficiently than GRPO (same steps: larger held-out accuracy gain)",
          ("gspo", "grpo"), accuracy_gain),
    Claim(GSPO, "GSPO is more stable than GRPO (smaller reward fluctuations)", ("gspo", "grpo"), fluctuation),
)


def evaluate_claims(data: dict[str, AlgoData]) -> list[tuple[Claim, Verdict]]:
    out = []
    for claim in CLAIMS:
        missing = [a for a in claim.algos if a not in data]
        if missing:
            out.append((claim, Verdict(NOT_MEASURED, f"{', '.join(missing)} not in this comparison")))
        else:
            out.append((claim, claim.check(data, *claim.algos[:2])))
    return out
