"""covey: reinforcement-learning post-training of language models.

    import covey
    cfg = covey.load_config("grpo", ["train.steps=20"])   # a packaged preset, then key=value overrides
    result = covey.train(cfg, reward_funcs=[...])        # -> TrainResult (run_dir, accuracies, metrics)

    session = covey.open_run(cfg)                        # or step by step: covey.train is these three
    for metrics in covey.steps(session):                 # one training step each; `break` stops early
        ...
    result = covey.finish(session)                       # checkpoint, held-out accuracy, final/

Every name is imported on first use (PEP 562), so `import covey` stays light: `load_config`
(covey.config, which loads no torch), `train` (the package covey.train, callable; its first
call imports the models) and the step API of covey.train.loop.

The packages, lowest layer first (imports point down only; docs/design.md):
- config: the one typed config; algos: the tensor maths; batch: the Rollout, the typed batch
  between the stages of a step; runtime: process plumbing with no RL in it;
- tasks: prompts and their verifiers; models: weights into modules;
- passes: one batch through one model at train time;
- rollout: the sampling engines; rewards: scoring completions;
- rm: training reward models;
- train: the run (plan, loop, update);
- report: reading run folders back;
- cli: the command line.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["__version__", "finish", "load_config", "open_run", "steps", "train"]
STEP_API = ("open_run", "steps", "finish")


def __getattr__(name: str):
    if name == "load_config":
        return importlib.import_module("covey.config").load_config
    if name == "train":
        return importlib.import_module("covey.train")
    if name in STEP_API:
        return getattr(importlib.import_module("covey.train.loop"), name)
    raise AttributeError(f"module 'covey' has no attribute {name!r}")
