"""Seeded synthetic arithmetic: the default task, checkable exactly, no download.

Difficulty is explicit (operation kind, digit counts) so it can be tuned until
the base model's greedy held-out accuracy sits in 10-50%, where GRPO groups
carry signal (all-right or all-wrong groups have zero advantage).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

from covey.tasks.base import Example

KINDS = ("add", "sub", "mul", "mixed")
_OPS = {"add": "+", "sub": "-", "mul": "*"}
DEFAULT_TEMPLATE = "What is {a} {op} {b}?"


def _digit_range(digits: int) -> tuple[int, int]:
    """Inclusive range of numbers with exactly `digits` digits (1-digit: 1..9, no zero)."""
    if digits < 1:
        raise ValueError(f"digit counts must be >= 1, got {digits}")
    return 10 ** (digits - 1), 10**digits - 1


def _space_size(kind: str, digits_a: int, digits_b: int) -> int:
    """How many distinct questions exist, so an impossible `n` fails fast."""
    lo_a, hi_a = _digit_range(digits_a)
    lo_b, hi_b = _digit_range(digits_b)
    n_ops = 3 if kind == "mixed" else 1
    return (hi_a - lo_a + 1) * (hi_b - lo_b + 1) * n_ops


def _one_problem(rng: random.Random, kind: str, digits_a: int, digits_b: int,
                 allow_negative: bool) -> tuple[int, str, int]:
    """Draw (a, op, b); for `sub` without negatives the larger operand goes first."""
    op_kind = rng.choice(("add", "sub", "mul")) if kind == "mixed" else kind
    a = rng.randint(*_digit_range(digits_a))
    b = rng.randint(*_digit_range(digits_b))
    if op_kind == "sub" and not allow_negative and a < b:
        a, b = b, a
    return a, _OPS[op_kind], b


def _evaluate(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown arithmetic kind {kind!r}; choose one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Difficulty:
    """What an arithmetic problem looks like: the keyword arguments of `generate_arithmetic`."""
    kind: str = "mul"
    digits_a: int = 2
    digits_b: int = 1
    allow_negative: bool = False
    template: str = DEFAULT_TEMPLATE


def _generate(rng: random.Random, n: int, spec: Difficulty, exclude: set[str]) -> list[Example]:
    """Draw `n` distinct questions not in `exclude` (which is updated in place)."""
    kind, digits_a, digits_b, allow_negative, template = (spec.kind, spec.digits_a, spec.digits_b,
                                                          spec.allow_negative, spec.template)
    _check_kind(kind)
    available = _space_size(kind, digits_a, digits_b) - len(exclude)
    if n > available:
        raise ValueError(f"asked for {n} distinct {kind} problems ({digits_a}x{digits_b} digits) "
                         f"but only {max(available, 0)} exist; lower n or raise the digit counts")
    out: list[Example] = []
    misses = 0
    while len(out) < n:
        a, op, b = _one_problem(rng, kind, digits_a, digits_b, allow_negative)
        prompt = template.format(a=a, op=op, b=b)
        if prompt in exclude:
            misses += 1
            if misses > 10_000 + 100 * n:  # e.g. sub without negatives has fewer questions
                raise ValueError(f"could not draw {n} distinct {kind} problems "
                                 f"({digits_a}x{digits_b} digits); lower n or raise the digit counts")
            continue
        exclude.add(prompt)
        meta = {"a": a, "op": op, "b": b}
        out.append(Example(prompt=prompt, answer=str(_evaluate(a, op, b)), meta=meta))
    return out


def generate_arithmetic(n: int, seed: int, kind: str = "mul", digits_a: int = 2,
                        digits_b: int = 1, allow_negative: bool = False,
                        template: str = DEFAULT_TEMPLATE) -> list[Example]:
    """`n` distinct problems `a <op> b`, deterministic in `seed` (no global RNG).

    kind: "add" | "sub" | "mul" | "mixed" (each problem picks one of the three).
    digits_a / digits_b: exact digit counts of the two operands.
    allow_negative: for subtraction, allow b > a (negative answers).
    template: user-message text with `{a}`, `{op}`, `{b}` placeholders.
    """
    rng = random.Random(seed)
    return _generate(rng, n, Difficulty(kind, digits_a, digits_b, allow_negative, template), set())


def arithmetic_splits(n_train: int, n_eval: int, seed: int, **difficulty) -> tuple[list[Example], list[Example]]:
    """(train, eval) with no question in both.

    The eval set is drawn first from its own seeded stream, so it does not change
    when `n_train` changes and held-out numbers stay comparable across runs;
    train is drawn from a second stream, skipping every eval question.
    `difficulty` takes the keyword arguments of `generate_arithmetic`.
    """
    unknown = set(difficulty) - {f.name for f in fields(Difficulty)}
    if unknown:
        raise TypeError(f"unknown arithmetic option(s): {', '.join(sorted(unknown))}")
    spec, seen = Difficulty(**difficulty), set()
    eval_set = _generate(random.Random(f"{seed}-eval"), n_eval, spec, seen)
    train = _generate(random.Random(f"{seed}-train"), n_train, spec, seen)
    return train, eval_set
