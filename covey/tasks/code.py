"""A tiny code task for the sandboxed code-execution reward.

Each problem asks for a Python program that reads one integer n from standard
input and prints a function of it ("n * 7", "the sum of 1..n", "n reversed");
three hidden (stdin, stdout) tests check it. The tests travel in
`Example.meta["tests"]`, so `covey.rewards.sandbox.code_execution_reward`
receives them as the `tests` column. `Example.answer` is the expected output
of the first test.
"""

from __future__ import annotations

import random

from covey.tasks.base import Example

TEMPLATE = ("Write a Python program that reads an integer n from standard input and prints {what}. "
            "Reply with the program in a ```python code block.")


def _problems() -> dict[str, callable]:
    """Every distinct problem: description -> the function of n to print."""
    out = {"the sum of the integers from 1 to n": lambda n: n * (n + 1) // 2,
           "the digits of n in reverse order": lambda n: int(str(n)[::-1])}
    for k in range(2, 10):
        out[f"n * {k}"] = lambda n, k=k: n * k
        out[f"n + {k}"] = lambda n, k=k: n + k
        out[f"n squared minus {k}"] = lambda n, k=k: n * n - k
        out[f"the remainder of n divided by {k}"] = lambda n, k=k: n % k
    return out


def generate_code_tasks(n: int, seed: int) -> list[Example]:
    """`n` distinct problems with three tests each, deterministic in `seed`."""
    problems = _problems()
    if n > len(problems):
        raise ValueError(f"only {len(problems)} distinct code problems exist; asked for {n}")
    rng = random.Random(seed)
    out = []
    for what in rng.sample(sorted(problems), n):
        inputs = [rng.randint(1, 99) for _ in range(3)]
        tests = [[f"{x}\n", str(problems[what](x))] for x in inputs]
        out.append(Example(prompt=TEMPLATE.format(what=what), answer=tests[0][1], meta={"tests": tests}))
    return out
