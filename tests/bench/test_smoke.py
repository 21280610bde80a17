"""Every benchmark driver end to end on the tiny model: the covey side really trains a few steps in its
own process, and the driver's result file holds sane figures. The TRL side needs TRL (the `bench`
extra): its tests are skipped where TRL is not installed."""

import json

import pytest
import torch

from bench import gpu, learn, speed


def speed_smoke(tmp_path, model: str, runs: str) -> dict:
    out = speed.main(["--smoke", "--runs", runs, "--steps", "2", "--model", model, "--out", str(tmp_path / "bench"),
                      "--threads", str(torch.get_num_threads())])  # the test process keeps its threads
    return json.loads(out.read_text())


def gpu_smoke(tmp_path, model: str, runs: str, *flags: str) -> dict:
    code = gpu.main(["--smoke", "--runs", runs, "--tokenizer", model, "--out", str(tmp_path / "bench"),
                     "--work", str(tmp_path / "models"), *flags])
    assert code == 0
    return json.loads((tmp_path / "bench.json").read_text())


def learn_smoke(tmp_path, model: str, trainers: str) -> dict:
    assert learn.main(["--smoke", "--trainers", trainers, "--seeds", "0", "--out", str(tmp_path),
                       f"model.path={model}"]) == 0
    return json.loads((tmp_path / "learn-vs-trl.json").read_text())


def check_speed_row(row: dict, name: str) -> None:
    assert row["name"] == name and row["steps_timed"] == 1  # step 1 warms up
    assert 0 < row["step_s"] < 60 and row["tokens_per_s"] > 0 and row["peak_rss_mib"] > 100
    assert row["train_gflops"] > 0  # the FLOP counter's hooks saw the training passes
    assert 0 <= row["generate_s"] < row["step_s"] and 0 < row["update_s"] < row["step_s"]


def check_gpu_row(row: dict, name: str) -> None:
    r = row[name]
    assert 0 < r["step_s"] < 60 and 0 < r["update_s"] < r["step_s"] and 0 < r["generate_s"] < r["step_s"]
    assert r["update_tflops"] > 0 and r["generate_ms_per_token"] > 0


def check_learning_run(run: dict, steps: int = 3) -> None:
    points = run["points"]
    assert points[0]["step"] == 0 and points[0]["tags"] == ["base"]
    assert all(0 <= p["accuracy"] <= 1 and p["n"] == 8 for p in points)
    assert "final" in points[-1]["tags"] and points[-1]["step"] == run["steps"][-1]["step"] >= steps
    assert [p["step"] for p in points if "every" in p["tags"]][:1] == [2]  # --eval-every 2
    assert all(s["step_s"] > 0 for s in run["steps"]) and all(p["folder"] is None for p in points[1:])


def test_speed_driver_times_covey_steps(tmp_path, tiny_model_dir):
    result = speed_smoke(tmp_path, tiny_model_dir, "covey")
    (row,) = result["summary"]
    check_speed_row(row, "covey")
    steps = result["runs"][0]["steps"]
    assert [s["step"] for s in steps] == [1, 2] and all(s["tokens"] > 0 and s["flops"] > 0 for s in steps[1:])
    assert result["peak_before"]["float32"] > 0


def test_gpu_driver_covey_child_runs_on_the_cpu(tmp_path, tiny_model_dir):
    result = gpu_smoke(tmp_path, tiny_model_dir, "covey", "--profile")
    (row,) = result["rows"]
    assert row["size"] == "smoke" and row["labels"] == ["covey"]
    check_gpu_row(row, "covey")
    detail = row["covey"]["detail"]
    assert detail["decode"]["rows"] == 8 and row["covey"]["decode_ms"] > 0  # timed around generate
    log = (tmp_path / "bench-logs" / "covey-smoke.log").read_text()
    assert "profile of one step, top ops by self_cpu_time_total" in log  # one more step under torch.profiler
    assert result["device"]["copy_bytes_per_s"] > 0 and result["device"]["matmul_tflops"] > 0
    # every response ran to its 12 tokens (2 prompts x 4 samples): the model folder's end id cannot be sampled
    steps = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()][0]["steps"]
    assert [s["tokens"] for s in steps] == [96, 96, 96]


def test_learn_driver_saves_and_evaluates_covey_points(tmp_path, tiny_model_dir):
    result = learn_smoke(tmp_path, tiny_model_dir, "covey")
    (run,) = result["runs"]
    assert run["trainer"] == "covey" and run["seed"] == 0
    check_learning_run(run)
    assert (tmp_path / "learn-vs-trl.md").is_file() and (tmp_path / "learn-vs-trl-minutes.png").is_file()


