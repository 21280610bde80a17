"""Multi-step arithmetic for process supervision: every step is checkable exactly.

A problem is a start value and 2-4 operations ("Start with 12. Add 7, then
multiply by 3, then subtract 5."). The reference solution has one operation
per line ("12 + 7 = 19\\n19 * 3 = 57\\n57 - 5 = 52"), so step labels for a
process reward model are computed, not annotated (process supervision:
Lightman et al. 2023, arXiv:2305.20050; in GRPO, Shao et al. 2024, arXiv:2402.03300).
Values stay non-negative and below `max_value`.
"""

from __future__ import annotations

import random
import re

from covey.config import CORRUPTION_KINDS, MULTISTEP_OPS, parse_corruptions  # noqa: F401 (parse_corruptions re-exported)
from covey.tasks.answers import extract_answer, math_equal, normalize_number
from covey.tasks.base import Example

OPS = MULTISTEP_OPS
_WORDS = {"+": "add {y}", "-": "subtract {y}", "*": "multiply by {y}"}
DEFAULT_TEMPLATE = ("Start with {start}. {steps}. What is the result? Work it out with one "
                    "operation per line, like '2 + 3 = 5', then write 'Answer: <number>'.")
_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_EQUATION_RE = re.compile(rf"({_NUM})\s*([+\-*×xX·])\s*({_NUM})\s*=\s*({_NUM})")
_OP_ALIASES = {"×": "*", "x": "*", "X": "*", "·": "*"}


def _apply(value: int, op: str, y: int) -> int:
    return {"+": value + y, "-": value - y, "*": value * y}[op]


def _draw_ops(rng: random.Random, start: int, n_ops: int, ops: tuple[str, ...],
              operand_max: int, max_value: int) -> list[list]:
    """Operations that keep every intermediate value in [0, max_value]."""
    value, out = start, []
    for _ in range(n_ops):
        for _attempt in range(100):  # redraw the operand until some operation stays in bounds
            y = rng.randint(2, operand_max)
            allowed = [op for op in ops if 0 <= _apply(value, op, y) <= max_value]
            if allowed:
                break
        else:
            raise ValueError(f"no operation of {''.join(ops)!r} keeps {value} within 0..{max_value}; "
                             "raise max_value or allow more operations")
        op = rng.choice(allowed)
        out.append([op, y])
        value = _apply(value, op, y)
    return out


def reference_steps(start: int, ops: list) -> list[str]:
    """The solution lines 'a op b = c', one per operation."""
    lines, value = [], int(start)
    for op, y in ops:
        new = _apply(value, op, int(y))
        lines.append(f"{value} {op} {y} = {new}")
        value = new
    return lines


def _make_example(start: int, ops: list, template: str) -> Example:
    words = ", then ".join(_WORDS[op].format(y=y) for op, y in ops)
    prompt = template.format(start=start, steps=words[0].upper() + words[1:])
    steps = reference_steps(start, ops)
    answer = steps[-1].rsplit("=", 1)[1].strip()
    meta = {"start": start, "ops": ops, "solution": "\n".join(steps)}
    return Example(prompt=prompt, answer=answer, meta=meta)


def _generate(rng: random.Random, n: int, params: dict, exclude: set[str]) -> list[Example]:
    lo, hi = params["min_ops"], params["max_ops"]
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got {lo}, {hi}")
    if not set(params["ops"]) <= set(OPS):
        raise ValueError(f"ops must be drawn from {OPS}, got {params['ops']}")
    out, misses = [], 0
    while len(out) < n:
        start = rng.randint(10 ** (params["start_digits"] - 1), 10 ** params["start_digits"] - 1)
        ops = _draw_ops(rng, start, rng.randint(lo, hi), tuple(params["ops"]),
                        params["operand_max"], params["max_value"])
        ex = _make_example(start, ops, params["template"])
        if ex.prompt in exclude:
            misses += 1
            if misses > 10_000 + 100 * n:
                raise ValueError(f"could not draw {n} distinct multi-step problems; lower n")
            continue
        exclude.add(ex.prompt)
        out.append(ex)
    return out


_DEFAULTS = {"min_ops": 2, "max_ops": 4, "ops": OPS, "start_digits": 2, "operand_max": 9,
             "max_value": 999, "template": DEFAULT_TEMPLATE}


def _params(difficulty: dict) -> dict:
    unknown = set(difficulty) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown multistep option(s): {', '.join(sorted(unknown))}")
    return {**_DEFAULTS, **difficulty}


def generate_multistep(n: int, seed: int, **difficulty) -> list[Example]:
    """`n` distinct problems, deterministic in `seed`.

    difficulty: min_ops / max_ops (operations per problem), ops (subset of + - *),
    start_digits, operand_max (operands are 2..operand_max), max_value (bound on
    every intermediate value), template (`{start}`, `{steps}` placeholders).
    """
    return _generate(random.Random(seed), n, _params(difficulty), set())


def multistep_splits(n_train: int, n_eval: int, seed: int, **difficulty) -> tuple[list[Example], list[Example]]:
    """(train, eval), disjoint; eval drawn first so it does not depend on n_train."""
    params, seen = _params(difficulty), set()
    eval_set = _generate(random.Random(f"{seed}-multistep-eval"), n_eval, params, seen)
    train = _generate(random.Random(f"{seed}-multistep-train"), n_train, params, seen)
    return train, eval_set


# ------------------------------------------------------------ wrong solutions

CORRUPTIONS = CORRUPTION_KINDS


def _offset(rng: random.Random, most: int) -> int:
    return rng.choice([-1, 1]) * rng.randint(1, most)


