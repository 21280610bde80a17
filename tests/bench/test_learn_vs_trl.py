"""The learning comparison's pure parts (bench/): covey's config as TRL settings, the stop and
evaluation schedule, and the report's verdicts on hand-made numbers."""

import math

import pytest

from bench.learn import learn_summary, markdown, spread_verdict
from bench.trl_side import trl_grpo_kwargs
from bench.workloads import Schedule
from covey.config import load_config


def test_covey_defaults_map_to_the_same_trl_update():
    # covey train = grpo preset: B=8 prompts x G=8 samples, micro-batches of 8 -> 8 accumulation steps,
    # so TRL's generation batch (8 x 8 = 64 = B*G) is one optimizer step
    kw = trl_grpo_kwargs(load_config("grpo", ["train.seed=3"]))
    assert kw["num_generations"] == 8 and kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 64
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["num_iterations"]) == (8, 8, 1)
    assert kw["loss_type"] == "grpo"  # seq_mean_token_mean: mean over sequences of token means
    assert (kw["beta"], kw["use_bias_correction_kl"], kw["scale_rewards"]) == (0.04, False, "group")
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.2, 0.2)
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (1e-5, "constant", 0)
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["weight_decay"], kw["max_grad_norm"]) == (0.9, 0.99, 0.0, 1.0)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["max_completion_length"]) == (0.7, 1.0, 0, 32)
    assert (kw["seed"], kw["gradient_checkpointing"], kw["bf16"]) == (3, False, False)


def test_other_aggregations_and_settings_follow_the_config():
    kw = trl_grpo_kwargs(load_config("dr_grpo", ["optim.warmup_steps=5", "rollout.temperature=1.0"]),
                         micro_batch=16, autocast_bf16=True)
    assert (kw["loss_type"], kw["scale_rewards"]) == ("dr_grpo", "none")  # constant, no std division
    assert (kw["lr_scheduler_type"], kw["warmup_steps"], kw["temperature"], kw["bf16"]) == (
        "constant_with_warmup", 5, 1.0, True)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (16, 4)
    assert trl_grpo_kwargs(load_config("grpo", ["algo.loss_agg=token_mean"]))["loss_type"] == "dapo"
    assert trl_grpo_kwargs(load_config("grpo", ["algo.kl_in=none"]))["beta"] == 0.0


@pytest.mark.parametrize("preset, overrides, key", [
    ("rloo", [], "algo.estimator"),
    ("grpo", ["algo.loss_agg=seq_mean_token_sum"], "algo.loss_agg"),
    ("grpo", ["algo.epochs=2"], "algo.epochs"),
    ("grpo", ["reward.format=0.5"], "reward.format"),
    ("grpo", ["algo.kl_estimator=k1"], "algo.kl_estimator"),
])
def test_settings_trl_cannot_reproduce_are_refused_by_name(preset, overrides, key):
    with pytest.raises(ValueError, match=key):
        trl_grpo_kwargs(load_config(preset, overrides))


def test_a_micro_batch_must_divide_the_step():
    kw = trl_grpo_kwargs(load_config("grpo", ["rollout.prompts_per_step=2", "rollout.group_size=4"]))
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (8, 1)
    with pytest.raises(ValueError, match="does not divide"):
        trl_grpo_kwargs(load_config("grpo"), micro_batch=24)  # 64 samples


def simulate(schedule: Schedule, step_s: float) -> dict[int, list[str]]:
    """Steps of `step_s` seconds until the schedule stops: step -> tags of the evaluated steps."""
    evaluated, step, seconds = {}, 0, 0.0
    while True:
        step, before = step + 1, seconds
        seconds += step_s
        tags = schedule.tags(step, seconds, before)
        if tags:
            evaluated[step] = tags
        if schedule.done(step, seconds):
            return evaluated


def test_a_slow_trainer_runs_to_the_step_count_and_marks_the_minutes_on_the_way():
    # 50 s/step, 30 steps and 12 minutes: 720 s is passed at step 15 (700 < 720 <= 750);
    # step 30 is at 1500 s, past both limits, so the run ends there
    ev = simulate(Schedule(steps=30, minutes=12, eval_every=10), 50.0)
    assert ev == {10: ["every"], 15: ["minutes"], 20: ["every"], 30: ["every", "steps", "final"]}


def test_a_fast_trainer_runs_past_the_step_count_to_the_minutes():
    # 12.5 s/step: step 30 at 375 s < 720 s, so the run goes on to step 58 (712.5 < 720 <= 725)
    ev = simulate(Schedule(steps=30, minutes=12, eval_every=10), 12.5)
    assert sorted(ev) == [10, 20, 30, 40, 50, 58]
    assert ev[30] == ["every", "steps"] and ev[58] == ["minutes", "final"]


def test_without_a_time_budget_the_run_stops_at_the_step_count():
    assert simulate(Schedule(steps=5, minutes=0, eval_every=0), 1.0) == {5: ["steps", "final"]}


