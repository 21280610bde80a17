"""reasoning-gym's procedural datasets by name: `task.name=reasoning_gym:<dataset>`.

reasoning-gym (Stojanovski et al. 2025, arXiv:2505.24760; pip install 'covey[reasoning-gym]') has about a
hundred generators (chain_sum, basic_arithmetic, leg_counting, spell_backward, ...), each with its own
config dataclass of difficulty options and its own verifier, `score_answer(answer, entry) -> [0, 1]`.

Options: `task.reasoning_gym` is the generator's options, a mapping (`task.reasoning_gym.min_terms=2`), checked
against the fields of its config dataclass before anything is drawn; `seed` and `size` are covey's
(train.seed, task.train_size, task.eval_size). A list given for an option whose default is a tuple is
passed as a tuple.

Split: as covey's own generators, the held-out problems are drawn first from their own stream
(`{train.seed}-eval`), so they do not change with task.train_size, then the training problems from a
second stream (`{train.seed}-train`), skipping every held-out question. A stream's round k is the
generator seeded with `random.Random(f"{stream}-{k}").getrandbits(32)`; a question met twice is skipped and
the missing ones are read from the next round, so prompts are distinct within a side and the sides are
disjoint (a small space takes a few rounds; one with fewer questions than asked is one line).

Score: the reward and the held-out metric (eval.metric=reasoning_gym, which auto picks for these tasks)
are the dataset's `score_answer` on the answer covey reads from the completion (`read_answer`); held-out
accuracy counts the answers scored 1. Each row keeps what the scorer needs in its `reasoning_gym`
column: {"dataset", "options", "entry"} (the entry as the generator made it); a reward function gets
it under that name. An answer the dataset's scorer cannot read (it raises) scores 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import random

from covey.config import ConfigError
from covey.config.schema import REASONING_GYM
from covey.tasks.answers import extract_answer, marked_text, normalize_number
from covey.tasks.base import Example

COLUMN = "reasoning_gym"
"""The row column that holds the dataset, its options and the generator's entry (what score_answer reads)."""
VERIFIER = "reasoning_gym"
"""The verifier (eval.metric) of these tasks: the dataset's own score_answer (covey/tasks/verifiers.py)."""
EXTRA = "pip install 'covey[reasoning-gym]'"
OWN_KEYS = {"seed": "train.seed draws the split", "size": "task.train_size and task.eval_size set the sizes"}
"""Fields of every generator's config that covey sets itself."""
MAX_ROUNDS = 8
"""Reseeded rounds a side draws at most to fill its distinct questions."""


def load_package():
    """The reasoning_gym module, or one line naming the extra."""
    try:
        import reasoning_gym  # noqa: PLC0415 - optional, heavy: loaded only for these tasks
    except ImportError:
        raise ConfigError(f"task.name=reasoning_gym:<dataset> needs the optional package reasoning-gym: "
                          f"{EXTRA}") from None
    return reasoning_gym


def dataset_name(task_name: str) -> str:
    """'reasoning_gym:chain_sum' -> 'chain_sum'."""
    return task_name[len(REASONING_GYM):] if task_name.startswith(REASONING_GYM) else task_name


def config_class(name: str):
    """The config dataclass of dataset `name`; one line with the closest names for an unknown one."""
    known = load_package().factory.DATASETS
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"task.name={REASONING_GYM}{name}: reasoning-gym has no dataset {name!r}{hint}; it has "
                          f"{len(known)}: {', '.join(sorted(known)[:8])}, ... (reasoning_gym.factory.DATASETS)")
    return known[name][1]


