"""Answer extraction, number normalisation, math_equal and the rule rewards.

The extraction rules (priority: \\boxed > #### > "answer is"/"Answer:" > last
number; a marked span with two different numbers is ambiguous -> None) are in
covey/tasks/answers.py's docstring.
"""

import threading
import time

import pytest

from covey.rewards.rules import (
    RULE_REWARDS,
    completion_text,
    correctness_reward,
    extract_answer,
    format_reward,
    get_rule_reward,
    language_consistency,
    language_share,
    math_equal,
    normalize_number,
    overlong_penalty,
)
from covey.tasks import answers


@pytest.mark.parametrize("raw,expected", [
    ("1,234.0", "1234"), ("-0", "0"), ("-0.000", "0"), ("$12.", "12"), ("0.50", "0.5"),
    ("+7", "7"), ("1e3", "1000"), ("2.5E-3", "0.0025"), (".5", "0.5"), ("- 5", "-5"),
    ("\u22125", "-5"), ("１２", "12"), ("1 234", "1234"), ("1{,}234", "1234"), ("\\$5", "5"),
    ("007", "7"), ("12345678901234567890123", "12345678901234567890123"),
    ("1,23", None), ("12 13", None), ("abc", None), ("", None), (None, None), ("1.2.3", None),
    ("inf", None), ("nan", None), ("1/2", None),
])
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


def test_normalize_huge_exponents_stay_small():
    assert normalize_number("1e400") == "1" + "0" * 400
    assert normalize_number("1e999999999999999999") == "1E999999999999999999"
    assert normalize_number("-2.50e-2000") == "-25E-2001"


