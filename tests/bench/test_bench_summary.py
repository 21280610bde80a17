"""The harness's arithmetic (bench/harness.py): steps 2..N summarised, interleaved rounds pooled, the table."""

from bench.harness import interleaved, medians, pooled, summarize, table


def result(seconds, updates, flops, rss):
    steps = [{"step": i + 1, "step_s": s, "generate_s": 1.0, "score_s": 0.0, "logprobs_s": 0.5, "update_s": u,
              "tokens": 100, "flops": f} for i, (s, u, f) in enumerate(zip(seconds, updates, flops))]
    return {"name": "covey", "peak_rss_mib": rss, "steps": steps, "precision": "bfloat16 (autocast)"}


def test_summary_skips_the_first_step_and_rates_the_update():
    # timed steps 2..4: 10, 12, 11 s -> median 11, min 10; FLOP rate (4 + 6 + 5) TFLOP / (4 + 6 + 5) s = 1000 GFLOP/s
    r = summarize(result([99, 10, 12, 11], [50, 4, 6, 5], [1e12, 4e12, 6e12, 5e12], 4096))
    assert (r["step_s"], r["min_s"], r["steps_timed"]) == (11, 10, 3)
    assert r["train_gflops"] == 1000 and r["update_s"] == 5 and r["logprobs_s"] == 0.5
    assert r["tokens_per_s"] == 300 / 33


def test_rounds_pool_their_timed_steps_and_keep_the_highest_peak():
    # round 1 times 10, 20 after its first step, round 2 times 30, 40: pooled median of 10, 20, 30, 40 = 25;
    # neither round's untimed first step (99, 98) counts; the peak RSS is the larger of 4096 and 5000
    one = result([99, 10, 20], [9, 2, 2], [0, 2e12, 2e12], 4096)
    two = result([98, 30, 40], [9, 4, 4], [0, 4e12, 4e12], 5000)
    r = summarize(pooled([one, two]))
    assert r["step_s"] == 25 and r["steps_timed"] == 4 and r["peak_rss_mib"] == 5000
    assert r["train_gflops"] == 12e12 / 12 / 1e9


def test_a_single_step_is_its_own_median():
    assert medians([{"step_s": 3.0}], ("step_s",)) == {"step_s": 3.0}


def test_rounds_interleave_the_runs():
    order = []
    by_name = interleaved(["covey", "trl"], 2, lambda name, tag: order.append(name + tag) or name + tag)
    assert order == ["covey-round1", "trl-round1", "covey-round2", "trl-round2"]
    assert by_name == {"covey": ["covey-round1", "covey-round2"], "trl": ["trl-round1", "trl-round2"]}


def test_the_markdown_table():
    assert table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
