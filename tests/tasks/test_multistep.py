"""Multi-step arithmetic: generation, reference solutions and exact step labels."""

import pytest

from covey.rewards.rules import correctness_reward
from covey.tasks import Example, generate_multistep, label_steps, multistep_splits, split_steps
from covey.tasks.multistep import CORRUPTIONS, corrupt_solution, reference_steps, step_categories

# Start 12, +7, *3, -5: reference "12 + 7 = 19", "19 * 3 = 57", "57 - 5 = 52".
EX = Example("Start with 12. Add 7, then multiply by 3, then subtract 5.", "52",
             {"start": 12, "ops": [["+", 7], ["*", 3], ["-", 5]]})


def test_reference_steps():
    assert reference_steps(12, [["+", 7], ["*", 3], ["-", 5]]) == ["12 + 7 = 19", "19 * 3 = 57", "57 - 5 = 52"]


def test_generation_is_deterministic_valid_and_bounded():
    exs = generate_multistep(300, seed=0)
    assert exs == generate_multistep(300, seed=0) and exs != generate_multistep(300, seed=1)
    assert len({e.prompt for e in exs}) == 300
    for e in exs:
        ops = e.meta["ops"]
        assert 2 <= len(ops) <= 4 and 10 <= e.meta["start"] <= 99
        lines = e.meta["solution"].split("\n")
        assert lines == reference_steps(e.meta["start"], ops)
        values = [int(line.rsplit("=", 1)[1]) for line in lines]
        assert all(0 <= v <= 999 for v in values) and str(values[-1]) == e.answer


def test_splits_disjoint_and_options():
    train, held = multistep_splits(200, 50, seed=3, min_ops=3, max_ops=3, ops=("+", "-"))
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert all(len(e.meta["ops"]) == 3 and {op for op, _ in e.meta["ops"]} <= {"+", "-"} for e in train)
    assert multistep_splits(10, 50, seed=3, min_ops=3, max_ops=3, ops=("+", "-"))[1] == held
    with pytest.raises(TypeError, match="n_steps"):
        multistep_splits(1, 1, seed=0, n_steps=3)
    with pytest.raises(ValueError, match="min_ops <= max_ops"):
        generate_multistep(1, seed=0, min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="ops must be drawn"):
        generate_multistep(1, seed=0, ops=("/",))


def test_reference_solution_is_all_correct_and_scores_one():
    for e in generate_multistep(50, seed=2):
        completion = e.meta["solution"] + f"\nAnswer: {e.answer}"
        steps, labels = label_steps(e, completion)
        assert labels == [1] * len(steps) and len(steps) == len(e.meta["ops"]) + 1
        assert correctness_reward([e.prompt], [completion], [e.answer]) == [1.0]


@pytest.mark.parametrize("completion,labels", [
    ("12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52\nAnswer: 52", [1, 1, 1, 1]),
    ("12 + 7 = 20\n20 * 3 = 60\n60 - 5 = 55\nAnswer: 55", [0, 0, 0, 0]),  # error propagates
    ("12 + 7 = 20\n19 * 3 = 57\n57 - 5 = 52\nAnswer: 52", [0, 1, 1, 1]),  # restated right value
    ("12 + 7 = 19\n19 * 4 = 76\n76 - 5 = 71", [1, 0, 0]),                  # wrong operand
    ("12 + 7 = 19\n19 * 3 = 57", [1, 0]),                   # right, but it stops before the last step
    ("12 + 7 = 19\n19 * 3 = 57\n\n", [1, 0]),               # ... also with trailing blank lines
    ("12 - 7 = 5\n5 * 3 = 15", [0, 0]),                                    # wrong operator
    ("Let's compute.\n12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52", [0, 1, 1, 1]),  # chatter scores 0
    ("Step 1: 12 + 7 = 19\n2. 19 × 3 = 57\n57 − 5 = 52.", [1, 1, 1]),       # prefixes, ×, unicode minus
    ("12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52\n52 + 1 = 53\nAnswer: 53", [1, 1, 1, 0, 0]),  # extra step
    ("Answer: 52", [1]),                                                     # final answer only
    ("Answer: 52\nbye", [0, 0]),                                             # answer not last
    ("", []),
])
def test_label_steps(completion, labels):
    steps, got = label_steps(EX, completion)
    assert got == labels and len(steps) == len(labels)


