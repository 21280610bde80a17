"""The compare report on synthetic run folders with known numbers: figures, tables, verdicts."""

import math

import pytest

from covey.cli.main import main
from covey.report.claims import INCONCLUSIVE, NOT_MEASURED, NOT_SUPPORTED, SUPPORTED, evaluate_claims, t_critical, welch
from covey.report.data import Stat, group_by_algo, load_runs, run_summary
from covey.report.report import FIGURES, build_report
from tests.report.report_fixtures import assert_valid_png, write_run

PPO_ROLES = {"actor": 500.0, "reference": 500.0, "critic": 480.0, "optimizer": 1960.0}


def four_algos(root, seeds=(0, 1, 2), ppo_time=20.0, rpp_time=10.0):
    for s in seeds:
        write_run(root, "grpo", s, acc=(0.2, 0.40 + 0.01 * s), sec_per_step=10, jitter=0.5)
        write_run(root, "ppo", s, acc=(0.2, 0.25 + 0.01 * s), sec_per_step=ppo_time, roles=PPO_ROLES,
                  peak_rss=2600, grad_noise=0.8, jitter=0.5)
        write_run(root, "reinforce_pp", s, sec_per_step=rpp_time, jitter=0.5)
        write_run(root, "dpo_iterative", s, acc=(0.2, 0.3 + 0.02 * s), sec_per_step=9, grad_noise=None,
                  jitter=0.5)


def verdicts(root) -> dict:
    return {c.text: v for c, v in evaluate_claims(group_by_algo(load_runs(root)))}


def find(table: dict, start: str):
    return next(v for text, v in table.items() if text.startswith(start))


def test_report_and_every_figure_written(tmp_path):
    four_algos(tmp_path)
    report = build_report(tmp_path)
    for name in FIGURES:
        assert_valid_png(tmp_path / name)
    text = report.read_text()
    for name in FIGURES:
        assert f"({name})" in text
    for algo in ("grpo", "ppo", "reinforce_pp", "dpo_iterative"):
        assert f"| {algo} | 3/3 |" in text
    claims = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(claims) == 9  # the claims about these four; the 7 about dapo, cispo and gspo are only counted
    assert "Claims about an algorithm this comparison did not run: 7 (" in text


def test_the_loss_claims(tmp_path):
    # grpo, dapo, cispo, gspo x 3 seeds of 6 steps. Entropy per step: grpo 1.0 - 0.01 s, dapo 1.5 - 0.01 s
    # (the same spread, 0.5 higher: Welch t large, supported). Clip fraction: grpo 0.02 and gspo 0.2 on
    # every step (no spread on either side: t = +inf, supported). Accuracy gain: every run 0.3 - 0.2 = 0.1
    # but cispo's 0.2 + 0.02 s - 0.2 (0, 2, 4 pts): cispo 2 +- 2 pts against dapo's and grpo's 10 +- 0,
    # t = (2 - 10) / sqrt(4/3) = -6.93 at df = 2 (critical 4.30): significant the other way, not supported.
    # Reward changes are 0.1 a step everywhere: gspo's fluctuation equals grpo's, no spread: t = 0, inconclusive.
    for s in range(3):
        write_run(tmp_path, "grpo", s)
        write_run(tmp_path, "dapo", s, entropy=1.5)
        write_run(tmp_path, "cispo", s, acc=(0.2, 0.2 + 0.02 * s))
        write_run(tmp_path, "gspo", s, clipfrac=0.2)
    table = verdicts(tmp_path)
    assert find(table, "Clip-higher keeps").verdict == SUPPORTED
    assert find(table, "GSPO clips a far larger share").verdict == SUPPORTED
    assert find(table, "CISPO learns faster than DAPO").verdict == NOT_SUPPORTED
    assert find(table, "CISPO learns faster than GRPO").verdict == NOT_SUPPORTED
    assert find(table, "DAPO beats GRPO").verdict == INCONCLUSIVE  # 10 +- 0 both: t = 0
    assert find(table, "GSPO is more stable").verdict == INCONCLUSIVE
    assert find(table, "GRPO drops the critic").verdict == NOT_MEASURED
    text = build_report(tmp_path).read_text()
    claims = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(claims) == 7 and "did not run: 9 (" in text


def test_summary_numbers_come_from_the_logs(tmp_path):
    run = write_run(tmp_path, "grpo", 0, steps=4, acc=(0.25, 0.5), sec_per_step=6.0, rewards=[0.0, 0.5, 0.25, 1.0])
    s = run_summary(load_runs(tmp_path)[0])
    assert (s["acc_before"], s["acc_after"], s["acc_gain"]) == (0.25, 0.5, 0.25)
    assert s["train_minutes"] == pytest.approx(4 * 6.0 / 60)
    assert s["reward_mean"] == pytest.approx(1.75 / 4)
    assert s["reward_abs_change"] == pytest.approx((0.5 + 0.25 + 0.75) / 3)
    assert s["model_state_mb"] == 2000.0 and s["params_mb"] == 1000.0
    assert s["grad_noise_frac"] == pytest.approx((0.52 + 0.54) / 2)  # measured at steps 2 and 4
    assert run.name == "grpo-s0"