def test_speed_driver_times_trl_steps(tmp_path, tiny_model_dir):
    pytest.importorskip("trl", reason="TRL is the `bench` extra")
    result = speed_smoke(tmp_path, tiny_model_dir, "trl,trl-gc")
    for row, name in zip(result["summary"], ("trl", "trl-gc")):
        check_speed_row(row, name)


def test_gpu_driver_trl_child_runs_on_the_cpu(tmp_path, tiny_model_dir):
    pytest.importorskip("trl", reason="TRL is the `bench` extra")
    (row,) = gpu_smoke(tmp_path, tiny_model_dir, "trl")["rows"]
    check_gpu_row(row, "trl")
    assert row["trl"]["detail"]["settings"]["gradient_checkpointing"] is False  # covey's setting, mapped


def test_learn_driver_compares_both_trainers(tmp_path, tiny_model_dir):
    pytest.importorskip("trl", reason="TRL is the `bench` extra")
    result = learn_smoke(tmp_path, tiny_model_dir, "covey,trl")
    assert [r["trainer"] for r in result["runs"]] == ["covey", "trl"]
    for run in result["runs"]:
        check_learning_run(run)
    assert set(result["summary"]) == {"steps", "minutes"}
    assert result["trl_settings"]["num_generations"] == 4


def test_episodes_driver_runs_the_same_episodes_both_ways(tmp_path, tiny_model_dir):
    """bench.episodes on the tiny model, every id of which ends a turn (its generation config's end-of-sequence ids;
    a random model never stops otherwise): the loop and the turn-by-turn runner give the same greedy episodes
    (model and tool tokens), longer than the single turn by the replies and second turns."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from bench import episodes
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    GenerationConfig(eos_token_id=list(range(len(AutoTokenizer.from_pretrained(model)))),
                     pad_token_id=2).save_pretrained(model)
    result = episodes.main(["--smoke", "--device", "cpu", "--model", str(model), "--out", str(tmp_path / "episodes")])
    tokens = result["tokens"]
    assert tokens["episodes, loop"] == tokens["episodes, turn by turn"]
    assert tokens["episodes, loop"][1] > 0 and tokens["single turn"][1] == 0
    assert (tmp_path / "episodes.md").read_text().count("| episodes,") == 2


def test_rollout_driver_runs_the_engine_arms_on_set_lengths(tmp_path, tiny_model_dir):
    """bench.rollout on the tiny model: every arm samples exactly the rows' budgets (end-of-sequence ignored), the
    batch arm's calls wait for their longest row, the slot arms keep their slots busier."""
    from bench import rollout
    rollout.main(["--rows", "12", "--slots", "4", "--group", "2", "--max-new", "40", "--model", tiny_model_dir,
                  "--arms", "batch,slots,paged,spec,hf", "--out", str(tmp_path / "rollout")])
    result = json.loads((tmp_path / "rollout.json").read_text())
    budgets, arms = result["budgets"], result["arms"]
    assert len(budgets) == 12 and max(budgets) <= 40 and len(set(budgets)) > 3  # long-tailed, capped
    assert all(runs[0]["tokens"] == sum(budgets) for runs in arms.values())
    batch = sum(budgets) / sum(4 * max(budgets[i:i + 4]) for i in range(0, 12, 4))  # each call waits for its longest
    assert arms["batch"][0]["useful"] == pytest.approx(batch)
    assert arms["slots"][0]["useful"] > batch
    paged = arms["paged"][0]  # blocks: more rows at once than 4 slots, the KV held near the tokens in flight
    assert paged["widest"] > 4 and 0.5 < paged["useful"] <= 1.0
    assert paged["kv_per_token"] < arms["slots"][0]["kv_per_token"]
    assert "| spec |" in (tmp_path / "rollout.md").read_text()


def test_serve_driver_times_the_server_against_the_engine(tmp_path, tiny_model_dir):
    """bench.serve on the tiny model: the openai client's concurrent requests are all answered, and both arms
    sample tokens."""
    from bench import serve
    serve.main(["--requests", "6", "--max-tokens", "8", "--model", tiny_model_dir, "--out", str(tmp_path / "serve")])
    arms = json.loads((tmp_path / "serve.json").read_text())["arms"]
    assert set(arms) == {"direct", "server"}
    assert all(0 < runs[0]["tokens"] <= 6 * 8 for runs in arms.values())
