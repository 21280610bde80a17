"""Loading a Config: defaults <- a preset <- key=value overrides, then the checks.

A preset is a packaged YAML file named on the command line (`covey train ppo`): the files in
covey/config/presets/ ship with the package. Anything that is not a preset name is read as the
path of a YAML file of the same shape. Unknown keys fail with a close-match suggestion; values
are converted to the field's type or fail naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from importlib import resources
from pathlib import Path

import yaml

from covey.config.checks import validate
from covey.config.schema import Config, ConfigError, leaf_keys

PRESET_SUFFIX = ".yaml"


def preset_names() -> tuple[str, ...]:
    """The packaged presets, sorted: ('dpo_iterative', 'dr_grpo', 'grpo', 'ppo', ...)."""
    folder = resources.files("covey.config") / "presets"
    return tuple(sorted(p.name[:-len(PRESET_SUFFIX)] for p in folder.iterdir() if p.name.endswith(PRESET_SUFFIX)))


def preset_path(name: str) -> Path:
    """The packaged YAML file of preset `name`; a one-line ConfigError listing the presets otherwise."""
    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown preset '{name}'{hint}; presets: {', '.join(names)}")
    return Path(str(resources.files("covey.config") / "presets" / f"{name}{PRESET_SUFFIX}"))


def preset_file(preset: str) -> Path:
    """A preset name -> its packaged file; a path -> that YAML file (which must exist)."""
    if preset in preset_names():
        return preset_path(preset)
    path = Path(preset)
    if path.is_file():
        return path
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        raise ConfigError(f"config file not found: {preset}")
    return preset_path(preset)  # neither a preset nor a file: the error lists the presets


def read_preset(preset: str) -> dict:
    """{dotted key: value} of a preset name or YAML file."""
    path = preset_file(preset)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{preset}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{preset}: top level must be a mapping")
    return flatten(data)


def split_config(items: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """Command-line items -> (preset name or YAML path, or None; key=value overrides)."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def load_config(preset: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- preset (a name from preset_names() or a YAML path; None = the defaults, which
    are the grpo preset) <- key=value overrides; then every check of covey/config/checks.py."""
    cfg = Config()
    pairs = list(read_preset(preset).items()) if preset else []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value")
        k, v = item.split("=", 1)
        pairs.append((k.strip(), parse_override(cfg, k.strip(), v)))
    for k, v in pairs:
        set_value(cfg, k, v)
    validate(cfg)
    return cfg


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """A Config from a nested dict (a checkpoint's config.json); not checked."""
    cfg = Config()
    for k, v in flatten(data).items():
        set_value(cfg, k, v)
    return cfg


def config_yaml(cfg: Config) -> str:
    """The whole config as YAML (`covey train ... --print-config`); load_config reads it back as a file."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False, allow_unicode=True)


# Names users of TRL, verl and OpenRLHF type, and covey's keys for them. A bare name here is never
# read as a leaf of some other section (`learning_rate` would otherwise land on rm.learning_rate).
PEER_NAMES = {
    "learning_rate": "optim.lr (the policy's; the reward model's is rm.learning_rate)",
    "actor_learning_rate": "optim.lr", "critic_learning_rate": "optim.critic_lr",
    "kl_coef": "algo.beta", "init_kl_coef": "algo.beta", "kl_beta": "algo.beta", "kl_loss_coef": "algo.beta",
    "kl_target": "algo.kl_target", "use_kl_loss": "algo.kl_in=loss", "kl_loss_type": "algo.kl_estimator",
    "num_generations": "rollout.group_size", "n_samples_per_prompt": "rollout.group_size",
    "rollout_n": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens", "response_length": "rollout.max_new_tokens",
    "generate_max_len": "rollout.max_new_tokens", "max_response_length": "rollout.max_new_tokens",
    "per_device_train_batch_size": "rollout.prompts_per_step (prompts per step; each gets rollout.group_size "
                                   "samples) and algo.micro_batch_size (sequences per forward/backward)",
    "train_batch_size": "rollout.prompts_per_step", "rollout_batch_size": "rollout.prompts_per_step",
    "micro_train_batch_size": "algo.micro_batch_size", "ppo_micro_batch_size": "algo.micro_batch_size",
    "mini_batch_size": "algo.minibatches (optimizer steps per rollout pass)",
    "num_iterations": "algo.epochs", "ppo_epochs": "algo.epochs", "max_epochs": "algo.epochs",
    "num_train_epochs": "train.steps", "max_steps": "train.steps",
    "epsilon": "algo.clip_eps_low and algo.clip_eps_high", "cliprange": "algo.clip_eps_low and algo.clip_eps_high",
    "clip_ratio": "algo.clip_eps_low and algo.clip_eps_high", "eps_clip": "algo.clip_eps_low and algo.clip_eps_high",
    "epsilon_high": "algo.clip_eps_high", "clip_ratio_high": "algo.clip_eps_high",
    "loss_type": "algo.loss_agg", "loss_agg_mode": "algo.loss_agg",
    "cliprange_value": "algo.value_clip", "vf_coef": "algo.value_coef", "entropy_coeff": "algo.entropy_coef",
    "adv_estimator": "algo.estimator", "advantage_estimator": "algo.estimator",
    "model_name_or_path": "model.path", "pretrain": "model.path", "lora_r": "model.lora_rank",
    "scale_rewards": "algo.std_normalize",
}


def resolve_key(key: str) -> tuple[str, str]:
    """'algo.beta' -> ('algo', 'beta'); a bare unique leaf name ('steps') also works, except the
    names other trainers use (PEER_NAMES), which fail with covey's key for them."""
    keys = leaf_keys()
    if key in keys:
        section, name = key.split(".")
        return section, name
    if key in PEER_NAMES:
        raise ConfigError(f"unknown config key '{key}' (another trainer's name): covey's is {PEER_NAMES[key]}")
    if "." not in key:
        matches = [k for k in keys if k.split(".")[1] == key]
        if len(matches) == 1:
            section, name = matches[0].split(".")
            return section, name
        if len(matches) > 1:
            raise ConfigError(f"ambiguous config key '{key}': use one of {', '.join(matches)}")
    close = difflib.get_close_matches(key, keys + [k.split(".")[1] for k in keys], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}")


def convert(key: str, raw, typ: str):
    """Convert a YAML or command-line value to the field's declared type."""
    try:
        if typ == "bool":
            return to_bool(raw)
        if typ == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(float(raw)) if isinstance(raw, str) and "e" in raw.lower() else int(raw)
        if typ == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        return "" if raw is None else str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"config key '{key}' expects {typ}, got {raw!r}") from None


def to_bool(raw) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def field_type(cfg: Config, section: str, name: str) -> str:
    return str({f.name: f.type for f in dataclasses.fields(getattr(cfg, section))}[name])


def set_value(cfg: Config, key: str, raw) -> None:
    section, name = resolve_key(key)
    setattr(getattr(cfg, section), name, convert(f"{section}.{name}", raw, field_type(cfg, section, name)))


def parse_override(cfg: Config, key: str, text: str):
    """A command-line value: the text itself for a string field (a template such as
    'From {start}: {steps}' is not YAML), read as YAML otherwise ('1e-5', 'true', '0.2')."""
    section, name = resolve_key(key)
    if field_type(cfg, section, name) == "str":
        return text
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"config key '{section}.{name}': cannot read {text!r}") from None


def flatten(data: dict, prefix: str = "") -> dict:
    """{'algo': {'beta': 0.1}} -> {'algo.beta': 0.1}."""
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
