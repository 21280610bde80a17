"""From the task config to chat-formatted prompts, and a resumable prompt stream; the settings a
run takes from its data (`load_run_data`)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from covey.config import Config, ConfigError, TaskConfig
from covey.config.checks import FILE_TASKS
from covey.config.schema import REASONING_GYM
from covey.tasks.arithmetic import arithmetic_splits
from covey.tasks.base import Example, build_messages
from covey.tasks.files import ANSWER_COLUMNS, key_hint, load_examples
from covey.tasks.multistep import multistep_splits
from covey.tasks.reasoning_gym import check_keys, reasoning_gym_splits, settled_metric
from covey.tasks.verifiers import ROW_VERIFIERS, VERIFIERS, resolve_verifier
from covey.tasks.wordproblems import wordproblem_splits

HELD_OUT_WARN_SHARE = 0.2
"""Held-out rows drawn out of task.path above this share of its rows are announced with a warning."""


@dataclass
class TaskData:
    train: list[Example]
    eval: list[Example]
    skipped_rows: int = 0
    overlap: int = 0  # held-out examples that are also training examples (same prompt and answer)
    notes: list[str] = field(default_factory=list)  # said at start, one line each ("warning: ..." ones too)


def load_task_data(task: TaskConfig, seed: int) -> TaskData:
    """Train and held-out examples for the configured task (errors before any model loads); `seed`
    (train.seed) draws the synthetic tasks and the held-out rows of a file without held-out data."""
    t = task
    check_keys(t.name, t.reasoning_gym, "")
    if t.name == "arithmetic":
        data = TaskData(*arithmetic_splits(t.train_size, t.eval_size, seed, kind=t.kind, digits_a=t.digits_a,
                                           digits_b=t.digits_b, template=t.template))
    elif t.name == "multistep":
        data = TaskData(*multistep_splits(t.train_size, t.eval_size, seed, min_ops=t.min_ops, max_ops=t.max_ops,
                                          ops=tuple(dict.fromkeys(t.ops)), operand_max=t.operand_max,
                                          start_digits=t.start_digits, max_value=t.max_value,
                                          template=t.multistep_template))
    elif t.name == "wordproblems":
        data = TaskData(*wordproblem_splits(t.train_size, t.eval_size, seed, steps=t.word_steps))
    elif t.name.startswith(REASONING_GYM):
        data = TaskData(*reasoning_gym_splits(t.name, t.reasoning_gym, t.train_size, t.eval_size, seed))
    else:
        data = load_file_task(t, seed)
    if not data.eval:
        data.notes.append("no held-out evaluation (task.eval_size=0): every example trains, and no accuracy "
                          "is measured before or after training")
    return data


def load_file_task(t: TaskConfig, seed: int) -> TaskData:
    """task.path's rows; held out: task.eval_path, else task.eval_split of task.path, else eval_size
    rows drawn with `seed` (none with eval_size=0; a warning above HELD_OUT_WARN_SHARE of the rows).
    Held-out rows that are also training rows are counted (`overlap`)."""
    kwargs = dict(prompt_key=t.prompt_key, answer_key=t.answer_key, on_error=t.on_bad_row)
    if t.eval_split and not Path(t.eval_path or t.path).is_dir():
        raise ValueError(f"task.eval_split={t.eval_split} needs a saved HF dataset folder "
                         f"({t.eval_path or t.path} is not a folder)")
    examples, skipped = load_examples(t.path, split=t.split or None, **kwargs)
    if t.eval_path or t.eval_split:
        held, skipped_eval = load_examples(t.eval_path or t.path, split=t.eval_split or None, **kwargs)
        return TaskData(examples, held, skipped + skipped_eval, overlap=count_overlap(examples, held))
    if t.eval_size and len(examples) < 2:
        raise ValueError(f"{t.path}: need at least 2 rows to hold some out (or set task.eval_path, "
                         "or task.eval_size=0 to train on every row without a held-out evaluation)")
    n_eval = min(t.eval_size, len(examples) // 2)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = [examples[i] for i in order[:n_eval]]
    train = [examples[i] for i in order[n_eval:]]
    data = TaskData(train, held, skipped, overlap=count_overlap(train, held))
    if n_eval > HELD_OUT_WARN_SHARE * len(examples):
        data.notes.append(f"warning: task.eval_size={t.eval_size} holds out {n_eval} of the {len(examples)} rows "
                          f"of {t.path} ({n_eval / len(examples):.0%}), leaving {len(train)} to train on: set "
                          "task.eval_size (0 trains on every row, with no held-out evaluation) or task.eval_path")
    return data


def load_run_data(cfg: Config, extra_rewards: bool = False) -> tuple[Config, TaskData]:
    """The run's data (`load_task_data`) and the config as the run records it (`settle_config`);
    `extra_rewards`: reward functions were given besides the config's (the Python API's reward_funcs)."""
    data = load_task_data(cfg.task, cfg.train.seed)
    return settle_config(cfg, data, extra_rewards), data


def settle_config(cfg: Config, data: TaskData, extra_rewards: bool = False) -> Config:
    """A copy of `cfg` with what the data decides written out, as a run stores it in config.yaml
    (compared on resume; read back by `covey eval RUN_DIR`, from any folder): the data files, reward
    model folders, the judge's model folder and template and reward-function files absolute; eval.metric=auto
    resolved to the verifier the answers call for (reasoning_gym, the dataset's own scorer, for
    task.name=reasoning_gym:<dataset>); for data without reference answers (prompt-only) eval.metric=reward
    and the correctness reward off (an error when no other reward is configured)."""
    cfg = copy.deepcopy(cfg)
    t, r = cfg.task, cfg.reward
    if t.name in FILE_TASKS:
        t.path, t.eval_path = (os.path.abspath(p) if p else p for p in (t.path, t.eval_path))
    r.model_path, r.prm_path = (os.path.abspath(p) if p and Path(p).exists() else p for p in (r.model_path, r.prm_path))
    r.judge.model, r.judge.template = (os.path.abspath(p) if p and Path(p).exists() else p
                                       for p in (r.judge.model, r.judge.template))
    r.functions = ",".join(absolute_reward_file(item) for item in r.functions.split(",")) if r.functions else ""
    ro = cfg.rollout  # tools and an environment given as file.py:name, found from any folder too
    ro.tools = ",".join(absolute_reward_file(item) for item in ro.tools.split(",")) if ro.tools else ""
    ro.environment = absolute_reward_file(ro.environment) if ro.environment else ""
    examples = [*data.train, *data.eval]
    metric = cfg.eval.metric = settled_metric(t.name, t.reasoning_gym, cfg.eval.metric)
    missing = 0 if metric in ROW_VERIFIERS else sum(ex.answer is None for ex in examples)  # a row verifier reads rows
    if not missing:
        cfg.eval.metric = resolve_verifier(metric, [ex.answer for ex in examples]) if metric == "auto" else metric
        return cfg
    where = f"{t.path}" + (f" and {t.eval_path}" if t.eval_path else "")
    columns = {k for ex in examples for k in ex.meta}
    sources = [ex.source for ex in examples if ex.answer is None and ex.source]
    first = min(sources, key=source_order) if sources else None  # by line, whatever order the split left
    why = (f"{missing} of {len(examples)} rows have no reference answer a verifier reads (null, a list, ...)"
           + (f", the first at {first}" if first else "") if t.answer_key in columns
           else f"there is no {t.answer_key!r} column")
    hint = key_hint(columns, t.answer_key, "task.answer_key", ANSWER_COLUMNS)
    hint = f"{hint} if that column holds the answers" if hint else ""
    if missing < len(examples) and cfg.reward.correctness:
        raise ConfigError(f"{where}: {why}, which the correctness reward needs in every row: set "
                          f"reward.correctness=0 to train on your reward functions alone{hint}")
    if metric in VERIFIERS:
        raise ConfigError(f"eval.metric={metric} compares answers with the reference, but in {where} {why}: "
                          f"set eval.metric=reward to judge held-out answers by your reward functions{hint}")
    others = extra_rewards or any((r.functions, r.format, r.overlong_buffer, r.language, r.model_path, r.prm_path,
                                   r.remote_url, r.judge.model))
    if not others:
        raise ConfigError(f"{where}: {why}, so the correctness reward cannot score and no other reward is set: "
                          f"give reward functions (reward.functions=file.py:function){hint}")
    off = ", so the correctness reward is off and" if cfg.reward.correctness else ":"
    cfg.eval.metric, cfg.reward.correctness = "reward", 0.0
    data.notes.append(f"{where}: {why}{off} held-out answers are judged by the reward functions (eval.metric="
                      f"reward, passing at eval.reward_threshold={cfg.eval.reward_threshold:g}){hint}")
    return cfg


def source_order(source: str) -> tuple[str, int]:
    """'file:12' -> ('file', 12), for ordering rows by where they were read."""
    path, _, line = source.rpartition(":")
    return (path, int(line)) if line.isdigit() else (source, 0)


def absolute_reward_file(item: str) -> str:
    """'rewards.py:fn:0.5' -> '/abs/rewards.py:fn:0.5' when the file is there, and 'rewards:fn' -> the same when
    the module is a file of the current folder (so a run's config.yaml finds it from any folder: covey eval RUN_DIR);
    any other item trimmed (an installed or dotted module is found by its name)."""
    item = item.strip()
    module, sep, rest = item.partition(":")
    if sep and module.isidentifier() and Path(f"{module}.py").is_file():
        module = f"{module}.py"
    return os.path.abspath(module) + sep + rest if module.endswith(".py") and Path(module).is_file() else item


def count_overlap(train: list[Example], held: list[Example]) -> int:
    """Held-out examples whose prompt and answer are also a training example's."""
    seen = set(train)
    return sum(ex in seen for ex in held)


def format_prompts(tokenizer, examples: list[Example], system_prompt: str = "") -> list[str]:
    """Apply the tokenizer's chat template (generation prompt appended). A model without one (a
    base model) gets the plain question, after the system prompt if any, as TRL does for plain prompts."""
    if not getattr(tokenizer, "chat_template", None):
        if any(ex.messages is not None for ex in examples):
            raise ValueError("the task's prompts are chat messages but the model's tokenizer has no chat "
                             "template: give plain string prompts, or a model with a chat template")
        return [f"{system_prompt}\n\n{ex.prompt}" if system_prompt else ex.prompt for ex in examples]
    return [tokenizer.apply_chat_template(build_messages(ex, system_prompt or None),
                                          tokenize=False, add_generation_prompt=True)
            for ex in examples]


def check_prompt_lengths(tokenizer, prompts: list[str], limit: int, where: str,
                         examples: list[Example] | None = None) -> None:
    """Refuse prompts that leave no room for the response in the model's context; the error names the
    row's file and line where the examples were read from a file."""
    for i, text in enumerate(prompts):
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > limit:
            source = examples[i].source if examples is not None else None
            row = f"{source}: {where} prompt" if source else f"{where} example {i}: prompt"
            raise ValueError(f"{row} is {n} tokens; the model context leaves room for {limit} (context "
                             "minus max_new_tokens)")


class PromptStream:
    """Shuffled epochs over the training set; its position is part of a checkpoint."""

    def __init__(self, size: int, seed: int):
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
            take = min(count - len(out), self.size - self.position)
            out += self._order()[self.position:self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
