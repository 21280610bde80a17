"""Loading a Config: defaults <- presets and YAML files, in the order given <- key=value overrides,
then the checks.

A preset is a packaged YAML file named on the command line (`covey train ppo`): the files in
covey/config/presets/ ship with the package. Anything that is not a preset name is read as the
path of a YAML file of the same shape (`covey train ppo my.yaml k=v`: the preset, then the file,
then the overrides). Unknown keys fail naming covey's key for another trainer's name, or a close
key of the same section; values are converted to the field's type or fail naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from importlib import resources
from pathlib import Path

import yaml

from covey.config.checks import validate
from covey.config.schema import MAPPING_KEYS, Config, ConfigError, group_keys, leaf_keys, mapping_entry
from covey.config.schema_algo import MOVED_KEYS

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
        data = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error(preset, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{preset}: top level must be a mapping")
    pairs = flatten(data)
    for key in pairs:
        if moved_key(key):
            raise ConfigError(f"{preset}: {moved_line(moved_key(key))}")
    for key in [k for k in pairs if retired_key(k)]:  # an older run's config.yaml records every key it had
        print(f"covey: warning: {preset}: {retired_line(retired_key(key))}; left out", file=sys.stderr)
        del pairs[key]
    return pairs


# Keys covey no longer has, and what replaced them. Named on the command line they fail with this line; in a
# YAML file (an older run's config.yaml holds every key of its day) they are left out with it on stderr.
RETIRED_KEYS = {
    "algo.update_memory_share": "train.gpu_memory_gib (the GiB a run may take on one GPU, weights, optimizer "
                                "state and batches together; its batches are sized to fit it; 0 = the card's "
                                "memory less 10%)",
}


def retired_key(key: str) -> str | None:
    """The retired key `key` names ('algo.update_memory_share' or 'update_memory_share'), else None."""
    return next((k for k in RETIRED_KEYS if key in (k, k.split(".")[1])), None)


def retired_line(key: str) -> str:
    return f"config key '{key}' was replaced by {RETIRED_KEYS[key]}"


def moved_key(key: str) -> str | None:
    """The flat key `key` names ('algo.tis.cap' or 'tis_cap') that now lives in a nested group, else None."""
    return next((k for k in MOVED_KEYS if key in (k, k.split(".", 1)[1])), None)


def moved_line(key: str) -> str:
    return f"config key '{key}' is now {MOVED_KEYS[key]} (options live under their owner: covey train --help-config)"


def yaml_error(where: str, err: yaml.YAMLError) -> str:
    """'my.yaml:3:5: invalid YAML: mapping values are not allowed here': the line and column of the problem."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f"{where}: invalid YAML: {str(err).splitlines()[0]}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    since = f" ({context} that starts at {start.line + 1}:{start.column + 1})" if context and start else ""
    return f"{where}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {err.problem}{since}"


def split_config(items: typing.Sequence[str]) -> tuple[str | list[str] | None, list[str]]:
    """Command-line items -> (the preset name or YAML path before the first key=value, a list of them
    when several, or None; the key=value overrides)."""
    n = next((i for i, item in enumerate(items) if "=" in item), len(items))
    named = list(items[:n])
    return (named[0] if len(named) == 1 else named or None), list(items[n:])


