"""`covey compare` orchestration: budgets, per-run arguments, skip / resume / restart, and a real
resumed comparison on the tiny model (each run in its own process, as `covey compare` runs it)."""

import json

import pytest

from covey.cli.main import main
from covey.config import ConfigError
from covey.report.compare import budget_overrides, run_compare, run_status, subprocess_runner, train_argv
from covey.report.report import FIGURES
from covey.report.spec import Budget, CompareSpec, parse_budget
from tests.helpers import tiny_overrides
from tests.report.report_fixtures import assert_valid_png, write_run


def spec(tmp_path, **kw) -> CompareSpec:
    base = dict(name="t", algos=["grpo", "ppo"], seeds=[0, 1], budget=Budget("steps", 4),
                overrides=["model.path=tiny"], output_dir=str(tmp_path))
    base.update(kw)
    return CompareSpec(**base)


@pytest.mark.parametrize("text, expected", [("steps=10", Budget("steps", 10)), ("samples=64", Budget("samples", 64)),
                                            ("minutes=2.5", Budget("minutes", 2.5))])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["steps", "hours=3", "steps=0", "steps=2.5", "samples=x"])
def test_parse_budget_rejects(text):
    with pytest.raises(ConfigError, match="--budget"):
        parse_budget(text)


def test_budget_becomes_steps_or_minutes():
    assert budget_overrides(Budget("steps", 7), "grpo", []) == ["train.steps=7", "train.max_minutes=0"]
    # compare defaults: 4 prompts x 4 samples = 16 sequences per step; 40 samples -> 2 steps
    assert budget_overrides(Budget("samples", 40), "grpo", []) == ["train.steps=2", "train.max_minutes=0"]
    assert budget_overrides(Budget("samples", 40), "grpo", ["rollout.group_size=2"]) == ["train.steps=5",
                                                                                         "train.max_minutes=0"]
    assert budget_overrides(Budget("minutes", 3), "ppo", []) == ["train.steps=1000000", "train.max_minutes=3"]


def test_train_argv_order_and_dpo_has_no_gradient_measurement(tmp_path):
    argv = train_argv(spec(tmp_path, overrides=["rollout.group_size=2"]), "grpo", 1)
    assert argv[:2] == ["train", "grpo"]  # a preset by name: works from an installed package
    # user overrides come after the compare defaults, managed keys last (later wins)
    assert argv.index("rollout.group_size=2") > argv.index("rollout.group_size=4")
    assert argv[-2:] == ["train.steps=4", "train.max_minutes=0"]
    assert "train.seed=1" in argv and "train.resume=auto" in argv
    assert f"train.output_dir={tmp_path}/compare-t" in argv and "train.run_name=grpo-s1" in argv
    assert f"train.eval_before_cache={tmp_path}/compare-t/eval-before.json" in argv  # one file for all runs
    assert "train.grad_var_every=2" in argv
    assert not any(a.startswith("train.grad_var_every") for a in train_argv(spec(tmp_path), "dpo_iterative", 0))


def test_bad_requests_fail_before_any_run(tmp_path, capsys):
    calls = []
    for bad in (spec(tmp_path, overrides=["train.steps=3"]), spec(tmp_path, overrides=["steps=3"]),
                spec(tmp_path, algos=["grpo", "nope"]), spec(tmp_path, overrides=["algo.beta=x"])):
        with pytest.raises(ConfigError):
            run_compare(bad, runner=lambda argv, log: calls.append(argv) or 0)
    assert calls == []
    assert main(["compare", "--algos", "grpo,grpo"]) == 2
    assert "without repeats" in capsys.readouterr().err


def fake_runner(calls, fail=()):
    """Writes a finished synthetic run instead of training; `fail` names runs that exit 1."""
    def run(argv, log_path):
        values = dict(a.split("=", 1) for a in argv[2:])
        calls.append(values)
        name = values["train.run_name"]
        if name in fail:
            return 1
        algo, seed = name.rsplit("-s", 1)
        write_run(log_path.parent, algo, int(seed), steps=int(values["train.steps"]))
        return 0
    return run


