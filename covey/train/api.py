"""The Python API of a training run: `covey.train(config, reward_funcs=None, reward_weights=None) -> TrainResult`.

    import covey
    cfg = covey.load_config("grpo", ["train.steps=20", "rollout.group_size=8"])
    def brevity(completions, **kwargs):          # TRL's reward calling convention
        return [-len(c) / 100 for c in completions]
    result = covey.train(cfg, reward_funcs=[brevity])
    print(result.accuracy_before, result.accuracy_after, result.run_dir, result.metrics)

`covey train` on the command line runs the same function.
"""

from __future__ import annotations

from typing import Callable, Iterable

from covey.config import Config
from covey.rewards.build import user_terms
from covey.train import loop
from covey.train.setup import TrainResult

__all__ = ["TrainResult", "train"]


def train(config: Config, reward_funcs: Iterable[Callable | str] | Callable | str | None = None,
          reward_weights: Iterable[float] | None = None, tools: Iterable[Callable] | None = None,
          environment_factory: Callable | None = None) -> TrainResult:
    """Train a policy as `config` says; returns the run folder, the saved model and held-out accuracies.

    reward_funcs: Python callables (`def` or `async def`) and/or "module:function[:weight]" /
    "file.py:function[:weight]" strings, or one of them alone, added to the configured rewards
    (reward.functions) with weight 1 unless given. Each is called with keyword arguments, TRL's
    convention: fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=...,
    answer=[...], completion_lengths=[...], **every other dataset column) -> one float (or None: not
    scored) per completion, and is reported as reward/<function name> in metrics.jsonl
    (reward/user:<name> where covey has a term of that name; docs/your-task.md).
    reward_weights: one weight per function of reward_funcs, in order (TRL's reward_weights).
    Each function is checked, and called once, before any model loads.
    tools: plain Python functions (sync or async, type hints and a Google-style docstring) the model
    may call over several turns, as TRL's `tools=` (added to rollout.tools; docs/agents.md).
    environment_factory: a class as TRL's `environment_factory=`: one instance per episode,
    `reset(**row)`, its public methods as tools, an optional `get_reward()` (instead of rollout.environment).
    """
    if not isinstance(config, Config):
        raise TypeError(f"covey.train takes the Config of covey.load_config(...), not {type(config).__name__}")
    return loop.train(config, user_terms(reward_funcs, reward_weights),
                      agent={"tools": tools, "environment_factory": environment_factory})
