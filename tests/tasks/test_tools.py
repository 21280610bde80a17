"""The built-in calculator tool: values checked by hand, refusals as text, and its schema as transformers reads it."""

from __future__ import annotations

import time

import pytest

from covey.tasks.tools import MAX_DIGITS, MAX_EXPONENT, calculator, evaluate


@pytest.mark.parametrize("expression, expected", [
    ("3 * 12 - 7", "29"),            # the word-problem example: 36 - 7
    ("(12 + 8) / 4", "5"),           # 20 / 4, a whole quotient shown without ".0"
    ("7 / 2", "3.5"),
    ("1 / 3", "0.333333333333"),     # 12 significant digits
    ("0.1 + 0.2", "0.3"),            # exact fractions: not 0.30000000000000004
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),               # floor of -3.5
    ("7 % 3", "1"),
    ("-7 % 3", "2"),                 # Python's sign convention: -7 = 3 * (-3) + 2
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("-2 ** 2", "-4"),               # ** binds tighter than unary minus
    ("(-2) ** 3", "-8"),
    ("-(3 + 4) * 2", "-14"),
    ("+5", "5"),
    ("4 ** 0.5", "2"),               # a fractional power is a float, whole here
    ("2 ** 0.5", "1.41421356237"),   # sqrt(2) = 1.414213562373...
    ("1.5e3 + 1", "1501"),
    ("2 \u00d7 3 \u00f7 4", "1.5"),  # the multiplication and division signs read as * and /
    ("  12 - 5  ", "7"),
    ("10 ** 99", "1" + "0" * 99),    # 100 digits: the largest size allowed
])
def test_values_worked_by_hand(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, words", [
    ("x + 1", "names are not allowed (x)"),
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("abs(-3)", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed (.real)"),
    ("9 ** 9 ** 9", f"the exponent 387420489 is too large (at most {MAX_EXPONENT}"),
    ("10 ** 100", f"more than {MAX_DIGITS} digits"),
    ("2 ** -1000", f"more than {MAX_DIGITS} digits"),
    ("1e400", f"more than {MAX_DIGITS} digits"),
    ("1" * 101, f"more than {MAX_DIGITS} digits"),
    ("10 ** 60 * 10 ** 60", f"more than {MAX_DIGITS} digits"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("2 ^ 3", "use **"),
    ("1,250", "commas are not allowed"),
    ("3 < 4", "comparisons are not allowed"),
    ("'a' * 3", "'a' is not a number"),
    ("True + 1", "True is not a number"),
    ("[1, 2]", "List expressions are not allowed"),
    ("3 +", "not a valid arithmetic expression"),
    ("", "the expression is empty"),
    ("1 + " * 200 + "1", "longer than 500 characters"),
])
def test_refusals_are_one_line_of_text(expression, words):
    out = calculator(expression)
    assert out.startswith("error: ") and words in out and "\n" not in out, out


def test_huge_powers_are_refused_before_they_are_computed():
    start = time.perf_counter()
    for expression in ("999 ** 1000", "2 ** 2 ** 2 ** 2 ** 2", "(10 ** 50) ** 1000"):
        assert calculator(expression).startswith("error: ")
    assert time.perf_counter() - start < 0.5


def test_non_text_input_is_refused_as_text():
    assert calculator(12).startswith("error: the expression must be text")  # type: ignore[arg-type]


def test_evaluate_keeps_fractions_exact():
    assert evaluate("1 / 3 * 3") == 1
    assert evaluate("0.1 * 3") == evaluate("3 / 10")


def test_transformers_reads_its_schema():
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "3 * 12 - 7" in schema["parameters"]["properties"]["expression"]["description"]
    assert schema["parameters"]["required"] == ["expression"]
