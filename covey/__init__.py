"""covey: reinforcement-learning post-training of language models.

    import covey
    cfg = covey.load_config("grpo", ["train.steps=20"])   # a packaged preset, then key=value overrides
    result = covey.train(cfg, reward_funcs=[...])        # -> TrainResult (run_dir, accuracies, metrics)

    session = covey.open_run(cfg, reward_funcs=[...])    # or step by step: covey.train is these three
    for metrics in covey.steps(session):                 # one training step each; `break` stops early
        ...
    result = covey.finish(session)                       # checkpoint, held-out accuracy, final/

`import covey` stays light (no torch): `load_config` (covey.config, which loads no torch) and the step
API (open_run, steps, finish of covey.training.loop) are imported on first use (PEP 562), and so is the
run's code when `train` is first called.

`covey.train` is the function below, the one public way to train; the run's code is the package
covey.training (`from covey.training import loop`).

The packages, lowest layer first (imports point down only; docs/design.md):
- config: the one typed config; algos: the tensor maths; batch: the Rollout, the typed batch
  between the stages of a step; runtime: process plumbing with no RL in it;
- tasks: prompts and their verifiers; models: weights into modules;
- passes: one batch through one model at train time;
- rollout: the sampling engines; rewards: scoring completions;
- rm: training reward models; serve: the policy server (OpenAI-compatible, token-faithful); envs:
  environments and agent harnesses from outside, their episodes as rows;
- training: the run's code (plan, loop, update);
- report: reading run folders back;
- cli: the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from covey.config import Config
    from covey.training.setup import TrainResult

__version__ = "0.1.0"
__all__ = ["__version__", "finish", "load_config", "open_run", "steps", "train"]
STEP_API = ("open_run", "steps", "finish")


def train(config: Config, *, reward_funcs: Iterable[Callable | str] | Callable | str | None = None,
          reward_weights: Iterable[float] | None = None, tools: Iterable[Callable] | Callable | None = None,
          environment_factory: Callable | dict | None = None) -> TrainResult:
    """Train a policy as `config` (covey.load_config) says; returns a TrainResult: the run folder, the saved
    model, the held-out accuracy before and after, the last step's metrics.

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
    may call over several turns, or one function, as TRL's `tools=` (added to rollout.tools; docs/agents.md).
    environment_factory: a class as TRL's `environment_factory=`: one instance per episode,
    `reset(**row)`, its public methods as tools, an optional `get_reward()`; or a dict of them by name
    (instead of rollout.environment).

    `covey train` on the command line runs this function; covey.open_run takes the same keywords.
    """
    loop = importlib.import_module("covey.training.loop")
    session = loop.open_run(config, reward_funcs=reward_funcs, reward_weights=reward_weights, tools=tools,
                            environment_factory=environment_factory)
    try:
        for _ in loop.steps(session):
            pass
        return loop.finish(session)
    finally:
        session.close()


def __getattr__(name: str):
    if name == "load_config":
        return importlib.import_module("covey.config").load_config
    if name in STEP_API:
        return getattr(importlib.import_module("covey.training.loop"), name)
    raise AttributeError(f"module 'covey' has no attribute {name!r}")