def test_memory_claims_follow_the_measured_saving(tmp_path):
    four_algos(tmp_path)
    table = verdicts(tmp_path)
    half = find(table, "GRPO drops the critic")
    # model state GRPO 500+500+1000 = 2000 MB, PPO 500+500+480+1960 = 3440 MB: saving 1 - 2000/3440 = 41.9%
    assert half.verdict == SUPPORTED and "saving 41.9%" in half.measured
    gpu = find(table, "GRPO needs 20-30% less")
    # peak RSS 2000 vs 2600 MB: saving 23.1%
    assert gpu.verdict == SUPPORTED and "23.1%" in gpu.measured
    small_critic = {"actor": 500.0, "reference": 500.0, "critic": 10.0, "optimizer": 1020.0}
    for s in (0, 1, 2):
        write_run(tmp_path, "ppo", s, roles=small_critic, peak_rss=2050)
    table = verdicts(tmp_path)
    assert find(table, "GRPO drops the critic").verdict == NOT_SUPPORTED
    assert find(table, "GRPO needs 20-30% less").verdict == NOT_SUPPORTED


def test_directional_claims_flip_with_the_data(tmp_path):
    four_algos(tmp_path, ppo_time=20.0, rpp_time=10.0)
    table = verdicts(tmp_path)
    assert find(table, "REINFORCE++ is faster than PPO").verdict == SUPPORTED
    assert find(table, "GRPO converges faster").verdict == SUPPORTED  # gains 0.20-0.22 vs 0.05-0.07
    # gradient variance 5.2, 5.4, 5.6 (x3 seeds) vs 8.2, 8.4, 8.6
    variance = find(table, "GRPO's group-relative")
    assert variance.verdict == SUPPORTED and "noise fraction grpo 0.54, ppo 0.84" in variance.measured
    assert find(table, "PPO beats (iterative) DPO").verdict == NOT_SUPPORTED  # 0.05-0.07 vs 0.10-0.14
    assert find(table, "GRPO is more stable").verdict == INCONCLUSIVE  # identical reward curves
    other = tmp_path / "swapped"
    four_algos(other, ppo_time=10.0, rpp_time=20.0)
    assert find(verdicts(other), "REINFORCE++ is faster than PPO").verdict == NOT_SUPPORTED
    same = tmp_path / "same"
    four_algos(same, ppo_time=10.0, rpp_time=10.0)
    assert find(verdicts(same), "REINFORCE++ is faster than PPO").verdict == INCONCLUSIVE


def test_one_seed_is_inconclusive_and_missing_algorithms_not_measured(tmp_path):
    write_run(tmp_path, "grpo", 0, acc=(0.2, 0.6))
    write_run(tmp_path, "ppo", 0, acc=(0.2, 0.3), roles=PPO_ROLES)
    table = verdicts(tmp_path)
    gain = find(table, "GRPO converges faster")
    assert gain.verdict == INCONCLUSIVE and "fewer than 2 units" in gain.measured
    assert find(table, "REINFORCE++ is faster").verdict == NOT_MEASURED
    assert "dpo_iterative not in this comparison" in find(table, "PPO beats").measured


def test_variance_claim_not_measured_without_gradient_variance_and_task_keys_in_header(tmp_path):
    for algo in ("grpo", "ppo"):
        for s in (0, 1):
            run = write_run(tmp_path, algo, s, grad_noise=None, roles=PPO_ROLES if algo == "ppo" else None)
            config = (run / "config.yaml").read_text().replace("name: arithmetic", "name: wordproblems")
            (run / "config.yaml").write_text(config.replace("kind: mul", "word_steps: 2"))
    variance = find(verdicts(tmp_path), "GRPO's group-relative")
    assert variance.verdict == NOT_MEASURED and "train.grad_var_every=0" in variance.measured
    text = build_report(tmp_path).read_text()
    assert "task `wordproblems` (word_steps=2, 100 held-out problems, greedy)" in text


def test_welch_by_hand():
    # a = 1,2,3 and b = 4,5,6: means 2 and 5, sd 1 each; se^2 = 1/3 + 1/3; t = -3 / sqrt(2/3) = -3.674
    # Welch df = (2/3)^2 / ((1/3)^2/2 + (1/3)^2/2) = 4; two-sided 5% critical value 2.776
    t, df = welch(Stat([1.0, 2.0, 3.0]), Stat([4.0, 5.0, 6.0]))
    assert t == pytest.approx(-3 / math.sqrt(2 / 3)) and df == pytest.approx(4.0)
    assert t_critical(df) == 2.776 and t_critical(35.5) == 2.042 and t_critical(500) == 1.96
    assert t_critical(0.5) == math.inf


def test_unfinished_run_is_reported_and_report_only_cli(tmp_path, capsys):
    root = tmp_path / "compare-x"
    write_run(root, "grpo", 0)
    write_run(root, "grpo", 1, finished=False)
    code = main(["compare", f"train.output_dir={tmp_path}", "--name", "x", "--report-only"])
    assert code == 0
    text = (root / "report.md").read_text()
    assert "Unfinished runs" in text and "grpo-s1" in text and "| grpo | 1/2 |" in text
    code = main(["compare", f"train.output_dir={tmp_path}", "--name", "empty", "--report-only"])
    assert code == 2 and "no run folders" in capsys.readouterr().err