def test_run_compare_skips_finished_resumes_checkpointed_and_restarts_the_rest(tmp_path):
    s = spec(tmp_path)
    root = s.root
    write_run(root, "grpo", 0)                       # finished: skipped
    write_run(root, "ppo", 0, finished=False)        # checkpointed: resumed (its log is kept)
    (root / "ppo-s0" / "checkpoints" / "step-000002").mkdir(parents=True)
    write_run(root, "grpo", 1, finished=False)       # no checkpoint: its stale log is removed first
    assert [run_status(root / n) for n in ("grpo-s0", "ppo-s0", "grpo-s1", "ppo-s1")] == \
        ["done", "resume", "fresh", "fresh"]
    calls = []
    out = run_compare(s, runner=fake_runner(calls, fail={"ppo-s1"}))
    assert [c["train.run_name"] for c in calls] == ["ppo-s0", "grpo-s1", "ppo-s1"]
    assert out["failed"] == ["ppo-s1"] and out["report"].is_file()
    recorded = json.loads((root / "compare.json").read_text())
    assert recorded["budget"] == "steps=4" and recorded["algos"] == ["grpo", "ppo"]
    with pytest.raises(ConfigError, match="started with budget"):
        run_compare(spec(tmp_path, budget=Budget("steps", 5)), runner=fake_runner([]))


def varied_reward(prompts, completions, **kwargs):
    """Scores that differ within a group on a random model (so advantages and pairs are not all zero)."""
    return [float(len(c) % 3) for c in completions]


def test_real_compare_on_tiny_model_resumes_and_reports(tiny_model_dir, tmp_path):
    overrides = [o for o in tiny_overrides(tiny_model_dir, tmp_path, **{"rollout.group_size": 4})
                 if not o.startswith(("train.", "model.path"))]
    overrides += [f"model.path={tiny_model_dir}", "reward.functions=tests.report.test_compare:varied_reward:1",
                  "task.eval_size=4"]
    s = spec(tmp_path, algos=["grpo", "dpo_iterative"], seeds=[0], budget=Budget("steps", 2), overrides=overrides)

    def crash_after_first_step(argv, log_path):
        """First attempt: train 1 step (checkpointed), then lose the final evaluation as a crash would.
        Each run is its own process, as in `covey compare`: no state leaks between runs or from other tests."""
        code = subprocess_runner(argv + ["train.steps=1"], log_path)
        metrics = log_path.with_suffix("") / "metrics.jsonl"
        rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("final") != 1]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert code == 0, log_path.read_text()[-3000:]
        return 1  # the crash: compare keeps the checkpoints of a failed run

    assert run_compare(s, runner=crash_after_first_step, report=False)["failed"] == ["grpo-s0", "dpo_iterative-s0"]
    assert run_status(s.root / "grpo-s0") == "resume"
    first_step = (s.root / "grpo-s0" / "metrics.jsonl").read_text().splitlines()[1]
    out = run_compare(s)
    assert out["failed"] == []
    lines = (s.root / "grpo-s0" / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == first_step  # the step-1 line (with its wall times) is the crashed attempt's: resumed
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert sum(1 for r in rows if r["step"] == 0) == 1 and rows[-1]["final"] == 1
    assert any(r.get("policy/grad_var") is not None for r in rows)          # measured at step 2
    assert rows[-1]["step"] == 2 and "time/elapsed" in rows[-2]
    assert not (s.root / "grpo-s0" / "checkpoints").exists()  # deleted once the run finished
    # the untrained model was evaluated once for the seed: the DPO run read grpo's figures
    assert len(json.loads((s.root / "eval-before.json").read_text())) == 1
    assert "evaluated earlier with the same settings" in (s.root / "dpo_iterative-s0.log").read_text()
    dpo_rows = [json.loads(line) for line in (s.root / "dpo_iterative-s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/accuracy"] for r in dpo_rows if r["step"] == 0] == [rows[0]["eval/accuracy"]]
    for name in FIGURES:
        assert_valid_png(s.root / name)
    text = out["report"].read_text()
    assert "| grpo | 1/1 |" in text and "| dpo_iterative | 1/1 |" in text
    # every claim compares algorithms of which at least one did not run here (ppo, reinforce_pp, dapo, ...)
    assert "None of the claims is about algorithms that all ran" in text
    assert "Claims about an algorithm this comparison did not run: 16 (" in text