@pytest.mark.parametrize("text,expected", [
    # plain last number
    ("47 * 8 = 376", "376"),
    ("So the result is 376.", "376"),
    ("I think 10-3 equals 7", "7"),            # binary minus is not a sign
    ("(-3)", "-3"),
    ("x = \u221215", "-15"),                    # unicode minus
    ("It costs $1,234.50 in total", "1234.5"),
    ("１２３", "123"),                           # full-width digits
    ("12,34", "34"),                           # malformed thousands: two numbers
    ("100%", "100"),
    ("1e400", "1" + "0" * 400),
    ("12345678901234567890123456789 apples", "12345678901234567890123456789"),
    ("a narrow-space number 1\u202f234", "1234"),
    ("the numbers 12 or 13", "13"),            # unmarked: last number wins (GSM8K convention)
    # boxed
    (r"so \boxed{376}", "376"),
    (r"\boxed{12} then \boxed{13}", "13"),    # the last box
    (r"\boxed{\boxed{5}}", "5"),                # nested: innermost last
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),   # LaTeX passed through for math_equal
    (r"$\boxed{1{,}234}$.", "1234"),
    (r"\boxed{x = 12}", "12"),
    (r"\boxed{376 \text{ apples}}", "376"),
    (r"\boxed 7", "7"),
    (r"\boxed{12", "12"),                       # unbalanced box ignored -> last number
    (r"\boxed{A}", "A"),
    (r"\boxed{12 or 13} but 12", None),
    # ####
    ("reasoning 5\n#### 1,234", "1234"),
    ("#### -7\n", "-7"),
    ("####\nthe end is 5", "5"),               # empty marker falls through
    # answer phrases
    ("The answer is 12.", "12"),
    ("Answer: 47 * 8 = 376", "376"),
    ("**Answer:** 376", "376"),
    ("The final answer is: $376", "376"),
    ("Answer:\n\n42", "42"),
    ("answer = 9 apples", "9"),
    ("Answer: Let me compute. 47*8 = 376", "376"),  # marker without number falls through
    ("The answer is 12. Or maybe 13.", "12"),  # the marked sentence ends at the period
    ("Answer: $ 1 234", "1234"),
    ("The answer is -0", "0"),
    # adversarial / malformed
    ("The answer is 12 or 13", None),          # hedging is never paid
    ("The answer is 12, not 13", None),
    ("", None),
    (None, None),
    ("no digits at all", None),
    ("answer is " * 50, None),
    ("1e999999999999999999", "1E999999999999999999"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_is_linear_on_adversarial_inputs():
    inputs = [r"\boxed{" * 20000, "1,111" * 20000, "9" * 100000, "answer is " * 20000,
              "-" * 100000 + "5", "#### " * 20000]
    # CPU time, not wall time: a loaded machine stretches the wall clock, not the work. A
    # quadratic pattern on 100k characters would take minutes; the linear scan takes ~0.1 s.
    start = time.process_time()
    for text in inputs:
        extract_answer(text)
    assert time.process_time() - start < 2.0


@pytest.mark.parametrize("pred,gold,equal", [
    ("376", "376", True), ("376.0", "376", True), ("1,234", "1234", True), ("-0", "0", True),
    ("377", "376", False), (None, "1", False), ("1", None, False),
    # integers are exact, however long (math_verify would round these)
    ("12345678901234567891", "12345678901234567890", False),
    ("1.0000001", "1", False),
    # decimals: relative tolerance 1e-6
    ("3.1415926", "3.14159265", True), ("3.1416", "3.14159265", False),
    ("1E+400", "1e400", True),
    ("0.5", "1/2", True), (r"\frac{1}{2}", "0.5", True), ("1/3", "0.5", False),
])
def test_math_equal(pred, gold, equal):
    assert math_equal(pred, gold) is equal


def test_math_equal_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(answers, "_math_verify", False)  # as if not installed
    assert math_equal("0.5", "1/2") and math_equal(r"\frac{-3}{4}", "-0.75") and math_equal("-3/4", "-0.75")
    assert not math_equal("1/3", "0.333")
    assert math_equal("A", " A ") and not math_equal("A", "B")
    assert not math_equal("1/0", "1")


def test_math_equal_works_outside_the_main_thread():
    # math_verify's signal-based timeout cannot run in a thread; the reward combiner uses threads.
    result = []
    thread = threading.Thread(target=lambda: result.append(math_equal(r"\frac{1}{2}", "0.5")))
    thread.start()
    thread.join()
    assert result == [True]


# ------------------------------------------------------------ rewards

def test_correctness_reward():
    completions = ["so 376", "Answer: 12 or 13", [{"role": "assistant", "content": r"\boxed{376}"}], "", "377"]
    assert correctness_reward(["p"] * 5, completions, answer=["376", "12", "376", "1", "376"]) == [1, 0, 1, 0, 0]
    assert correctness_reward(["p"], ["4"], answer=[4]) == [1.0]  # non-string gold
    with pytest.raises(ValueError, match="3 values for 2 completions"):
        correctness_reward(["p", "p"], ["1", "2"], answer=["1", "2", "3"])


def test_format_reward_wants_a_marked_number_on_the_last_line():
    completions = ["47 * 8 = 376", "47 * 8 = 376\nAnswer: 376.", r"so $\boxed{376}$", "#### 376",
                   "Answer: 376\nHope this helps!", "The answer is 12 or 13", r"\boxed{x}", "", "Answer: 376\n\n"]
    assert format_reward(["p"] * 9, completions) == [0, 1, 1, 1, 0, 0, 0, 0, 1]


def test_overlong_penalty_dapo_ramp():
    # max_len 100, buffer 20: 0 up to 80, then (80 - L) / 20 down to -1 at 100, -1 beyond
    lengths = [0, 80, 81, 90, 100, 101, 10_000]
    out = overlong_penalty(["p"] * 7, ["c"] * 7, max_len=100, buffer=20, completion_lengths=lengths)
    assert out == pytest.approx([0, 0, -0.05, -0.5, -1, -1, -1])
    assert overlong_penalty(["p"], ["c"], max_len=4, buffer=2, completion_ids=[[1, 2, 3]]) == [-0.5]
    with pytest.raises(ValueError, match="needs token counts"):
        overlong_penalty(["p"], ["c"], max_len=4, buffer=2)
    with pytest.raises(ValueError, match="0 < buffer <= max_len"):
        overlong_penalty(["p"], ["c"], max_len=4, buffer=5, completion_lengths=[1])


def test_language_share_by_script():
    assert language_share("hello world") == 1.0
    assert language_share("你好 world", "en") == pytest.approx(1 / 3)  # each CJK character is a word
    assert language_share("你好 world", "zh") == pytest.approx(2 / 3)
    assert language_share("привет hello", "en") == 0.5
    assert language_share("café déjà vu", "fr") == 1.0
    assert language_share("12 + 7 = 19") == 1.0  # no words: nothing in a wrong language
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        language_share("hi", "xx")


def test_language_consistency_reward_with_column():
    out = language_consistency(["p", "p"], ["hello world", "你好"], language=["zh", "zh"])
    assert out == [0.0, 1.0]
    assert language_consistency(["p"], ["hello 你"]) == [0.5]


def test_registry_and_binding():
    assert set(RULE_REWARDS) == {"correctness", "format", "overlong", "language", "tool_use"}
    overlong = get_rule_reward("overlong", max_len=10, buffer=5)
    assert overlong.__name__ == "overlong_penalty"
    assert overlong(["p"], ["c"], completion_lengths=[8], answer=["1"]) == [pytest.approx(-0.6)]
    assert get_rule_reward("correctness") is correctness_reward
    zh = get_rule_reward("language", language="zh")
    assert zh(["p"], ["中文"]) == [1.0]
    with pytest.raises(ValueError, match="did you mean 'overlong'"):
        get_rule_reward("overlng")
    with pytest.raises(ValueError, match="no parameter\\(s\\) max_lenn"):
        get_rule_reward("overlong", max_lenn=3)


def test_completion_text_forms():
    assert completion_text("x") == "x"
    assert completion_text({"role": "assistant", "content": "y"}) == "y"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    with pytest.raises(TypeError):
        completion_text(3)
