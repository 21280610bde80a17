"""covey: reinforcement-learning post-training of language models.

    import covey
    cfg = covey.load_config("grpo", ["train.steps=20"])   # a packaged preset, then key=value overrides
    result = covey.train(cfg, reward_funcs=[...])        # -> TrainResult (run_dir, accuracies, metrics)

Both names are imported on first use (PEP 562), so `import covey` stays light: `load_config`
(covey.config, which loads no torch) and `train` (the package covey.train, callable; its first
call imports the models).
"""

import importlib

__version__ = "0.1.0"
__all__ = ["__version__", "load_config", "train"]


def __getattr__(name: str):
    if name == "load_config":
        return importlib.import_module("covey.config").load_config
    if name == "train":
        return importlib.import_module("covey.train")
    raise AttributeError(f"module 'covey' has no attribute {name!r}")
