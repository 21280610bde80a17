"""Verifiers: each one on hand-made completions, including the near misses that must fail."""

import pytest

from covey.tasks.verifiers import answer_text, normalize_text, resolve_verifier, unreadable_answers, verify


@pytest.mark.parametrize("text, normalized", [
    ("The Eiffel Tower!", "eiffel tower"),        # article and punctuation go, case folds
    ("  New   York\n", "new york"),                # whitespace collapses
    ("an apple, a pear", "apple pear"),
    ("Théâtre", "théâtre"),                        # accents stay: they can change the word
    ("ＡＢＣ", "abc"),                              # full-width letters: NFKC
    ("rock'n'roll", "rock n roll"),                # apostrophes split like other punctuation
])
def test_normalize_text(text, normalized):
    assert normalize_text(text) == normalized


@pytest.mark.parametrize("completion, span", [
    ("Let me think. Answer: Paris", "Paris"),
    ("I believe the answer is Paris. It is in France.", "Paris"),   # up to the end of the sentence
    ("\\boxed{\\text{Paris}}", "Paris"),
    ("Reasoning...\n#### Paris", "Paris"),
    ("The capital of France is Paris.", "The capital of France is Paris."),  # no marker: all of it
])
def test_answer_text(completion, span):
    assert answer_text(completion) == span


CASES = [
    # completion, reference, math, exact, normalized, contains
    ("The answer is 42.", "42", True, True, True, True),
    ("The answer is 41.", "42", False, False, False, False),       # off by one
    ("42 is not it; the answer is 24.", "42", False, False, False, False),  # right number, wrong place
    ("The answer is 12 or 13.", "12", False, False, False, True),   # hedging: only `contains` is fooled
    ("Answer: Paris", "Paris", False, True, True, True),
    ("Answer: paris.", "Paris", False, False, True, True),          # case and full stop: normalised only
    ("Answer: The Paris", "Paris", False, False, True, True),       # an article
    ("The capital of France is Paris.", "Paris", False, False, False, True),
    ("The capital of France is Parisian.", "Paris", False, False, False, False),  # whole words only
    ("Answer: New York City", "New York", False, False, False, True),
    ("Answer: York", "New York", False, False, False, False),
    ("The answer is 1,234.", "1234", True, False, False, False),    # numbers: only `math` reads 1,234
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, True, True, True),
]


@pytest.mark.parametrize("name, column", [("math", 2), ("exact", 3), ("normalized", 4), ("contains", 5)])
def test_each_verifier_on_hand_made_cases(name, column):
    completions = [case[0] for case in CASES]
    answers = [case[1] for case in CASES]
    assert verify(name, completions, answers) == [case[column] for case in CASES]


def test_contains_never_accepts_an_empty_reference():
    assert verify("contains", ["anything"], ["   "]) == [False]


def test_auto_picks_math_for_numbers_and_latex_and_normalized_for_text():
    assert resolve_verifier("auto", ["12", "-3.5", "1,000", "\\frac{1}{2}", "3/4"]) == "math"
    assert resolve_verifier("auto", ["12", "Paris"]) == "normalized"
    assert resolve_verifier("contains", ["12"]) == "contains"  # an explicit choice stays
    assert resolve_verifier("reward", ["Paris"]) == "normalized"  # the correctness reward's, as auto
    assert resolve_verifier("auto", []) == "math"  # no answers known (covey serve-reward)


def test_unreadable_answers_counts_text_for_math_only():
    assert unreadable_answers("math", ["12", "Paris", "Rome"]) == 2
    assert unreadable_answers("normalized", ["12", "Paris"]) == 0