def run(trainer, seed, accs, mark_step):
    """A hand-made run: step 0, 10, 20, 30 with accuracies `accs`; the minutes mark at `mark_step`."""
    points = [{"step": s, "samples": 64 * s, "minutes": s / 2, "accuracy": a, "n": 200,
               "tags": (["base"] if s == 0 else ["every"]) + (["steps"] if s == 30 else [])
               + (["minutes"] if s == mark_step else [])} for s, a in zip((0, 10, 20, 30), accs)]
    return {"trainer": trainer, "seed": seed, "points": points, "steps": [{"step": 30, "step_s": 12.0}]}


def test_overlapping_seed_ranges_are_within_the_spread():
    # covey 0.40 and 0.44 (mean 0.42), TRL 0.36 and 0.41 (mean 0.385): the ranges share 0.40..0.41
    trl = {"mean": 0.385, "low": 0.36, "high": 0.41, "seeds": {0: 0.36, 1: 0.41}}
    v = spread_verdict({"mean": 0.42, "low": 0.40, "high": 0.44, "seeds": {0: 0.40, 1: 0.44}}, trl)
    assert v["within_spread"] and v["higher"] == "covey" and v["difference"] == pytest.approx(0.035)
    assert v["paired"] == {0: pytest.approx(0.04), 1: pytest.approx(0.03)}
    # covey 0.45 and 0.47 against the same TRL seeds: every covey seed above every TRL seed
    v = spread_verdict({"mean": 0.46, "low": 0.45, "high": 0.47, "seeds": {0: 0.45, 1: 0.47}}, trl)
    assert not v["within_spread"] and v["higher"] == "covey"


def test_the_summary_reads_each_view_at_its_tagged_point():
    runs = [run("covey", 0, (0.18, 0.30, 0.36, 0.40), 20), run("covey", 1, (0.18, 0.28, 0.38, 0.44), 30),
            run("trl", 0, (0.18, 0.25, 0.31, 0.36), 10), run("trl", 1, (0.18, 0.27, 0.33, 0.41), 10)]
    s = learn_summary(runs)
    # per-sample view at step 30: covey 0.40/0.44 vs TRL 0.36/0.41 -> overlapping, covey +3.5 points
    assert s["steps"]["covey"]["mean"] == pytest.approx(0.42) and s["steps"]["trl"]["mean"] == pytest.approx(0.385)
    assert s["steps"]["verdict"]["within_spread"]
    assert s["steps"]["verdict"]["paired"] == {0: pytest.approx(0.04), 1: pytest.approx(0.03)}
    # wall-clock view: covey's mark at steps 20 and 30 (0.36, 0.44), TRL's at step 10 (0.25, 0.27)
    assert s["minutes"]["covey"]["seeds"] == {0: 0.36, 1: 0.44} and s["minutes"]["covey"]["step"] == {0: 20, 1: 30}
    assert s["minutes"]["verdict"]["higher"] == "covey" and not s["minutes"]["verdict"]["within_spread"]
    # standard error at p = (0.42 + 0.385) / 2 on 200 problems
    assert s["steps"]["binomial_se"] == pytest.approx(math.sqrt(0.4025 * 0.5975 / 200))
    text = markdown(runs, s, "header", 30, 12)
    assert "within the seeds' spread of each other" in text and "covey is higher in every seed" in text
    assert "per seed, on the same problems: +4.0, +3.0 points" in text
    assert "| covey | 18.0%, 18.0% | 42.0% (40.0%, 44.0%) | 40.0% (36.0%, 44.0%) | 20/30 | 12.0 | 30/30 |" in text


def test_a_time_cap_ends_the_run_short_of_the_step_count():
    # 50 s/step with a 2-minute cap: 100 s after step 2 < 120 s <= 150 s after step 3, so step 3 is the
    # last (not the 30 steps nor the 12 minutes); it is evaluated as the final point, tagged nothing else
    assert simulate(Schedule(steps=30, minutes=12, eval_every=10, max_minutes=2), 50.0) == {3: ["final"]}
    # a cap past both limits changes nothing: the run ends at step 30 (1500 s)
    assert sorted(simulate(Schedule(steps=30, minutes=12, eval_every=10, max_minutes=60), 50.0)) == [10, 15, 20, 30]


def test_the_learning_driver_puts_both_trainers_on_the_device_it_is_given():
    from bench.learn import base_overrides, parse_args
    assert base_overrides(parse_args([])[0])[0] == "train.device=cpu"  # the CPU, as before
    args, trainers = parse_args(["--device", "cuda", "--max-minutes", "1.5", "algo.ddof=1"])
    assert base_overrides(args) == ["train.device=cuda", "algo.ddof=1"] and args.max_minutes == 1.5
    assert trainers == ["covey", "trl"] and parse_args(["--smoke", "--steps", "5"])[0].steps == 5