def test_custom_separator_and_split():
    assert split_steps("a\n\n b \n") == ["a", "b"]
    steps, labels = label_steps(EX, "12 + 7 = 19; 19 * 3 = 57; 57 - 5 = 50", separator=";")
    assert steps == ["12 + 7 = 19", "19 * 3 = 57", "57 - 5 = 50"] and labels == [1, 1, 0]


def test_labels_work_on_meta_read_back_from_json():
    import json

    e = generate_multistep(1, seed=9)[0]
    row = json.loads(json.dumps({"prompt": e.prompt, "answer": e.answer, **e.meta}))
    back = Example(row.pop("prompt"), row.pop("answer"), row)
    assert label_steps(back, e.meta["solution"])[1] == [1] * len(e.meta["ops"])


class ScriptedRng:
    """randrange -> the step k, choice -> the last item (sign +1, last other operator), randint -> n."""

    def __init__(self, k, n):
        self.k, self.n = k, n

    def randrange(self, *_):
        return self.k

    def choice(self, seq):
        return list(seq)[-1]

    def randint(self, lo, hi):
        return self.n


@pytest.mark.parametrize("kind,k,n,lines,labels", [
    # step 2 result 57 + 4 -> 61; 61 - 5 = 56 follows from it
    ("result", 1, 4, ["12 + 7 = 19", "19 * 3 = 61", "61 - 5 = 56", "Answer: 56"], [1, 0, 0, 0]),
    # step 1 operand 7 misread as 7 + 2 = 9: 12 + 9 = 21, 21 * 3 = 63, 63 - 5 = 58
    ("operand", 0, 2, ["12 + 9 = 21", "21 * 3 = 63", "63 - 5 = 58", "Answer: 58"], [0, 0, 0, 0]),
    # step 3 '-' replaced by the last other operator '*': 57 * 5 = 285
    ("operator", 2, 1, ["12 + 7 = 19", "19 * 3 = 57", "57 * 5 = 285", "Answer: 285"], [1, 1, 0, 0]),
    # step 2 reads 19 + 2 = 21 instead of 19: 21 * 3 = 63, 63 - 5 = 58
    ("carry", 1, 2, ["12 + 7 = 19", "21 * 3 = 63", "63 - 5 = 58", "Answer: 58"], [1, 0, 0, 0]),
    # step 1 replaced by 3 * 3 = 9 (operands = n, operator = the last of + - *): 9 * 3 = 27, 27 - 5 = 22
    ("unrelated", 0, 3, ["3 * 3 = 9", "9 * 3 = 27", "27 - 5 = 22", "Answer: 22"], [0, 0, 0, 0]),
    # the first k = 2 reference steps, then nothing: the last of them ends the text too early
    ("stopped", 2, 0, ["12 + 7 = 19", "19 * 3 = 57"], [1, 0]),
])
def test_corrupt_solution_by_hand(kind, k, n, lines, labels):
    text = corrupt_solution(EX, ScriptedRng(k, n), kind)
    assert text.split("\n") == lines
    assert label_steps(EX, text)[1] == labels


