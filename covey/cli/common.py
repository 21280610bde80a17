"""What several commands share: their config from command-line items, with the CPU settings applied."""

from __future__ import annotations

import typing


def config_with_cpu_settings(items: typing.Sequence[str]):
    """The config of a command that runs a model outside `train` (which applies them itself):
    a preset or YAML file, then key=value overrides; model.threads applied."""
    from covey.config import load_config, split_config
    from covey.runtime.cpu import apply_cpu_settings
    cfg = load_config(*split_config(items))
    apply_cpu_settings(cfg)
    return cfg


def command_device(cfg) -> str:
    """train.device resolved for a command that runs one model (eval, train-rm, eval-rm); a
    missing GPU is a one-line error."""
    from covey.runtime.dist import resolve_device
    return resolve_device(cfg.train.device)
