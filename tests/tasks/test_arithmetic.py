"""Synthetic arithmetic task: determinism, disjoint splits, difficulty options, Example."""

import random

import pytest

from covey.rewards.rules import correctness_reward
from covey.tasks import Example, arithmetic_splits, build_messages, generate_arithmetic


def test_generate_is_deterministic_and_ignores_global_random_state():
    random.seed(1)
    a = generate_arithmetic(50, seed=7)
    random.seed(2)
    b = generate_arithmetic(50, seed=7)
    assert a == b
    assert a != generate_arithmetic(50, seed=8)


def test_default_is_two_digit_times_one_digit_with_correct_answers():
    for ex in generate_arithmetic(200, seed=0):
        m = ex.meta
        assert m["op"] == "*" and 10 <= m["a"] <= 99 and 1 <= m["b"] <= 9
        assert ex.answer == str(m["a"] * m["b"])
        assert f"{m['a']} * {m['b']}" in ex.prompt


def test_questions_within_a_set_are_distinct():
    exs = generate_arithmetic(500, seed=3)
    assert len({e.prompt for e in exs}) == 500


@pytest.mark.parametrize("kind,ops", [("add", {"+"}), ("sub", {"-"}), ("mul", {"*"}), ("mixed", {"+", "-", "*"})])
def test_kinds(kind, ops):
    exs = generate_arithmetic(300, seed=1, kind=kind, digits_a=3, digits_b=2)
    assert {e.meta["op"] for e in exs} == ops
    for e in exs:
        a, op, b = e.meta["a"], e.meta["op"], e.meta["b"]
        assert int(e.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        if op == "-":
            assert int(e.answer) >= 0  # allow_negative defaults to False


def test_digit_counts_and_negative_subtraction():
    exs = generate_arithmetic(200, seed=2, kind="sub", digits_a=1, digits_b=3, allow_negative=True)
    assert all(1 <= e.meta["a"] <= 9 and 100 <= e.meta["b"] <= 999 for e in exs)
    assert all(int(e.answer) < 0 for e in exs)


def test_splits_are_disjoint_and_sized():
    train, held = arithmetic_splits(700, 100, seed=0)  # 810 questions exist for 2x1 mul
    assert len(train) == 700 and len(held) == 100
    assert not {e.prompt for e in train} & {e.prompt for e in held}


def test_eval_split_does_not_depend_on_train_size():
    _, held_small = arithmetic_splits(10, 50, seed=4)
    train_big, held_big = arithmetic_splits(400, 50, seed=4)
    assert held_small == held_big
    assert train_big[:10] == arithmetic_splits(10, 50, seed=4)[0]


def test_splits_forward_difficulty_and_reject_unknown_options():
    train, _ = arithmetic_splits(20, 20, seed=0, kind="add", digits_a=3, digits_b=3)
    assert all(e.meta["op"] == "+" and e.meta["b"] >= 100 for e in train)
    with pytest.raises(TypeError, match="digits_c"):
        arithmetic_splits(5, 5, seed=0, digits_c=2)


def test_impossible_sizes_fail_clearly():
    with pytest.raises(ValueError, match="only 81 exist"):
        generate_arithmetic(100, seed=0, digits_a=1, digits_b=1)
    with pytest.raises(ValueError, match="could not draw"):  # a >= b leaves only 45 questions
        generate_arithmetic(60, seed=0, kind="sub", digits_a=1, digits_b=1)
    with pytest.raises(ValueError, match="unknown arithmetic kind 'div'"):
        generate_arithmetic(5, seed=0, kind="div")
    with pytest.raises(ValueError, match=">= 1"):
        generate_arithmetic(5, seed=0, digits_a=0)


def test_template_and_reference_answers_score_one():
    exs = generate_arithmetic(20, seed=5, template="Compute {a}{op}{b}.")
    assert exs[0].prompt.startswith("Compute ")
    completions = [f"The answer is {e.answer}." for e in exs]
    assert correctness_reward([e.prompt for e in exs], completions, [e.answer for e in exs]) == [1.0] * 20


def test_example_and_messages():
    ex = Example("What is 2 + 2?", "4")
    assert ex.meta == {} and hash(ex) == hash(Example("What is 2 + 2?", "4", {"x": 1}))
    with pytest.raises(AttributeError):
        ex.answer = "5"
    assert build_messages(ex) == [{"role": "user", "content": "What is 2 + 2?"}]
    assert build_messages(ex, "Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_a_model_without_a_chat_template_gets_plain_prompts(tiny_model_dir):
    """A base model has no chat template: the question text itself (after the system prompt), as
    TRL does for plain prompts; a chat model gets its template."""
    from covey.models.load import load_tokenizer
    from covey.tasks.data import format_prompts
    tokenizer = load_tokenizer(tiny_model_dir)
    example = Example(prompt="What is 12 * 3?", answer="36")
    assert format_prompts(tokenizer, [example])[0] != example.prompt  # the tiny model's template applied
    tokenizer.chat_template = None
    assert format_prompts(tokenizer, [example]) == ["What is 12 * 3?"]
    assert format_prompts(tokenizer, [example], "Be brief.") == ["Be brief.\n\nWhat is 12 * 3?"]
