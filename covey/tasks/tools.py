"""Built-in tools: plain Python functions a model can call during an episode.

A tool here is written the way TRL's GRPOTrainer and transformers' chat templates expect one: type
hints on every parameter and a Google-style docstring with an ``Args:`` line per parameter, so that
``transformers.utils.get_json_schema`` turns it into the JSON schema given to
``apply_chat_template(..., tools=...)``. A tool returns text; a wrong input gives a line starting
with ``error:`` that says what is wrong, never an exception, so the model can read it and retry.

``calculator``: arithmetic for word problems. The expression is parsed with Python's ``ast`` and
walked by a small evaluator that knows only numbers, ``+ - * / // % **``, unary ``+``/``-`` and
parentheses; ``eval`` and ``exec`` are never used, and names, calls, attributes, comparisons and
every other kind of expression are refused. Numbers are exact fractions (``0.1 + 0.2`` is ``0.3``,
``7 / 2`` is ``3.5``, ``6 / 3`` is ``2``); only a fractional power (``2 ** 0.5``) gives a float.
Bounds keep one call cheap: at most ``MAX_EXPRESSION_CHARS`` characters, exponents of magnitude at
most ``MAX_EXPONENT``, and no number (literal, intermediate or result) beyond ``MAX_DIGITS``
decimal digits.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_DIGITS = 100
_LIMIT = 10 ** MAX_DIGITS
_SYMBOLS = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-"}  # the multiplication, division and minus signs
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None}  # ** is _power
_ALLOWED = "only numbers, + - * / // % ** and parentheses are allowed"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; its message is shown to the model."""


CALCULATOR_DEMO = [
    {"role": "user", "content": "Ana has 12 pens. She gives away 5 pens and then buys 9 more. How many pens does she "
                                "have now?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 - 5 + 9"}}'
                                     '</tool_call>'},
    {"role": "tool", "name": "calculator", "content": "16"},
    {"role": "assistant", "content": "Ana has 16 pens now.\n#### 16"},
    {"role": "user", "content": "A box holds 7 rows of 8 eggs. Tom eats 3 eggs. How many eggs are left?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8 - 3"}}'
                                     '</tool_call>'},
    {"role": "tool", "name": "calculator", "content": "53"},
    {"role": "assistant", "content": "There are 53 eggs left.\n#### 53"},
]
"""Two worked exchanges with the calculator (rollout.tool_demo=builtin): a question, the call, its result, the
answer, which leaves the arithmetic to the tool. SmolLM2-135M-Instruct imitates the answer turn of a single
exchange that shows its arithmetic and writes the sum itself; after these two its greedy first turn calls the
calculator in 8 of 24 word problems (dev/LOG.md, 2026-11-27)."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to evaluate, using numbers, + - * / // % ** and parentheses, e.g. "3 * 12 - 7".

    Returns:
        The value as text, or a line starting with "error:" that says what is wrong.
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"


def evaluate(expression: str) -> Fraction | float:
    """The value of an arithmetic expression; CalculatorError with a clear message when refused."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, not {type(expression).__name__}")
    text = expression.strip()
    for symbol, ascii_op in _SYMBOLS.items():
        text = text.replace(symbol, ascii_op)
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        hint = " (use ** for powers)" if "^" in text else ""
        raise CalculatorError(f"not a valid arithmetic expression: {text}{hint}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Fraction | float) -> str:
    """A whole number without a decimal point; otherwise up to 12 significant digits."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def _value(node: ast.AST) -> Fraction | float:
    """One node of the expression tree, evaluated; every kind of node not named here is refused."""
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node.op, _value(node.left), _value(node.right))
    raise CalculatorError(_refusal(node))


def _refusal(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names are not allowed ({node.id}); {_ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; {_ALLOWED}"
    if isinstance(node, ast.Attribute):
        return f"attributes are not allowed (.{node.attr}); {_ALLOWED}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "^ is not a power here: use ** (2 ** 3 is 8)"
    if isinstance(node, ast.Tuple):
        return f"commas are not allowed (write 1250, not 1,250); {_ALLOWED}"
    kind = {ast.Compare: "comparisons", ast.BoolOp: "and/or"}.get(type(node), f"{type(node).__name__} expressions")
    return f"{kind} are not allowed; {_ALLOWED}"


def _literal(value) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{value!r} is not a number; {_ALLOWED}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return _checked(Fraction(value) if isinstance(value, int) else Fraction(repr(value)))


def _binary(op: ast.operator, left, right):
    try:
        result = _power(left, right) if isinstance(op, ast.Pow) else _BINARY[type(op)](left, right)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits") from None
    return _checked(Fraction(result) if isinstance(result, int) else result)


def _power(base, exponent):
    """base ** exponent: exact for a whole exponent (its size checked before it is computed), else a float."""
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        n = exponent.numerator
        if abs(n) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {n} is too large (at most {MAX_EXPONENT} in size)")
        if base == 0 and n < 0:
            raise CalculatorError("division by zero")
        magnitude = abs(base)
        if magnitude not in (0, 1) and abs(math.log10(magnitude)) * abs(n) > MAX_DIGITS:
            raise CalculatorError(f"the power {format_number(base)} ** {n} has more than {MAX_DIGITS} digits")
        return base ** n
    if base < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return float(base) ** float(exponent)


def _checked(value: Fraction | float) -> Fraction | float:
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= _LIMIT:
            raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
        return value
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return value
