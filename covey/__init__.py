"""covey: reinforcement-learning post-training of language models.

    import covey
    cfg = covey.load_config("grpo", ["train.steps=20"])   # a packaged preset, then key=value overrides
    result = covey.train(cfg, reward_funcs=[...])        # -> TrainResult (run_dir, accuracies, metrics)

`load_config` is imported with the package (no torch); `train` (the package covey.train, callable)
is imported on first use, so `import covey` stays light.
"""

import importlib

from covey.config import load_config

__version__ = "0.1.0"
__all__ = ["__version__", "load_config", "train"]


def __getattr__(name: str):
    """PEP 562: `covey.train` is imported when first asked for (it imports torch and the models)."""
    if name == "train":
        return importlib.import_module("covey.train")
    raise AttributeError(f"module 'covey' has no attribute {name!r}")