def load_config(preset: str | typing.Sequence[str] | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- preset (a name from preset_names() or a YAML path, or a list of them applied in order;
    None = the defaults, which are the grpo preset) <- key=value overrides; then every check of
    covey/config/checks.py."""
    cfg = Config()
    named = [preset] if isinstance(preset, str) else list(preset or ())
    pairs = [pair for name in named for pair in read_preset(name).items()]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (presets and YAML files come before the "
                              "overrides)")
        k, v = item.split("=", 1)
        pairs.append((k.strip(), parse_override(cfg, k.strip(), v)))
    for k, v in pairs:
        set_value(cfg, k, v)
    validate(cfg)
    return cfg


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """A Config from a nested dict (a checkpoint's config.json; keys covey has retired left out); not checked."""
    cfg = Config()
    for k, v in flatten(data).items():
        if not retired_key(k):
            set_value(cfg, MOVED_KEYS.get(moved_key(k), k), v)
    return cfg


def config_yaml(cfg: Config) -> str:
    """The whole config as YAML (`covey train ... --print-config`); load_config reads it back as a file."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False, allow_unicode=True)


# TRL's names (GRPOConfig, its TrainingArguments and the TRL scripts' ModelConfig and ScriptArguments) and
# covey's keys for them; docs/your-task.md lists the same table. TRL names that are covey's own leaf names
# (beta, temperature, top_p, top_k, seed, warmup_steps, weight_decay, max_grad_norm, output_dir, run_name,
# gradient_checkpointing, lora_alpha, vllm_gpu_memory_utilization) work as they are.
TRL_NAMES = {
    "learning_rate": "optim.lr (the policy's; the reward model's is rm.learning_rate)",
    "num_generations": "rollout.group_size", "max_completion_length": "rollout.max_new_tokens",
    "per_device_train_batch_size": "rollout.prompts_per_step (prompts per step; each gets rollout.group_size "
                                   "samples) and algo.micro_batch_size (sequences per forward/backward)",
    "gradient_accumulation_steps": "algo.micro_batch_size (covey takes one step's whole gradient; this sets "
                                   "the sequences per forward/backward)",
    "generation_batch_size": "rollout.prompts_per_step (times rollout.group_size samples)",
    "steps_per_generation": "algo.minibatches", "num_iterations": "algo.epochs",
    "epsilon": "algo.clip_eps_low and algo.clip_eps_high",
    "epsilon_high": "algo.clip_eps_high (the same number with loss_type grpo, bnpo, dr_grpo, dapo; with "
                    "loss_type=cispo TRL's epsilon_high is the cap on the weight itself: "
                    "algo.clip_eps_high = epsilon_high - 1)",
    "importance_sampling_level": "algo.ratio_level",
    "loss_type": "algo.loss_agg (grpo, bnpo, dr_grpo, dapo) or algo.policy_loss (cispo, sapo, luspo, vespo); "
                 "loss_type=X names X's exact setting",
    "mask_truncated_completions": "algo.mask_truncated",
    "max_tool_calling_iterations": "rollout.max_turns (model turns: TRL's N tool-calling iterations are "
                                   "rollout.max_turns = N + 1)",
    "environment_factory": "rollout.environment=module:Class (or covey.train(..., environment_factory=...))",
    "reward_funcs": "reward.functions=module:function[:weight],... (or covey.train(..., reward_funcs=...))",
    "delta": "algo.dual_clip (TRL's two-sided clip at delta is the dual clip c = delta)",
    "scale_rewards": "algo.std_normalize",
    "max_steps": "train.steps", "num_train_epochs": "train.steps",
    "sync_ref_model": "algo.ref_refresh_every", "ref_model_sync_steps": "algo.ref_refresh_every",
    "ref_model_mixup_alpha": "algo.ref_ema", "vllm_importance_sampling_cap": "algo.tis.cap",
    "vllm_importance_sampling_clip_max": "algo.tis.cap", "vllm_importance_sampling_mode": "algo.tis.mode",
    "vllm_importance_sampling_clip_min": "algo.tis.min",
    "vllm_importance_sampling_correction": "algo.tis.cap (> 0 turns it on)",
    "use_adaptive_entropy": "algo.adaptive_entropy.enabled (algo.adaptive_entropy=true for short)",
    "use_vllm": "rollout.engine=vllm", "reward_weights": "reward.functions (a :weight after each function)",
    "save_steps": "train.save_every", "eval_steps": "train.eval_every", "save_total_limit": "train.keep_checkpoints",
    "report_to": "train.logger", "log_completions": "train.samples_every",
    "per_device_eval_batch_size": "rollout.eval_batch_size", "warmup_ratio": "optim.warmup_steps (in steps)",
    "bf16": "model.dtype=bfloat16", "model_name_or_path": "model.path", "use_peft": "model.lora_rank",
    "lora_r": "model.lora_rank", "lora_target_modules": "model.lora_targets",
    "dataset_name": "task.path", "dataset_train_split": "task.split", "dataset_test_split": "task.eval_split",
}

# TRL 1.16's loss_type values and the covey settings that reproduce each (tests/algos/test_trl_parity.py
# checks them on identical inputs; docs/algorithms.md, "TRL's loss types").
TRL_LOSS_TYPES = {
    "grpo": "algo.loss_agg=seq_mean_token_mean", "bnpo": "algo.loss_agg=token_mean",
    "dr_grpo": "algo.loss_agg=constant", "dapo": "algo.loss_agg=token_mean",
    "cispo": "algo.policy_loss=cispo algo.loss_agg=token_mean algo.clip_eps_low=1 "
             "algo.clip_eps_high=<TRL's epsilon_high - 1>",
    "sapo": "algo.policy_loss=sapo", "luspo": "algo.policy_loss=luspo",
    "vespo": "algo.policy_loss=vespo algo.loss_agg=token_mean",
}

# Names users of verl, OpenRLHF and vLLM type, and covey's keys for them.
OTHER_NAMES = {
    "actor_learning_rate": "optim.lr", "critic_learning_rate": "optim.critic_lr",
    "kl_coef": "algo.beta", "init_kl_coef": "algo.beta", "kl_beta": "algo.beta", "kl_loss_coef": "algo.beta",
    "kl_target": "algo.adaptive_kl.target", "use_kl_loss": "algo.kl_in=loss", "kl_loss_type": "algo.kl_estimator",
    "n_samples_per_prompt": "rollout.group_size", "rollout_n": "rollout.group_size", "n": "rollout.group_size",
    "response_length": "rollout.max_new_tokens", "generate_max_len": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens", "max_tokens": "rollout.max_new_tokens",
    "train_batch_size": "rollout.prompts_per_step", "rollout_batch_size": "rollout.prompts_per_step",
    "micro_train_batch_size": "algo.micro_batch_size", "ppo_micro_batch_size": "algo.micro_batch_size",
    "mini_batch_size": "algo.minibatches (optimizer steps per rollout pass)",
    "ppo_epochs": "algo.epochs", "max_epochs": "algo.epochs",
    "cliprange": "algo.clip_eps_low and algo.clip_eps_high", "clip_ratio": "algo.clip_eps_low and algo.clip_eps_high",
    "eps_clip": "algo.clip_eps_low and algo.clip_eps_high", "clip_ratio_high": "algo.clip_eps_high",
    "loss_agg_mode": "algo.loss_agg", "cliprange_value": "algo.gae.value_clip", "vf_coef": "algo.gae.value_coef",
    "entropy_coeff": "algo.entropy_coef", "adv_estimator": "algo.estimator", "advantage_estimator": "algo.estimator",
    "pretrain": "model.path", "ppo_kl_coef": "algo.kl_cov.coef",
}

# A name here is never read as a leaf of some other section (`learning_rate` would otherwise land on
# rm.learning_rate), with or without a section before it (`optim.learning_rate`).
PEER_NAMES = {**OTHER_NAMES, **TRL_NAMES}

GUESS_CUTOFF = 0.75
"""How close (difflib's ratio) a misspelt key must be to a key of its own section to be suggested."""

GENERIC_LEAVES = ("name", "path", "data", "output")
"""Leaf names too general to suggest from another section ('model.name' is not task.name)."""


def resolve_key(key: str, value=None) -> str:
    """'algo.beta' -> 'algo.beta'; a key without its section, or a bare unique leaf name ('steps',
    'sapo.temperature_pos'), also works, except the names other trainers use (PEER_NAMES), which fail
    with covey's key for them, bare or under a section ('algo.kl_coef'); TRL's loss_type with a `value`
    it has fails with that value's setting. A group with an `enabled` switch stands for it
    ('algo.dynamic_sampling' -> 'algo.dynamic_sampling.enabled'); a flat key that moved into a group fails
    naming its new place."""
    keys = leaf_keys()
    if key in keys:
        return key
    groups = group_keys()
    group = next((g for g in groups if key in (g, g.split(".", 1)[1])), None)
    if group is not None:
        if f"{group}.enabled" in keys:
            return f"{group}.enabled"
        own = [k for k in keys if k.startswith(group + ".")]
        raise ConfigError(f"config key '{key}' is a group of options: set {', '.join(own)}")
    if retired_key(key):
        raise ConfigError(retired_line(retired_key(key)))
    if moved_key(key):
        raise ConfigError(moved_line(moved_key(key)))
    section, _, name = key.rpartition(".")
    if name == "loss_type" and str(value).strip().lower() in TRL_LOSS_TYPES:
        setting = TRL_LOSS_TYPES[str(value).strip().lower()]
        raise ConfigError(f"unknown config key '{key}': TRL's loss_type={value} is {setting} here")
    if name in TRL_NAMES:
        raise ConfigError(f"unknown config key '{key}': TRL's {name} is {TRL_NAMES[name]} here")
    if name in OTHER_NAMES:
        raise ConfigError(f"unknown config key '{key}' (another trainer's name): covey's is {OTHER_NAMES[name]}")
    if section not in {k.split(".")[0] for k in keys}:
        matches = [k for k in keys if k.endswith("." + key)]
        top = [k for k in matches if k.count(".") == 1]  # 'beta': algo.beta before algo.dpo.beta
        matches = top if len(top) == 1 else matches
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ConfigError(f"ambiguous config key '{key}': use one of {', '.join(matches)}")
    close = guess_key(section, name, keys)
    raise ConfigError(f"unknown config key '{key}'" + (f" (did you mean '{close}'?)" if close else ""))


def guess_key(section: str, name: str, keys: list[str]) -> str | None:
    """The key a mistyped 'section.name' most likely means: a close name in its own section or group (a
    close section's, for a misspelt section), else the one key of another section with that very name (a
    name too general, such as 'name', excepted); a bare name, a close leaf name. None rather than a guess
    in an unrelated section."""
    leaves = {}
    for k in keys:
        leaves.setdefault(k.rpartition(".")[2], []).append(k)
    parents = sorted({k.rpartition(".")[0] for k in keys})
    if section and section not in parents:
        close = difflib.get_close_matches(section, parents, n=1, cutoff=GUESS_CUTOFF)
        section = close[0] if close else ""
    if section:
        own = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(name, own, n=1, cutoff=GUESS_CUTOFF)
        if close:
            return f"{section}.{close[0]}"
    if len(leaves.get(name, ())) == 1 and name not in GENERIC_LEAVES:
        return leaves[name][0]
    if section:
        return None
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=GUESS_CUTOFF)
    return close[0] if close else None  # a bare name gets a bare name ('stepz' -> 'steps')


COMMA_LISTS = ("reward.functions", "model.lora_targets", "rm.corruption_kinds", "optim.betas")
"""String keys that hold a comma-separated list: a YAML list is read as that list."""


def convert(key: str, raw, typ: str):
    """Convert a YAML or command-line value to the field's declared type (`float | None`: null, or a float)."""
    if typ.endswith(" | None"):
        return None if raw is None or str(raw).strip().lower() in ("", "null", "none") else convert(key, raw, typ[:-7])
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
        if typ == "dict":  # a free-form mapping (MAPPING_KEYS): a YAML mapping, or its flow text '{a: 1}'
            value = yaml.safe_load(raw) if isinstance(raw, str) else raw
            if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise ValueError
            return dict(value or {})
        if isinstance(raw, (list, tuple)) and key in COMMA_LISTS:  # a YAML list: the comma form
            return ",".join(str(item).strip() for item in raw)
        if isinstance(raw, (list, tuple, dict)):
            raise ValueError
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


def owner(cfg: Config, key: str):
    """The section or group object that holds full key `key`, and the field's name."""
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    return obj, name


def field_type(cfg: Config, key: str) -> str:
    obj, name = owner(cfg, key)
    return str({f.name: f.type for f in dataclasses.fields(obj)}[name])


def set_value(cfg: Config, key: str, raw) -> None:
    entry = mapping_entry(key)
    if entry:  # task.reasoning_gym.min_terms=2: one entry of a mapping key
        obj, name = owner(cfg, entry[0])
        getattr(obj, name)[entry[1]] = raw
        return
    full = resolve_key(key, raw)
    obj, name = owner(cfg, full)
    setattr(obj, name, convert(full, raw, field_type(cfg, full)))


def parse_override(cfg: Config, key: str, text: str):
    """A command-line value: the text itself for a string field (a template such as
    'From {start}: {steps}' is not YAML), read as YAML otherwise ('1e-5', 'true', '0.2')."""
    entry = mapping_entry(key)  # an entry of a mapping key is read as YAML, whatever its type
    full = key if entry else resolve_key(key, text)
    if not entry and field_type(cfg, full) == "str":
        return text
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"config key '{full}': cannot read {text!r}") from None


def flatten(data: dict, prefix: str = "") -> dict:
    """{'algo': {'beta': 0.1}} -> {'algo.beta': 0.1}."""
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in MAPPING_KEYS:  # a mapping key's value stays whole
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
