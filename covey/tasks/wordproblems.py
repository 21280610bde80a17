"""Seeded arithmetic word problems: short stories the model must turn into operations.

A problem is a templated story in the style of GSM8K (Cobbe et al. 2021, arXiv:2110.14168),
over small whole quantities: "Tom has 3 boxes with 12 apples in each box. He gives 7 apples
to Anna. How many apples does Tom have now?" (answer 29). Why word problems rather than
countdown: the answer is one number, so the reward and the evaluator of the default task
(`extract_answer` + `math_equal`) check it unchanged, and a policy that has learnt the
answer format on `task.name=arithmetic` gains here only by reading the story right and
doing the sums: which quantities combine, with which operation, in which order.

Difficulty: `steps` (task.word_steps) is the number of arithmetic operations a problem takes
(1-4). Each sentence after the first is one move on the running total: add (buys, finds, is
given), subtract (gives away, sells, loses), add equal groups ("buys 4 bags with 6 marbles in
each bag": a product then a sum, two operations), share equally (a division, always exact,
only as the question). The first sentence is a plain amount or equal groups (one product).
The default, one operation, is where SmolLM2-135M-Instruct answers about one held-out problem
in nine greedily (docs/tasks.md): it often picks the wrong operation for the story, so there
is room to gain and GRPO groups still see right answers; two or more operations leave
headroom for larger models.

Exactness: every number of the story is written in digits and appears in the stored
expression in the same order (`meta["expression"]`, e.g. "3*12 - 7"), so the answer can
be recomputed from the problem's own numbers. Every intermediate value is a positive whole
number; a problem whose answer equals one of its own numbers or an intermediate value is
redrawn, so copying a number from the story or stopping one step early never scores.

Held-out split: disjoint from training by the arithmetic itself, not only by the text: a seeded
hash of the expression (`held_out`) sends each sum to one side only, so no held-out sum
reappears in training under another name or story. Within a side prompts are distinct; a
kind with few sums (one product) repeats a sum under different stories.
"""

from __future__ import annotations

import random
import zlib

from covey.config import WORD_MAX_STEPS
from covey.tasks.answers import extract_answer, math_equal
from covey.tasks.base import Example

_NAMES = (("Tom", "he", "him"), ("Anna", "she", "her"), ("Sam", "he", "him"), ("Lily", "she", "her"),
          ("Ben", "he", "him"), ("Mia", "she", "her"), ("Leo", "he", "him"), ("Emma", "she", "her"),
          ("Max", "he", "him"), ("Zoe", "she", "her"), ("Jack", "he", "him"), ("Nora", "she", "her"))
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "cards", "shells", "stamps",
          "balloons", "crayons", "buttons", "beads")
_CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"),
               ("basket", "baskets"), ("tin", "tins"))
_ADD = ("{P} buys {y} more {items}.", "{P} finds {y} more {items}.",
        "{F} gives {o} {y} more {items}.")
_SUB = ("{P} gives {y} {items} to {F}.", "{P} sells {y} {items}.", "{P} loses {y} {items}.")
_PLAIN = (11, 60)     # a plain starting amount
_CHANGE = (2, 19)     # an amount added or taken away
_GROUPS = (2, 9)      # how many equal groups (and friends to share among)
_PER_GROUP = (3, 19)  # how many in each group
_MAX_VALUE = 999


class _Story:
    """The characters and objects of one problem, and the text and expression built so far."""

    def __init__(self, rng: random.Random):
        (self.name, self.he, self.him), friend = rng.sample(_NAMES, 2)
        self.friend = friend[0]
        self.items = rng.choice(_ITEMS)
        self.box, self.boxes = rng.choice(_CONTAINERS)
        self.sentences: list[str] = []
        self.expression = ""
        self.numbers: list[int] = []
        self.values: list[int] = []

    def say(self, pattern: str, **numbers: int) -> None:
        text = pattern.format(P=self.he.capitalize(), F=self.friend, o=self.him, items=self.items,
                              box=self.box, boxes=self.boxes, N=self.name, **numbers)
        self.sentences.append(text)


def _start(rng: random.Random, story: _Story, groups: bool) -> None:
    if groups:
        k, m = rng.randint(*_GROUPS), rng.randint(*_PER_GROUP)
        story.say("{N} has {k} {boxes} with {m} {items} in each {box}.", k=k, m=m)
        story.expression, story.numbers, story.values = f"{k}*{m}", [k, m], [k * m]
    else:
        a = rng.randint(*_PLAIN)
        story.say("{N} has {a} {items}.", a=a)
        story.expression, story.numbers, story.values = str(a), [a], []


def _value(story: _Story) -> int:
    return story.values[-1] if story.values else story.numbers[0]


