"""What several commands share: their config from command-line items, with the CPU settings applied."""

from __future__ import annotations

import os
import typing


def quiet_progress_bars(environ: typing.Mapping[str, str] = os.environ) -> None:
    """Turn off transformers' own progress bars ("Loading weights", "Writing model shards"), drawn
    on every model load and checkpoint: a command that runs a model prints its own lines, and the
    bars' carriage returns fill log files. HF_HUB_DISABLE_PROGRESS_BARS, when set, decides instead."""
    if environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is None:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


def config_with_cpu_settings(items: typing.Sequence[str]):
    """The config of a command that runs a model outside `train` (which applies them itself):
    a preset or YAML file, then key=value overrides; model.threads applied, transformers' progress
    bars off."""
    from covey.config import load_config, split_config
    from covey.runtime.cpu import apply_cpu_settings
    cfg = load_config(*split_config(items))
    apply_cpu_settings(cfg.model.threads)
    quiet_progress_bars()
    return cfg


def command_device(setting: str) -> str:
    """train.device resolved for a command that runs one model (eval, train-rm, eval-rm); a
    missing GPU is a one-line error."""
    from covey.runtime.dist import resolve_device
    return resolve_device(setting)
