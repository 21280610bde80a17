"""The Python API: `covey.load_config` and `covey.train`, run as the README shows it."""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import covey
from covey.config import load_config
from covey.rewards.build import build_rewarder
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides

# The README's Python example (section "Python"), read from the README itself.
README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE = re.search(r"## Python\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)


def tiny_example(model_dir, out_dir) -> str:
    """The example with the tiny model and sizes appended to its overrides (its group size of 8 kept):
    one prompt per step, so the 8 samples of a step are all in samples.jsonl."""
    tiny = [o for o in tiny_overrides(model_dir, out_dir, **{"train.steps": 3, "rollout.prompts_per_step": 1,
                                                            "train.samples_every": 1})
            if not o.startswith("rollout.group_size=")]
    call = 'covey.load_config("grpo", ["train.steps=20", "rollout.group_size=8"])'
    assert call in EXAMPLE
    return EXAMPLE.replace(call, f'covey.load_config("grpo", ["train.steps=20", "rollout.group_size=8", *{tiny!r}])')


def test_the_readme_example_trains_with_a_python_reward(tiny_model_dir, tmp_path):
    printed = io.StringIO()
    scope = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(tiny_example(tiny_model_dir, tmp_path), "README example", "exec"), scope)
    result = scope["result"]
    assert result.run_dir == tmp_path / "t" and (result.run_dir / "metrics.jsonl").is_file()
    assert (result.final_model / "config.json").is_file() and result.steps == 3
    assert 0.0 <= result.accuracy_before <= 1.0 and 0.0 <= result.accuracy_after <= 1.0
    assert printed.getvalue().splitlines()[-1].startswith(f"{result.accuracy_before} {result.accuracy_after} "
                                                          f"{result.run_dir} {{")
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert result.metrics["reward/mean"] == steps[-1]["reward/mean"] and {"step", *result.metrics} == set(steps[-1])
    for row in steps:  # each step's 8 samples are logged: the metric is their mean brevity
        completions = [s["completion"] for s in samples if s["step"] == row["step"]]
        assert len(completions) == 8
        assert row["reward/brevity"] == pytest.approx(-sum(map(len, completions)) / len(completions) / 100, abs=1e-6)
        # added to the configured reward (correctness) with weight 1
        assert row["reward/mean"] == pytest.approx(row["reward/correctness"] + row["reward/brevity"], abs=1e-6)


def lengths_reward(prompts, completions, answer, completion_lengths, **columns):
    """Reads the columns by keyword, as TRL passes them."""
    assert len(prompts) == len(completions) == len(answer) == len(completion_lengths)
    return [float(n) for n in completion_lengths]


def quarter_lengths(completions, completion_lengths, **kwargs):
    return [float(n) for n in completion_lengths]


def test_reward_funcs_take_callables_and_weighted_strings_by_keyword():
    cfg = load_config(None, ["reward.functions=tests/training/test_api.py:quarter_lengths:0.25"])
    rewarder = build_rewarder(make_plan(cfg).rewards, extra=[lengths_reward, "tests.helpers:varied_reward:2"])
    assert [(t.name, t.weight) for t in rewarder.terms] == [  # named by the function, as TRL names them
        ("correctness", 1.0), ("quarter_lengths", 0.25), ("lengths_reward", 1.0), ("varied_reward", 2.0)]
    completions = ["The answer is 12.", "no idea"]
    scores = rewarder(["What is 3 * 4?"] * 2, completions, {"answer": ["12", "12"], "completion_lengths": [5, 3]})
    assert scores.parts["correctness"].tolist() == [1.0, 0.0] and scores.parts["lengths_reward"].tolist() == [5.0, 3.0]
    assert scores.parts["quarter_lengths"].tolist() == [5.0, 3.0]
    varied = [(sum(map(ord, c)) % 7) / 6 for c in completions]
    expected = [c + 0.25 * n + n + 2 * v for c, n, v in zip([1.0, 0.0], [5.0, 3.0], varied)]
    assert scores.total.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("funcs, message", [
    ([lengths_reward, lengths_reward], "reward function name 'lengths_reward' is given twice "
                                        "(metrics are named reward/<name>)"),
    ([3], "reward function 3 is neither a callable nor a 'module:function[:weight]' string"),
    (["tests.training.test_api:absent"],
     "reward function 'tests.training.test_api:absent': tests.training.test_api has no callable 'absent'"),
])
def test_unusable_reward_funcs_fail_in_one_line(funcs, message):
    with pytest.raises(ValueError) as err:
        build_rewarder(make_plan(load_config(None, [])).rewards, extra=funcs)
    assert str(err.value) == message


