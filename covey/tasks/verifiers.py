"""Verifiers: is a completion's answer the reference answer? One per kind of answer.

The same verifier scores the correctness reward during training and the held-out accuracy
(`eval.metric`), so the two always agree on what "correct" means:

- `math`: the final answer read by `extract_answer` (boxed, '####', 'Answer: x', else the last
  number) equals the reference by `math_equal` (numbers exactly, LaTeX through math-verify when
  installed). The built-in tasks' verifier.
- `exact`: the answer text equals the reference, character for character after trimming
  whitespace. The answer text is what follows the last explicit marker ('Answer: Paris',
  '\\boxed{Paris}', '#### Paris', 'the answer is Paris.'), else the whole completion.
- `normalized`: the same, after SQuAD's normalisation (Rajpurkar et al. 2016, arXiv:1606.05250):
  lower case, punctuation and the articles a/an/the removed, whitespace collapsed.
- `contains`: the normalised reference occurs as whole words in the normalised answer text
  ("The capital of France is Paris." contains "paris"). Lenient: it also accepts an answer that
  lists several candidates, so it is a measure for evaluation more than a reward to train on.
- `reasoning_gym`: the dataset's own `score_answer` (covey/tasks/reasoning_gym.py) on the answer read from
  the completion, with the row's `reasoning_gym` column; a score in [0, 1] (partial credit where the
  dataset gives it), right at 1. `auto` picks it for task.name=reasoning_gym:<dataset>. A verifier that
  reads a column of its row besides the answer is a row verifier (`ROW_VERIFIERS`).

`auto` picks `math` when every reference answer is a number or a LaTeX expression, `normalized`
otherwise (`resolve_verifier`).
"""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Callable, Sequence

from covey.tasks import reasoning_gym
from covey.tasks.answers import extract_answer, marked_text, math_equal, normalize_number

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation + "\u2019\u2018\u201c\u201d"})
_LATEX_RE = re.compile(r"\\[a-zA-Z]+|\^|/")


def normalize_text(text: str) -> str:
    """SQuAD normalisation: NFKC, lower case, punctuation to spaces, no articles, single spaces."""
    text = unicodedata.normalize("NFKC", str(text)).lower().translate(_PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def answer_text(completion: str) -> str:
    """The text after the last explicit answer marker, else the whole completion, trimmed."""
    marked = marked_text(completion)
    return (marked if marked is not None else str(completion or "")).strip()


def math_verifier(completion: str, gold: str) -> bool:
    return bool(math_equal(extract_answer(completion), str(gold)))


def exact_verifier(completion: str, gold: str) -> bool:
    return answer_text(completion) == str(gold).strip()


def normalized_verifier(completion: str, gold: str) -> bool:
    return normalize_text(answer_text(completion)) == normalize_text(gold)


def contains_verifier(completion: str, gold: str) -> bool:
    want = normalize_text(gold)
    return bool(want) and f" {want} " in f" {normalize_text(answer_text(completion))} "


VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "math": math_verifier,
    "exact": exact_verifier,
    "normalized": normalized_verifier,
    "contains": contains_verifier,
}

ROW_VERIFIERS: dict[str, tuple[str, Callable[[str, object], float]]] = {
    reasoning_gym.VERIFIER: (reasoning_gym.COLUMN, reasoning_gym.score_completion),
}
"""Verifiers that score with their row's own data: name -> (the column they read, fn(completion, that
column's value) -> a score in [0, 1])."""


def is_math_answer(answer: str) -> bool:
    """A number ("1,234", "-0.5") or a LaTeX expression ("\\frac{1}{2}", "3/4")."""
    return normalize_number(answer) is not None or bool(_LATEX_RE.search(str(answer)))


def resolve_verifier(name: str, answers: Sequence[str]) -> str:
    """The verifier an eval.metric implies: a verifier's name as given; `auto`, and `reward` (whose
    correctness reward still needs one), -> `math` when every answer is a number or LaTeX, else
    `normalized` (no answers known: `math`)."""
    if name in VERIFIERS or name in ROW_VERIFIERS:
        return name
    return "math" if all(is_math_answer(a) for a in answers) else "normalized"


def unreadable_answers(name: str, answers: Sequence[str]) -> int:
    """How many reference answers the `math` verifier cannot score (neither a number nor LaTeX);
    0 for the string verifiers, which read any text."""
    return sum(not is_math_answer(a) for a in answers) if name == "math" else 0


def verify(name: str, completions: Sequence[str], answers: Sequence[str]) -> list[bool]:
    """Per completion: does it give its reference answer, by verifier `name`?"""
    fn = VERIFIERS[name]
    return [fn(c, a) for c, a in zip(completions, answers)]


def verifier_column(name: str) -> str | None:
    """The column of its row a verifier reads besides the answer; None for a verifier of answers alone."""
    return ROW_VERIFIERS[name][0] if name in ROW_VERIFIERS else None


def scores(name: str, completions: Sequence[str], answers: Sequence[str], rows: Sequence | None = None) -> list[float]:
    """Per completion, its score in [0, 1] by verifier `name`: 1.0 or 0.0 for a verifier of answers; a row
    verifier's own score, from `rows` (its column's value for each completion, `verifier_column`)."""
    if name not in ROW_VERIFIERS:
        return [float(ok) for ok in verify(name, completions, answers)]
    column, fn = ROW_VERIFIERS[name]
    if rows is None or any(row is None for row in rows):
        raise ValueError(f"the {name} verifier reads each row's {column!r} column, which these rows lack "
                         f"(task.name=reasoning_gym:<dataset> makes it)")
    return [fn(c, row) for c, row in zip(completions, rows)]