def check_options(name: str, options: dict) -> dict:
    """`options` (task.reasoning_gym) checked against the fields of dataset `name`'s config: an unknown key
    or one covey sets is one line naming the key and the dataset; a list for a tuple field becomes a tuple."""
    fields = {f.name: f for f in dataclasses.fields(config_class(name))}
    out = {}
    for key, value in options.items():
        if key in OWN_KEYS:
            raise ConfigError(f"task.reasoning_gym.{key}: covey sets the {key} of {REASONING_GYM}{name} itself "
                              f"({OWN_KEYS[key]})")
        if key not in fields:
            own = sorted(set(fields) - set(OWN_KEYS))
            close = difflib.get_close_matches(key, own, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"task.reasoning_gym.{key}: reasoning-gym's {name} has no option {key!r}{hint}; "
                              f"its options: {', '.join(own)}")
        out[key] = tuple(value) if isinstance(value, list) and isinstance(field_default(fields[key]), tuple) else value
    return out


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def build(name: str, options: dict, seed: int, size: int):
    """The generator of dataset `name` with `options` (checked), seeded; its own checks of the options
    (its config's validate) fail in one line naming the dataset."""
    options = check_options(name, options)
    try:
        return load_package().create_dataset(name, seed=seed, size=size, **options)
    except (AssertionError, ValueError, TypeError) as err:
        raise ConfigError(f"task.reasoning_gym: reasoning-gym's {name} refuses the options {options}: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def as_example(name: str, options: dict, entry: dict) -> Example:
    """One generated entry as an Example: its question, its answer (None where the dataset has no single
    answer and its scorer checks the reply itself), and the row column the scorer reads."""
    answer = entry.get("answer")
    return Example(prompt=str(entry["question"]), answer=None if answer is None else str(answer),
                   meta={COLUMN: {"dataset": name, "options": options, "entry": entry}})


def draw(name: str, options: dict, n: int, stream: str, seen: set[str]) -> list[Example]:
    """`n` examples whose questions are distinct and not in `seen` (updated in place), drawn from `stream`:
    round k reads, while questions are missing, the first (missing x 2^k) entries of the generator seeded
    from f'{stream}-{k}' (without repeats round 0 is all it takes)."""
    out: list[Example] = []
    for k in range(MAX_ROUNDS):
        if len(out) >= n:
            break
        dataset = build(name, options, random.Random(f"{stream}-{k}").getrandbits(32), (n - len(out)) * 2**k)
        for i in range(len(dataset)):
            if len(out) >= n:
                break
            entry = dataset[i]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(as_example(name, options, entry))
    if len(out) < n:
        raise ConfigError(f"task.name={REASONING_GYM}{name}: drew {len(out)} distinct questions of the {n} asked in "
                          f"{MAX_ROUNDS} rounds: lower task.train_size or task.eval_size, or widen its options "
                          "(task.reasoning_gym)")
    return out


def reasoning_gym_splits(task_name: str, options: dict, n_train: int, n_eval: int,
                         seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out) of dataset `task_name` ('reasoning_gym:chain_sum' or 'chain_sum') with the generator's
    `options`: held-out first from the stream f'{seed}-eval', then training from f'{seed}-train' skipping every
    held-out question (module docstring)."""
    name = dataset_name(task_name)
    options = check_options(name, dict(options))
    seen: set[str] = set()
    held = draw(name, options, n_eval, f"{seed}-eval", seen)
    return draw(name, options, n_train, f"{seed}-train", seen), held


def check_keys(task_name: str, options: dict, metric: str) -> None:
    """task.reasoning_gym and eval.metric=reasoning_gym mean something only for a reasoning-gym task."""
    if task_name.startswith(REASONING_GYM):
        return
    for key, used in (("task.reasoning_gym", bool(options)), ("eval.metric=reasoning_gym", metric == VERIFIER)):
        if used:
            raise ConfigError(f"{key} is for a reasoning-gym dataset (task.name={REASONING_GYM}<dataset>), "
                              f"not task.name={task_name}")


def settled_metric(task_name: str, options: dict, metric: str) -> str:
    """eval.metric as a run settles it: auto is `reasoning_gym` (the dataset's own scorer) for a reasoning-gym
    task; task.reasoning_gym and eval.metric=reasoning_gym are refused for any other task (`check_keys`)."""
    check_keys(task_name, options, metric)
    return VERIFIER if metric == "auto" and task_name.startswith(REASONING_GYM) else metric


@functools.lru_cache(maxsize=32)
def scorer(name: str, options_json: str):
    """The generator that scores dataset `name`'s answers (one per dataset and options, made once)."""
    return build(name, json.loads(options_json), seed=0, size=1)


def read_answer(completion: str, reference: str | None) -> str | None:
    """The answer covey hands the dataset's scorer: the text of the last <answer>...</answer> (the tags
    reasoning-gym's prompts ask for), else of covey's explicit markers (\\boxed{}, '####', 'Answer:', 'the
    answer is'), else the whole completion, trimmed. For a numeric reference the number in that text is
    read as covey's math tasks read it (a marked number, else the last one; None when hedged), written as
    the reference writes it when it is the same number ('1,234.0' for '1234')."""
    tags = load_package().utils.extract_answer(completion or "")
    if reference is None or normalize_number(reference) is None:
        text = tags if tags is not None else marked_text(completion or "")
        text = (text if text is not None else completion or "").strip()
        return text or None
    number = extract_answer(tags if tags is not None else completion)
    return reference if number is not None and number == normalize_number(reference) else number


def score_completion(completion: str, row: dict) -> float:
    """The dataset's score_answer of the answer read from `completion` (`read_answer`), for one row's
    `reasoning_gym` column; 0 where the scorer raises on the answer."""
    dataset = scorer(row["dataset"], json.dumps(row["options"], sort_keys=True, default=list))
    entry, reference = row["entry"], row["entry"].get("answer")
    answer = read_answer(completion, None if reference is None else str(reference))
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - an answer the dataset's own parser cannot read is a wrong answer
        return 0.0