def test_covey_is_light_and_covey_train_is_one_function():
    """`import covey` loads no torch; covey.train is the function, whatever of the run's package (covey.training)
    is imported, by either form of import, and the step API is loop's."""
    code = ("import sys, types, covey; assert 'torch' not in sys.modules, 'import covey imported torch'; "
            "from covey.training import loop; import covey.training.setup; "
            "assert isinstance(covey.train, types.FunctionType) and covey.open_run is loop.open_run; "
            "assert covey.training.setup.open_engines and covey.training.loop is loop; "
            "print(covey.train.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "covey", done.stderr[-2000:]
    with pytest.raises(TypeError, match="covey.train and covey.open_run take the Config of covey.load_config"):
        covey.train("grpo")


def drop_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/peak_rss", "memory/rss"))}
            for r in rows]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_step_api_is_the_run_covey_train_makes(tiny_model_dir, tmp_path):
    """covey.train is open_run -> steps -> finish: driven by hand, the same two steps log the same
    numbers (timings aside), and finish saves and evaluates as train does."""
    overrides = tiny_overrides(tiny_model_dir, tmp_path / "a", **{"reward.functions": "tests.helpers:varied_reward"})
    whole = covey.train(load_config(None, overrides))
    session = covey.open_run(load_config(None, tiny_overrides(tiny_model_dir, tmp_path / "b", **{
        "reward.functions": "tests.helpers:varied_reward"})))
    yielded = list(covey.steps(session))
    stepped = covey.finish(session)
    assert [m["optim/grad_norm"] for m in yielded] == [r["optim/grad_norm"] for r in read_rows(whole.run_dir)[1:3]]
    assert drop_times(read_rows(stepped.run_dir)) == drop_times(read_rows(whole.run_dir))
    assert (stepped.steps, stepped.accuracy_before, stepped.accuracy_after) == (
        whole.steps, whole.accuracy_before, whole.accuracy_after)
    assert (stepped.final_model / "config.json").is_file()


def test_a_caller_stops_with_break_and_finish_keeps_the_step(tiny_model_dir, tmp_path):
    """`break` after step 1 of 3: finish checkpoints step 1 (a resume continues from it), logs the final
    line at step 1, and with evaluate=False / save=False measures and writes nothing more."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"train.steps": 3}))
    session = covey.open_run(cfg, evaluate_before=False)
    for metrics in covey.steps(session):
        assert session.run.step == 1 and metrics["time/step"] > 0
        break
    result = covey.finish(session, evaluate=False)
    assert result.steps == 1 and result.eval_before == {} and result.eval_after == {}
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step-000001"]
    assert [(r["step"], r.get("final")) for r in read_rows(result.run_dir)] == [(0, None), (1, None), (1, 1)]
    again = covey.open_run(load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "train.steps": 3, "train.resume": "auto"})), evaluate_before=False)
    assert again.run.step == 1  # resumed from the checkpoint finish wrote
    assert [again.run.step for _ in covey.steps(again)] == [2, 3]
    done = covey.finish(again, evaluate=False, save=False)
    assert done.final_model is None  # save=False: no checkpoint of step 3 and the first finish's final/ kept
    assert sorted(p.name for p in (done.run_dir / "checkpoints").iterdir()) == ["step-000001"]
