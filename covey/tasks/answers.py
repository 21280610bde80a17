"""Final-answer extraction, number normalisation and answer equivalence.

The reward is only as honest as its parser: a lenient parser pays for hedging
("12 or 13"), a strict one punishes correct answers written "1,234." or
"\\boxed{376}". The rules, in priority order (`extract_answer`):

1. the last balanced `\\boxed{...}` (nested boxes: the innermost last one);
2. the text after the last `####` on its line (GSM8K style);
3. the text after the last "answer is" / "Answer:" / "answer =" on its line,
   up to the end of the sentence;
4. otherwise the last number anywhere in the text.

A marked answer (1-3) is read as: the whole span if it is a number; else the
part after its last "="; else its single number ("376 apples"). A marked span
with two or more *different* numbers ("the answer is 12 or 13") is ambiguous
and yields None, so hedging never earns credit; a marked span without any
number falls through to the next rule (except `\\boxed`, returned verbatim so
LaTeX answers such as `\\frac{1}{2}` reach `math_equal`).

Numbers: thousands separators ("1,234", thin/no-break spaces), a leading minus
(ASCII or Unicode U+2212) when it is not a binary minus ("10-3" is 10 and 3),
decimals, exponents ("1e400"), "$" and a trailing period.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction

# Integer part with well-formed thousands groups, or plain digits; then an
# optional fraction and exponent. A minus counts only when it is not preceded
# by something that makes it a binary operator.
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?"
NUMBER_RE = re.compile(rf"(?:(?<![\w)\]}}])-)?(?:{_NUM})")
_FULL_NUMBER_RE = re.compile(rf"[+-]?(?:{_NUM})")
_MINUS_CHARS = str.maketrans({"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})
_SPACE_THOUSANDS_RE = re.compile(r"(?<=\d)[\u00a0\u2009\u202f](?=\d{3}(?!\d))")
_ANSWER_PHRASE_RE = re.compile(
    r"\banswer\b\s*(?:\*\*|__)?\s*(?:is\b\s*:?|:|=)\s*(?:\*\*|__)?", re.IGNORECASE)
_LATEX_MATH_RE = re.compile(r"\\(?:frac|dfrac|tfrac|sqrt|pi|cdot|times)|\^|/")
_MAX_PLAIN_DIGITS = 1000  # beyond this, keep a scientific canonical form (no giant strings)


def _prepare(text: str) -> str:
    """Unicode-normalise: full-width digits, Unicode minus, narrow-space thousands."""
    text = _SPACE_THOUSANDS_RE.sub("", text)
    return unicodedata.normalize("NFKC", text).translate(_MINUS_CHARS)


def _canonical(value: Decimal) -> str:
    """One string per number without context arithmetic (which overflows on 1e999999)."""
    sign, digits, exp = value.as_tuple()
    digits_s = "".join(map(str, digits)).lstrip("0")
    if not digits_s:
        return "0"
    stripped = digits_s.rstrip("0")
    exp += len(digits_s) - len(stripped)
    sign_s = "-" if sign else ""
    if 0 <= exp and len(stripped) + exp <= _MAX_PLAIN_DIGITS:
        return sign_s + stripped + "0" * exp
    if exp < 0 and -exp <= _MAX_PLAIN_DIGITS:
        whole, frac = stripped[:exp] or "0", stripped[exp:].rjust(-exp, "0")
        return f"{sign_s}{whole}.{frac}"
    return f"{sign_s}{stripped}E{exp}"


def _clean_number_text(s: str) -> str:
    s = _prepare(s).strip()
    s = s.replace("{,}", ",").replace("\\$", "").replace("\\!", "").replace("\\,", "")
    s = s.strip().strip("$").strip()
    s = re.sub(r"^([+-])\s+(?=[\d.])", r"\1", s.rstrip(".").strip())  # "- 5"
    if re.fullmatch(r"[+-]?\d{1,3}(?: \d{3})+(?:\.\d+)?", s):  # "1 234" as one number
        s = s.replace(" ", "")
    return s


def normalize_number(s: str | None) -> str | None:
    """Canonical string of a number written as text, or None if `s` is not one number.

    "1,234.0" -> "1234", "-0" -> "0", "$12." -> "12", "0.50" -> "0.5", "1e3" -> "1000".
    """
    if s is None:
        return None
    s = _clean_number_text(str(s))
    if not _FULL_NUMBER_RE.fullmatch(s):
        return None
    try:
        return _canonical(Decimal(s.replace(",", "")))
    except InvalidOperation:
        return None


def _boxed_span(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (or \\fbox), None if there is none."""
    limit = len(text)  # an unclosed box also hides earlier boxes' closings: scan each char once
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)", text))):
        brace = re.match(r"\s*\{", text[match.end():limit])
        if brace is None:
            bare = re.match(r"\s+([^\s${}]+)", text[match.end():limit])  # "\boxed 5" is valid LaTeX
            if bare:
                return bare.group(1)
            continue
        start = match.end() + brace.end()
        depth = 1
        for i in range(start, limit):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
        limit = match.start()
    return None


def _line_after(text: str, end: int) -> str:
    """The text after `end` on its line (skipping blank lines right after a marker)."""
    rest = text[end:].lstrip()
    return rest.split("\n", 1)[0]


def _hashes_span(text: str) -> str | None:
    pos = text.rfind("####")
    return None if pos < 0 else _line_after(text, pos + 4)


def _phrase_span(text: str) -> str | None:
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    if not matches:
        return None
    line = _line_after(text, matches[-1].end())
    return re.split(r"\.(?=\s|$)", line, maxsplit=1)[0]  # end of sentence, not a decimal point