def test_corrupt_solution_first_error_is_labelled_and_later_steps_follow_it():
    import random
    for i, ex in enumerate(generate_multistep(60, seed=4)):
        kind = CORRUPTIONS[i % len(CORRUPTIONS)]
        text = corrupt_solution(ex, random.Random(i), kind)
        labels = label_steps(ex, text)[1]
        k = labels.index(0)  # an error was injected
        assert labels[:k] == [1] * k
        assert step_categories(ex, text)[k] == f"first_error:{kind}"  # the breakdown names what was injected
        values = [int(line.rsplit("=", 1)[1]) for line in text.split("\n")[:-1]]
        for line, before in zip(text.split("\n")[k + 1:-1], values[k:]):
            assert int(line.split()[0]) == before  # every later step starts from the previous result
    one_step = generate_multistep(1, seed=3, min_ops=1, max_ops=1)[0]
    text = corrupt_solution(one_step, random.Random(0), "stopped")  # nothing to stop before: a wrong result
    assert label_steps(one_step, text)[1] == [0, 0] and step_categories(one_step, text)[0] == "first_error:result"
    with pytest.raises(ValueError, match="unknown corruption 'typo'"):
        corrupt_solution(EX, random.Random(0), "typo")


@pytest.mark.parametrize("completion,categories", [
    ("12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52\nAnswer: 52", ["correct"] * 4),
    ("12 + 7 = 19\n19 * 3 = 61\n61 - 5 = 56\nAnswer: 56",
     ["correct", "first_error:result", "after_error", "after_error"]),
    ("12 + 7 = 19\n21 * 3 = 63", ["correct", "first_error:carry"]),     # 21 is not the previous 19
    ("12 * 7 = 84\n84 * 3 = 252", ["first_error:operator", "after_error"]),
    ("12 + 8 = 20", ["first_error:operand"]),
    ("2 + 3 = 5", ["first_error:unrelated"]),                             # both operands wrong
    ("13 + 8 = 21", ["first_error:unrelated"]),
    ("I think\n12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52",
     ["first_error:other"] + ["correct"] * 3),                             # chatter, then right steps
    ("12 + 7 = 19\n19 * 3 = 57", ["correct", "first_error:stopped"]),      # ends before the last step
    ("12 + 7 = 19\n19 * 3 = 57\n57 - 5 = 52\n52 + 1 = 53", ["correct"] * 3 + ["first_error:other"]),  # extra step
])
def test_step_categories(completion, categories):
    assert step_categories(EX, completion) == categories


def test_task_config_sets_the_multistep_difficulty():
    from covey.config import load_config
    from covey.tasks.data import load_task_data
    base = ["task.name=multistep", "task.train_size=40", "task.eval_size=20"]
    # the defaults draw exactly the problems of multistep_splits' own defaults (saved PRM data stays valid)
    assert load_task_data(load_config(None, base).task, seed=0).eval == multistep_splits(40, 20, seed=0)[1]
    data = load_task_data(load_config(None, [*base, "task.min_ops=2", "task.max_ops=2", "task.ops=+",
                                             "task.operand_max=5"]).task, seed=0)
    for e in data.train + data.eval:
        assert [op for op, _ in e.meta["ops"]] == ["+", "+"] and all(2 <= y <= 5 for _, y in e.meta["ops"])
    small = load_task_data(load_config(None, [*base, "task.start_digits=1", "task.max_value=9", "task.ops=+-",
                                              "task.multistep_template=From {start}: {steps}."]).task, seed=0)
    for e in small.train + small.eval:
        values = [int(line.rsplit("=", 1)[1]) for line in e.meta["solution"].split("\n")]
        assert 1 <= e.meta["start"] <= 9 and all(0 <= v <= 9 for v in values)
        assert e.prompt.startswith(f"From {e.meta['start']}: ")


def test_draw_redraws_the_operand_until_an_operation_stays_in_bounds():
    # From 9 with only + and a bound of 12, operands 4..9 would leave the range: they are redrawn.
    for seed in range(20):
        for e in generate_multistep(30, seed, start_digits=1, max_value=12, ops=("+",), min_ops=1, max_ops=1):
            assert e.meta["start"] + e.meta["ops"][0][1] <= 12
    # Starts 5..9 with only * and a bound of 9: no operand 2..9 fits: a clear error, not a loop or an overflow.
    with pytest.raises(ValueError, match="no operation of '\\*' keeps"):
        generate_multistep(50, 0, start_digits=1, max_value=9, ops=("*",), min_ops=1, max_ops=1)
