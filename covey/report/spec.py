"""What a comparison asks for: algorithms, seeds, one budget and shared overrides, parsed from
`covey compare`'s arguments. Without the Plan (no torch): `covey --help` builds its parser from the
defaults here; the runner is covey/report/compare.py."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from covey.config import ConfigError

DEFAULT_ALGOS = ("grpo", "ppo", "reinforce_pp", "dpo_iterative")
DEFAULT_SEEDS = (0, 1)
DEFAULT_BUDGET = "steps=8"
BUDGET_KINDS = ("steps", "samples", "minutes")


@dataclass(frozen=True)
class Budget:
    """What every run gets: optimizer-rollout steps, sampled completions, or minutes of training steps."""
    kind: str
    value: float

    def __str__(self) -> str:
        return f"{self.kind}={self.value:g}"


def parse_budget(text: str) -> Budget:
    kind, _, raw = text.partition("=")
    if kind not in BUDGET_KINDS or not raw:
        raise ConfigError(f"--budget '{text}' must be one of: steps=N, samples=N, minutes=N")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--budget '{text}': '{raw}' is not a number") from None
    if value <= 0 or (kind != "minutes" and not value.is_integer()):
        what = "number" if kind == "minutes" else "integer"
        raise ConfigError(f"--budget '{text}': {kind} must be a positive {what}")
    return Budget(kind, value)


def parse_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or len(set(items)) != len(items):
        raise ConfigError(f"--{what} '{text}' must be a comma-separated list without repeats")
    return items


@dataclass
class CompareSpec:
    """One comparison: algorithms, seeds, budget and the overrides every run shares."""
    name: str
    algos: list[str]
    seeds: list[int]
    budget: Budget
    overrides: list[str] = field(default_factory=list)
    output_dir: str = "runs"

    @property
    def root(self) -> Path:
        return Path(self.output_dir) / f"compare-{self.name}"

    def record(self) -> dict:
        return {"name": self.name, "algos": self.algos, "seeds": self.seeds, "budget": str(self.budget),
                "overrides": self.overrides, "command": command_line(self)}


def command_line(spec: CompareSpec) -> str:
    where = [f"train.output_dir={spec.output_dir}"] if spec.output_dir != "runs" else []
    parts = ["covey", "compare", *where, *spec.overrides, "--algos", ",".join(spec.algos),
             "--seeds", ",".join(map(str, spec.seeds)), "--budget", str(spec.budget), "--name", spec.name]
    return shlex.join(parts)