def corrupt_solution(example: Example, rng: random.Random, kind: str) -> str:
    """The reference solution with one error of `kind` at a random step; later steps follow it.

    result: right operands, wrong result ("19 * 3 = 61"); operand: a misread
    operand, consistent result ("19 * 4 = 76"); operator: the wrong operation
    ("19 + 3 = 22"); carry: the previous result copied wrong ("21 * 3 = 63");
    unrelated: a right equation on small numbers that has nothing to do with the
    problem ("2 + 3 = 5", what a policy copies from an example in the prompt);
    stopped: right steps that end before the last one, no answer given (what a
    policy rewarded step by step learns to write). Only `result` needs arithmetic
    to spot; the others need the prompt, the previous line or the end of the text,
    which is what a policy gets wrong too.
    """
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; choose from {', '.join(CORRUPTIONS)}")
    ops = [(op, int(y)) for op, y in example.meta["ops"]]
    if kind == "stopped" and len(ops) == 1:
        kind = "result"  # a one-step solution cannot stop before its last step
    if kind == "stopped":
        return "\n".join(reference_steps(example.meta["start"], ops[:rng.randrange(1, len(ops))]))
    k = rng.randrange(len(ops))
    lines = reference_steps(example.meta["start"], ops[:k])
    value = int(lines[-1].rsplit("=", 1)[1]) if lines else int(example.meta["start"])
    op, y = ops[k]
    if kind == "carry":
        value += _offset(rng, 12)
    elif kind == "operand":
        misread = y + _offset(rng, 3)
        y = misread if misread >= 1 else y + rng.randint(1, 3)
    elif kind == "operator":
        op = rng.choice([o for o in OPS if o != op])
    elif kind == "unrelated":
        value, op, y = _unrelated_step(rng, value, y)
    result = _apply(value, op, y) + (_offset(rng, 12) if kind == "result" else 0)
    lines.append(f"{value} {op} {y} = {result}")
    for later_op, later_y in ops[k + 1:]:
        new = _apply(result, later_op, later_y)
        lines.append(f"{result} {later_op} {later_y} = {new}")
        result = new
    return "\n".join(lines + [f"Answer: {result}"])


def _unrelated_step(rng: random.Random, right_a: int, right_b: int) -> tuple[int, str, int]:
    """Single-digit operands, both unlike the right step's (what step_categories calls unrelated),
    and any operation with a non-negative result."""
    while True:
        a, op, b = rng.randint(2, 9), rng.choice(OPS), rng.randint(2, 9)
        if a != right_a and b != right_b and _apply(a, op, b) >= 0:
            return a, op, b


# ------------------------------------------------------------ step labels

def split_steps(completion: str, separator: str = "\n") -> list[str]:
    """Non-empty, stripped pieces of the completion between separators."""
    return [s.strip() for s in completion.split(separator) if s.strip()]


def _parse_equation(step: str) -> tuple[str, str, str, str] | None:
    """(a, op, b, c) as normalised strings from the first 'a op b = c' in the step."""
    m = _EQUATION_RE.search(step.replace("\u2212", "-"))
    if m is None:
        return None
    a, op, b, c = m.groups()
    return (normalize_number(a), _OP_ALIASES.get(op, op), normalize_number(b), normalize_number(c))


def label_steps(example: Example, completion: str, separator: str = "\n") -> tuple[list[str], list[int]]:
    """(steps, labels): each step of the completion labelled 1 (correct) or 0.

    Rule, exact and positional: the k-th equation line 'a op b = c' is correct
    iff it is the k-th reference step (same operands, operator and result), so
    after a mistake later steps are wrong unless they restate the right values.
    A non-equation step is correct only if it is the last step and states the
    right final answer ("Answer: 52"); chatter and extra equations score 0.
    The last step must also finish the solution: an equation that ends the text
    is correct only if it is the reference's last step. A solution that stops
    early therefore ends on a wrong step; without this rule, rewarding steps
    pays a policy for writing one right equation and stopping (docs/rewards.md).
    """
    expected = [_parse_equation(line) for line in reference_steps(example.meta["start"], example.meta["ops"])]
    steps = split_steps(completion, separator)
    labels, k = [], 0
    for i, step in enumerate(steps):
        eq = _parse_equation(step)
        last = i == len(steps) - 1
        if eq is not None:
            labels.append(int(k < len(expected) and eq == expected[k] and (not last or k == len(expected) - 1)))
            k += 1
        else:
            labels.append(int(last and math_equal(extract_answer(step), example.answer)))
    return steps, labels


def step_categories(example: Example, completion: str, separator: str = "\n") -> list[str]:
    """What each step of a completion is, for a PRM's error analysis: `correct`, `first_error:<kind>`
    (the first wrong step; kind as in CORRUPTIONS, judged against the reference step, or `other`
    for a wrong non-equation line) or `after_error` (any later wrong step)."""
    expected = [_parse_equation(line) for line in reference_steps(example.meta["start"], example.meta["ops"])]
    steps, labels = label_steps(example, completion, separator)
    out, k, seen_error = [], 0, False
    for step, label in zip(steps, labels):
        eq = _parse_equation(step)
        if label:
            out.append("correct")
        elif seen_error:
            out.append("after_error")
        else:
            out.append(f"first_error:{_error_kind(eq, expected[k] if eq and k < len(expected) else None)}")
        seen_error = seen_error or not label
        k += eq is not None
    return out


def _error_kind(step: tuple | None, reference: tuple | None) -> str:
    """unrelated when both operands are wrong, else which field of 'a op b = c' departs from the
    reference step first: carry, operator, operand, result; stopped for the right step on which
    a solution ends too early."""
    if step is None or reference is None:
        return "other"
    if step[0] != reference[0] and step[2] != reference[2]:
        return "unrelated"
    for kind, mine, right in zip(("carry", "operator", "operand", "result"), step, reference):
        if mine != right:
            return kind
    return "stopped"