def _clean_span(span: str) -> str:
    """A marked span without LaTeX \\text{} wrappers, markdown emphasis and surrounding space."""
    return re.sub(r"\\text\{([^{}]*)\}", r"\1", _prepare(span)).strip().strip("*_").strip()


def _read_span(span: str, verbatim: bool) -> tuple[bool, str | None]:
    """(found, answer) for a marked span; found=False means 'fall through'."""
    span = _clean_span(span)
    whole = normalize_number(span)
    if whole is not None:
        return True, whole
    if "=" in span:
        span = span.rsplit("=", 1)[1].strip()
        whole = normalize_number(span)
        if whole is not None:
            return True, whole
    if _LATEX_MATH_RE.search(span):
        return True, span or None
    collapsed = re.sub(r"(?<=\d) (?=\d{3}(?!\d))", "", span)  # "1 234" inside a marked answer
    numbers = {normalize_number(m.group()) for m in NUMBER_RE.finditer(collapsed)}
    if len(numbers) == 1:
        return True, numbers.pop()
    if len(numbers) > 1:
        return True, None  # ambiguous: never pay for hedging
    return (True, span or None) if verbatim else (False, None)


def find_marked_answer(text: str) -> str | None:
    """The answer given with an explicit marker (rules 1-3), ignoring bare numbers."""
    found, answer = _marked(text or "")
    return answer if found else None


def _marked(text: str) -> tuple[bool, str | None]:
    for finder, verbatim in ((_boxed_span, True), (_hashes_span, False), (_phrase_span, False)):
        span = finder(text)
        if span is not None:
            found, answer = _read_span(span, verbatim)
            if found:
                return True, answer
    return False, None


def marked_text(text: str) -> str | None:
    """The raw text of the last explicit answer marker (boxed, '####', 'answer is' / 'Answer:'),
    for answers that are words rather than numbers; None without a marker."""
    text = _prepare(text or "")
    for finder in (_boxed_span, _hashes_span, _phrase_span):
        span = finder(text)
        if span is not None and span.strip():
            return _clean_span(span)
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, normalised (rule 4)."""
    matches = list(NUMBER_RE.finditer(_prepare(text or "")))
    return normalize_number(matches[-1].group()) if matches else None


def extract_answer(text: str | None) -> str | None:
    """The final answer of a completion by the rules in the module docstring, or None."""
    if not text:
        return None
    found, answer = _marked(_prepare(text))
    return answer if found else last_number(text)


# ---------------------------------------------------------------- equivalence

_math_verify = None


def _load_math_verify():
    """math_verify if installed (optional, heavy: sympy), imported once on first use."""
    global _math_verify
    if _math_verify is None:
        try:
            import math_verify  # noqa: PLC0415
            _math_verify = math_verify
        except ImportError:
            _math_verify = False
    return _math_verify or None


def _numbers_equal(pred: str, gold: str) -> bool:
    """Exact when the gold is an integer; relative tolerance 1e-6 when it is a decimal."""
    if pred == gold:
        return True
    if "." not in gold and "E-" not in gold:
        return False
    with localcontext() as ctx:
        ctx.prec = 60
        try:
            p, g = Decimal(pred), Decimal(gold)
            return abs(p - g) <= Decimal("1e-6") * max(abs(p), abs(g))
        except ArithmeticError:
            return False


def _simple_fraction(s: str) -> Fraction | None:
    """'3/4', '-3/4', '\\frac{3}{4}' -> Fraction (the fallback when math_verify is absent)."""
    s = s.strip().strip("$").strip()
    m = (re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s)
         or re.fullmatch(r"(-?)(-?\d+)\s*/\s*(-?\d+)", s))
    if not m or int(m.group(3)) == 0:
        return None
    value = Fraction(int(m.group(2)), int(m.group(3)))
    return -value if m.group(1) else value


def _as_fraction(s: str) -> Fraction | None:
    number = normalize_number(s)
    if number is not None and "E" not in number:
        return Fraction(number)
    return _simple_fraction(s)


def _verify_symbolic(pred: str, gold: str, mv) -> bool:
    """math_verify; its signal-based timeout only works in the main thread."""
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    wrap = lambda s: s if ("$" in s or "\\boxed" in s) else f"${s}$"  # noqa: E731
    try:
        gold_p = mv.parse(wrap(gold), parsing_timeout=timeout)
        pred_p = mv.parse(wrap(pred), parsing_timeout=timeout)
        return bool(gold_p and pred_p and mv.verify(gold_p, pred_p, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - an unparsable answer is simply not equal
        return False


def math_equal(pred: str | None, gold: str | None) -> bool:
    """Is the extracted answer equivalent to the reference?

    Two numbers compare numerically here (exact, fast, no sympy: math_verify
    rounds floats, which would accept a wrong 20-digit product). Anything else
    (fractions, LaTeX) goes to math_verify when installed, else to exact
    fraction comparison, else to whitespace-insensitive string equality.
    """
    if pred is None or gold is None:
        return False
    pred, gold = str(pred), str(gold)
    p_num, g_num = normalize_number(pred), normalize_number(gold)
    if p_num is not None and g_num is not None:
        return _numbers_equal(p_num, g_num)
    mv = _load_math_verify()
    if mv is not None:
        return _verify_symbolic(pred, gold, mv)
    p_frac, g_frac = _as_fraction(pred), _as_fraction(gold)
    if p_frac is not None and g_frac is not None:
        return p_frac == g_frac
    return re.sub(r"\s+", "", pred) == re.sub(r"\s+", "", gold)
