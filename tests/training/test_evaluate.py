"""Held-out evaluation (covey/training/evaluate.py): the replies it records and where answers fail,
and `covey eval --replies`."""

import json
from types import SimpleNamespace

import torch

from covey.cli.main import main
from covey.tasks.base import Example
from covey.training.evaluate import HeldOutOptions, Judge, evaluate, reply_breakdown

# Five held-out problems, each answered one way; the reference answer is 29 throughout.
REPLIES = [
    "Tom has 3 x 12 = 36 apples. He gives 7, so 36 - 7 = 29.\n#### 29",  # marked, right
    "Tom has 36 apples and gets 7 more: 36 + 7 = 43.\n#### 43",          # marked, wrong operation
    "Tom has 36 apples, gives 7 away and ends with 28",                  # no marker; last number 28, wrong
    "Tom has some apples and gives some away.",                          # no number at all
    "Tom has 3 x 12 = 36 apples. He gives 7, so 36 - 7 =",               # cut off; last number 7, wrong
]


class FixedEngine:
    """Answers the i-th prompt with REPLIES[i]; the last reply is reported as cut off."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, group_size, greedy, max_new_tokens):
        self.calls.append(len(prompts))
        first = int(prompts[0].split()[-1])
        texts = [REPLIES[first + i] for i in range(len(prompts))]
        return SimpleNamespace(completions=texts, example_index=list(range(len(prompts))),
                               truncated=torch.tensor([first + i == 4 for i in range(len(prompts))]))


def test_replies_are_recorded_with_how_each_answer_was_read():
    examples = [Example(prompt=f"problem {i}", answer="29") for i in range(5)]
    prompts = [e.prompt for e in examples]
    replies: list[dict] = []
    engine = FixedEngine()
    result = evaluate(engine, prompts, examples, HeldOutOptions(Judge("math"), 2, 64), replies=replies)
    assert engine.calls == [2, 2, 1]  # batches of 2: the records follow the batches in order
    assert result == {"eval/accuracy": 1 / 5, "eval/n": 5, "eval/truncated_frac": 1 / 5}  # reply 4 hit the limit
    assert [r["prompt"] for r in replies] == prompts and [r["reply"] for r in replies] == REPLIES
    assert [r["passed"] for r in replies] == [True, False, False, False, False]
    assert [r["marked"] for r in replies] == ["29", "43", None, None, None]
    assert [r["extracted"] for r in replies] == ["29", "43", "28", None, "7"]
    assert [r["truncated"] for r in replies] == [False, False, False, False, True]
    # 1 right; of the 4 wrong: 1 in the marked form (a reasoning error), 2 read from their last
    # number (no marker: format), 1 without a number; 1 of the 5 hit the token limit
    assert reply_breakdown(replies) == {"n": 5, "passed": 1, "wrong_marked": 1, "wrong_last_number": 2,
                                        "no_answer": 1, "truncated": 1}


def test_evaluate_without_replies_records_nothing():
    examples = [Example(prompt=f"problem {i}", answer="29") for i in range(2)]
    result = evaluate(FixedEngine(), [e.prompt for e in examples], examples, HeldOutOptions(Judge("math"), 8, 64))
    assert result == {"eval/accuracy": 0.5, "eval/n": 2, "eval/truncated_frac": 0.0}


def test_covey_eval_writes_the_replies_and_prints_the_breakdown(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "out" / "replies.jsonl"
    assert main(["eval", "--model", str(tiny_model_dir), "--replies", str(path), "task.eval_size=4",
                 "task.train_size=16", "rollout.eval_max_new_tokens=4"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and all(set(r) == {"prompt", "answer", "reply", "passed", "value", "truncated",
                                             "marked", "extracted"} for r in rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith(f"replies: {path}; n 4, passed ")
    assert json.loads(lines[-1])["eval/accuracy"] == sum(r["passed"] for r in rows) / 4


def test_eval_before_cache_file_keeps_entries_and_survives_a_bad_file(tmp_path):
    from covey.training.evaluate import read_cached_eval, settings_key, write_cached_eval
    path = tmp_path / "cache" / "eval-before.json"
    a, b = settings_key({"task": {"eval_size": 4}}), settings_key({"task": {"eval_size": 5}})
    assert a != b and a == settings_key({"task": {"eval_size": 4}})
    assert read_cached_eval(path, a) is None  # no file yet
    write_cached_eval(path, a, {"eval/accuracy": 0.25, "eval/n": 4, "time/eval": 3.0}, {"task": {"eval_size": 4}})
    write_cached_eval(path, b, {"eval/accuracy": 0.4, "eval/n": 5}, {"task": {"eval_size": 5}})
    assert read_cached_eval(path, a) == {"eval/accuracy": 0.25, "eval/n": 4}  # eval/ figures only
    assert read_cached_eval(path, b) == {"eval/accuracy": 0.4, "eval/n": 5}
    assert [p.name for p in path.parent.iterdir()] == ["eval-before.json"]  # no temporary file left
    path.write_text("{not json")  # a damaged file: evaluate again, then replace it
    assert read_cached_eval(path, a) is None
    write_cached_eval(path, a, {"eval/accuracy": 0.25, "eval/n": 4}, {})
    assert read_cached_eval(path, a) == {"eval/accuracy": 0.25, "eval/n": 4}


def test_runs_with_the_same_eval_settings_share_the_untrained_evaluation(tiny_model_dir, tmp_path, capsys):
    """Another algorithm with the same model, task and evaluation settings reads the figures (equal to
    those it would compute itself); a different held-out size evaluates anew."""
    import covey
    from covey.config import load_config
    from tests.helpers import tiny_overrides
    cache = tmp_path / "eval-before.json"

    def before(preset, name, *extra, cached=True):
        keys = tiny_overrides(tiny_model_dir, tmp_path, **{"train.steps": 1, "train.run_name": name})
        keys += ["eval.metric=reward", "reward.functions=tests.helpers:varied_reward:1", *extra]
        keys += [f"train.eval_before_cache={cache}"] if cached else []
        result = covey.train(load_config(preset, keys))
        return result.eval_before, capsys.readouterr().out

    first, out = before("grpo", "a")
    assert "evaluated earlier" not in out and 0 < first["eval/reward_mean"] < 1
    shared, out = before("rloo", "b", "algo.beta=0.1")
    assert "evaluated earlier with the same settings" in out and shared == {k: first[k] for k in shared}
    own, _ = before("rloo", "c", "algo.beta=0.1", cached=False)
    assert own["eval/reward_mean"] == shared["eval/reward_mean"] and own["eval/n"] == shared["eval/n"]
    other, out = before("grpo", "d", "task.eval_size=3")
    assert "evaluated earlier" not in out and other["eval/n"] == 3
    assert len(json.loads(cache.read_text())) == 2
    cache = tmp_path  # a folder: nothing to read or write there; the run evaluates, warns and trains on
    _, out = before("grpo", "e")
    assert f"train.eval_before_cache: cannot write {tmp_path}" in out