def _move(rng: random.Random, story: _Story, kind: str) -> None:
    """Apply one move (add | sub | groups | share) to the story; the caller checks it is possible."""
    value = _value(story)
    if kind == "add":
        y = rng.randint(*_CHANGE)
        story.say(rng.choice(_ADD), y=y)
        story.expression += f" + {y}"
        story.numbers.append(y)
        story.values.append(value + y)
    elif kind == "sub":
        y = rng.randint(_CHANGE[0], min(_CHANGE[1], value - 1))
        story.say(rng.choice(_SUB), y=y)
        story.expression += f" - {y}"
        story.numbers.append(y)
        story.values.append(value - y)
    elif kind == "groups":
        k, m = rng.randint(*_GROUPS), rng.randint(*_PER_GROUP)
        story.say("{P} buys {k} {boxes} with {m} {items} in each {box}.", k=k, m=m)
        story.expression += f" + {k}*{m}"
        story.numbers += [k, m]
        story.values += [k * m, value + k * m]
    else:  # share: the question itself
        k = rng.choice([d for d in range(_GROUPS[0], _GROUPS[1] + 1) if value % d == 0 and value // d > 1])
        story.say("{P} shares the {items} equally among {k} friends. "
                  "How many {items} does each friend get?", k=k)
        story.expression = f"({story.expression}) / {k}"
        story.numbers.append(k)
        story.values.append(value // k)


def _possible_moves(value: int, left: int) -> list[str]:
    kinds = ["add"]
    if value > _CHANGE[0]:
        kinds.append("sub")
    if left >= 2:
        kinds.append("groups")
    if left == 1 and any(value % d == 0 and value // d > 1 for d in range(_GROUPS[0], _GROUPS[1] + 1)):
        kinds.append("share")
    return kinds


def _draw_story(rng: random.Random, steps: int) -> _Story:
    """One story of exactly `steps` operations (its values may still break the bounds)."""
    story = _Story(rng)
    _start(rng, story, groups=rng.random() < 0.25)
    left = steps - (1 if story.values else 0)
    while left > 0:
        kind = rng.choice(_possible_moves(_value(story), left))
        _move(rng, story, kind)
        left -= 2 if kind == "groups" else 1
    if not story.sentences[-1].endswith("?"):
        story.sentences.append(f"How many {story.items} does {story.name} have now?")
    return story


def _acceptable(story: _Story) -> bool:
    """Bounded, and the answer is neither a number of the story nor an earlier value."""
    answer = story.values[-1]
    return (all(0 < v <= _MAX_VALUE for v in story.values)
            and answer not in story.numbers and answer not in story.values[:-1])


def _make_example(story: _Story, steps: int) -> Example:
    meta = {"expression": story.expression, "numbers": story.numbers, "values": story.values,
            "steps": steps}
    return Example(prompt=" ".join(story.sentences), answer=str(story.values[-1]), meta=meta)


def held_out(expression: str, seed: int) -> bool:
    """Whether a sum belongs to the held-out side: a seeded hash of the expression (a quarter of them)."""
    return zlib.crc32(f"{seed}:{expression}".encode()) % 4 == 0


def _generate(rng: random.Random, n: int, steps: int, keep) -> list[Example]:
    """`n` problems with distinct prompts whose expressions pass `keep`."""
    if not 1 <= steps <= WORD_MAX_STEPS:
        raise ValueError(f"word problems take 1 to {WORD_MAX_STEPS} steps, got {steps}")
    out: list[Example] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        story = _draw_story(rng, steps)
        prompt = " ".join(story.sentences)
        if not _acceptable(story) or not keep(story.expression) or prompt in seen:
            misses += 1
            if misses > 10_000 + 100 * n:
                raise ValueError(f"could not draw {n} distinct word problems of {steps} step(s); "
                                 "lower task.train_size / task.eval_size or raise task.word_steps")
            continue
        seen.add(prompt)
        out.append(_make_example(story, steps))
    return out


def generate_wordproblems(n: int, seed: int, steps: int = 1) -> list[Example]:
    """`n` distinct problems of `steps` operations, deterministic in `seed`."""
    return _generate(random.Random(seed), n, steps, lambda expression: True)


def wordproblem_splits(n_train: int, n_eval: int, seed: int, steps: int = 1) -> tuple[list[Example], list[Example]]:
    """(train, eval) with no sum in both: each side keeps the expressions `held_out` gives it and
    draws from its own seeded stream, so eval does not depend on n_train and both sides follow
    the same distribution of kinds of problem."""
    eval_set = _generate(random.Random(f"{seed}-words-eval"), n_eval, steps,
                         lambda expression: held_out(expression, seed))
    train = _generate(random.Random(f"{seed}-words-train"), n_train, steps,
                      lambda expression: not held_out(expression, seed))
    return train, eval_set


def is_correct(completion: str, example: Example) -> bool:
    """The verifier: the completion's final answer (`extract_answer`) equals the stored answer.

    The same rule as the correctness reward and the evaluator; named here so the task's tests
    pin down what scores: a hedged "29 or 30", an intermediate value or the right number
    followed by a different final answer all score 0.
    """
    return math_equal(extract_answer(completion), example.answer)
