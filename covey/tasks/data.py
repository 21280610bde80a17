"""From the task config to chat-formatted prompts, and a resumable prompt stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covey.config import TaskConfig
from covey.tasks.arithmetic import arithmetic_splits
from covey.tasks.base import Example, build_messages
from covey.tasks.files import load_examples
from covey.tasks.multistep import multistep_splits
from covey.tasks.wordproblems import wordproblem_splits


@dataclass
class TaskData:
    train: list[Example]
    eval: list[Example]
    skipped_rows: int = 0


def load_task_data(task: TaskConfig, seed: int) -> TaskData:
    """Train and held-out examples for the configured task (errors before any model loads); `seed`
    (train.seed) draws the synthetic tasks and the held-out rows of a file without `task.eval_path`."""
    t = task
    if t.name == "arithmetic":
        train, held = arithmetic_splits(t.train_size, t.eval_size, seed,
                                        kind=t.kind, digits_a=t.digits_a, digits_b=t.digits_b,
                                        template=t.template)
        return TaskData(train, held)
    if t.name == "multistep":
        train, held = multistep_splits(t.train_size, t.eval_size, seed, min_ops=t.min_ops,
                                       max_ops=t.max_ops, ops=tuple(dict.fromkeys(t.ops)),
                                       operand_max=t.operand_max, start_digits=t.start_digits,
                                       max_value=t.max_value, template=t.multistep_template)
        return TaskData(train, held)
    if t.name == "wordproblems":
        return TaskData(*wordproblem_splits(t.train_size, t.eval_size, seed, steps=t.word_steps))
    kwargs = dict(prompt_key=t.prompt_key, answer_key=t.answer_key, on_error=t.on_bad_row)
    if t.name == "hf":
        kwargs["split"] = t.split or None
    examples, skipped = load_examples(t.path, **kwargs)
    if t.eval_path:
        held, skipped_eval = load_examples(t.eval_path, **kwargs)
        return TaskData(examples, held, skipped + skipped_eval)
    if len(examples) < 2:
        raise ValueError(f"{t.path}: need at least 2 rows to hold some out (or set task.eval_path)")
    n_eval = min(t.eval_size, len(examples) // 2)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = [examples[i] for i in order[:n_eval]]
    train = [examples[i] for i in order[n_eval:]]
    return TaskData(train, held, skipped)


def format_prompts(tokenizer, examples: list[Example], system_prompt: str = "") -> list[str]:
    """Apply the tokenizer's chat template (generation prompt appended). A model without one (a
    base model) gets the plain question, after the system prompt if any, as TRL does for plain prompts."""
    if not getattr(tokenizer, "chat_template", None):
        return [f"{system_prompt}\n\n{ex.prompt}" if system_prompt else ex.prompt for ex in examples]
    return [tokenizer.apply_chat_template(build_messages(ex, system_prompt or None),
                                          tokenize=False, add_generation_prompt=True)
            for ex in examples]


def check_prompt_lengths(tokenizer, prompts: list[str], limit: int, where: str) -> None:
    """Refuse prompts that leave no room for the response in the model's context."""
    for i, text in enumerate(prompts):
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > limit:
            raise ValueError(f"{where} example {i}: prompt is {n} tokens; the model context leaves room "
                             f"for {limit} (context minus max_new_tokens)")


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
