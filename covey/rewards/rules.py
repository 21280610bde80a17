"""Rule rewards with TRL's signature: `fn(prompts, completions, **columns) -> list[float]`.

`columns` are the dataset columns (`answer`, meta columns) plus what the loop
adds (`completion_lengths`, in tokens). Completions may be strings or TRL's
conversational form (a list of message dicts); both are accepted.

Rewards that take parameters (`overlong_penalty`'s max_len/buffer,
`language_consistency`'s language) get them bound with `get_rule_reward(name,
**params)`, which rejects unknown parameter names instead of letting a typo
vanish into `**columns`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from typing import Any, Callable, Sequence

from covey.tasks.answers import (  # noqa: F401  (re-exported: the public rule API)
    extract_answer,
    find_marked_answer,
    last_number,
    math_equal,
    normalize_number,
)
from covey.tasks.verifiers import scores, verifier_column


def completion_text(completion: Any) -> str:
    """Plain text of a completion: a string, a message dict, or a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion
                       if not isinstance(m, dict) or m.get("role", "assistant") == "assistant")
    raise TypeError(f"a completion must be a string or chat messages, got {type(completion).__name__}")


def _per_sample(value: Any, n: int, name: str) -> list:
    """A column given once for all samples or once per sample -> a list of length n."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"column '{name}' has {len(value)} values for {n} completions")
        return list(value)
    return [value] * n


def correctness_reward(prompts: Sequence, completions: Sequence, answer: Sequence | str | None = None,
                       verifier: str = "math", answer_column: str = "answer", **columns) -> list[float]:
    """1.0 if the completion gives the reference answer by `verifier` (covey/tasks/verifiers.py:
    math | exact | normalized | contains), else 0.0; a row verifier's own score in [0, 1]
    (reasoning_gym: the dataset's score_answer, from the row's `reasoning_gym` column). The references
    are the column `answer_column` (task.answer_key), `answer` by default."""
    refs = answer if answer_column == "answer" else columns.get(answer_column)
    if refs is None:
        raise ValueError(f"correctness needs the reference answers: no column '{answer_column}'")
    golds = _per_sample(refs, len(completions), answer_column)
    column = verifier_column(verifier)
    rows = _per_sample(columns[column], len(completions), column) if column in columns else None
    return scores(verifier, [completion_text(c) for c in completions], [str(g) for g in golds], rows)


def _last_nonempty_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def format_reward(prompts: Sequence, completions: Sequence, **columns) -> list[float]:
    """1.0 if the completion *ends* with a clearly marked, unambiguous numeric answer.

    Rule: the last non-empty line carries `\\boxed{x}`, `#### x`, "Answer: x" or
    "the answer is x" (the markers of `extract_answer`) and x reads as one
    number. Rewarding the marker only on the last line teaches the model to
    finish with its answer instead of burying it in the reasoning.
    """
    out = []
    for c in completions:
        marked = find_marked_answer(_last_nonempty_line(completion_text(c)))
        out.append(1.0 if normalize_number(marked) is not None else 0.0)
    return out


def _lengths(completions: Sequence, completion_lengths, completion_ids) -> list[int]:
    if completion_lengths is not None:
        return [int(n) for n in _per_sample(completion_lengths, len(completions), "completion_lengths")]
    if completion_ids is not None:
        return [len(ids) for ids in _per_sample(completion_ids, len(completions), "completion_ids")]
    raise ValueError("overlong_penalty needs token counts: pass completion_lengths or completion_ids")


def overlong_penalty(prompts: Sequence, completions: Sequence, *, max_len: int, buffer: int,
                     completion_lengths: Sequence[int] | None = None,
                     completion_ids: Sequence | None = None, **columns) -> list[float]:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), lengths in tokens L:

        0                            if L <= max_len - buffer
        ((max_len - buffer) - L) / buffer   if max_len - buffer < L <= max_len  (0 -> -1)
        -1                           if L > max_len

    A smooth ramp instead of a cliff, so a long-but-correct answer is not
    scored like a wrong one.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    start = max_len - buffer
    out = []
    for n in _lengths(completions, completion_lengths, completion_ids):
        out.append(0.0 if n <= start else -1.0 if n > max_len else (start - n) / buffer)
    return out


# ------------------------------------------------------------ language consistency

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD_RE = re.compile(rf"[{_CJK}]|[^\W\d_{_CJK}]+")
_LATIN_RE = re.compile(r"[A-Za-z\u00c0-\u024f\u1e00-\u1eff]+")
LANGUAGE_SCRIPTS = {"latin": "latin", "en": "latin", "fr": "latin", "de": "latin", "es": "latin",
                    "it": "latin", "pt": "latin", "cjk": "cjk", "zh": "cjk", "ja": "cjk", "ko": "cjk"}


def _script(word: str) -> str:
    if re.fullmatch(rf"[{_CJK}]", word):
        return "cjk"
    return "latin" if _LATIN_RE.fullmatch(word) else "other"


def language_share(text: str, language: str = "en") -> float:
    """Share of words written in the target language's script (the language-consistency reward
    of DeepSeek-AI 2025, DeepSeek-R1, arXiv:2501.12948).

    Words are runs of letters; each CJK character counts as one word because
    Chinese has no spaces. Digits and symbols are not words. No words at all
    (e.g. a bare number) scores 1.0: nothing was written in a wrong language.
    """
    script = LANGUAGE_SCRIPTS.get(language.lower())
    if script is None:
        raise ValueError(f"unknown language {language!r}; choose one of {', '.join(LANGUAGE_SCRIPTS)}")
    words = _WORD_RE.findall(text)
    if not words:
        return 1.0
    return sum(_script(w) == script for w in words) / len(words)


def language_consistency(prompts: Sequence, completions: Sequence, language: str | Sequence[str] = "en",
                         **columns) -> list[float]:
    """DeepSeek-R1's Num(Words_target) / Num(Words) per completion (arXiv:2501.12948); `language`
    may be a column."""
    langs = _per_sample(language, len(completions), "language")
    return [language_share(completion_text(c), lang) for c, lang in zip(completions, langs)]


# ------------------------------------------------------------ registry

def _is_tool_error(content: Any) -> bool:
    """A tool message that reports a failure: covey's {"error": ...} (a raise, a timeout, an unknown tool or
    bad arguments) or a tool's own "error: ..." line (the calculator's refusals)."""
    text = str(content).strip()
    return text.startswith('{"error"') or text.lower().startswith("error:")


def tool_use_reward(prompts: Sequence, completions: Sequence, **columns) -> list[float]:
    """1.0 for an episode in which at least one tool call came back without an error, else 0.0.

    A shaping term for models that do not call tools on their own (docs/agents.md): it pays for a
    working call, whatever the answer, so it is meant at a weight below correctness' (ToolRL,
    Qian et al. 2025, arXiv:2504.13958, rewards the call's form separately from the answer). A
    single-turn completion (text, not messages) scores 0.
    """
    out = []
    for c in completions:
        messages = c if isinstance(c, list) else []
        answered = [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"
                    and not _is_tool_error(m.get("content", ""))]
        out.append(1.0 if answered else 0.0)
    return out


def tool_turn_score(replies: Sequence[dict]) -> float:
    """One model turn's score by default (reward.step_source=turns, docs/agents.md): 1.0 when the turn
    made at least one tool call and every call was answered without an error (`replies`: the tool
    messages answering it, empty when it called none or its calls were not run), else 0.0. The
    per-turn form of `tool_use_reward` (ToolRL, Qian et al. 2025, arXiv:2504.13958)."""
    ok = bool(replies) and not any(_is_tool_error(m.get("content", "")) for m in replies)
    return 1.0 if ok else 0.0


RULE_REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "overlong": overlong_penalty,
    "language": language_consistency,
    "tool_use": tool_use_reward,
}


def get_rule_reward(name: str, **params) -> Callable[..., list[float]]:
    """The registered rule reward `name` with `params` bound (checked against its signature)."""
    if name not in RULE_REWARDS:
        close = difflib.get_close_matches(name, RULE_REWARDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown rule reward '{name}'{hint} (known: {', '.join(RULE_REWARDS)})")
    fn = RULE_REWARDS[name]
    accepted = {p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"prompts", "completions"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"rule reward '{name}' has no parameter(s) {', '.join(unknown)} "
                         f"(accepted: {', '.join(sorted(accepted))})")
    if not params:
        return fn
    bound = functools.partial(fn, **params)
    functools.update_wrapper(bound, fn)
    return bound
