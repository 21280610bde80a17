"""Checkpoints: layout, keep-last-K, atomic writes under a full disk, no NaN, config checks, resume specs."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from covey.cli.main import main
from covey.config import as_dict, load_config
from covey.runtime.metrics import NONDETERMINISTIC_PREFIXES, read_metrics
from covey.training.checkpoint import CheckpointError, config_differences, list_checkpoints, save_checkpoint
from covey.training.plan import make_plan
from covey.training.setup import build_run
from tests.helpers import tiny_overrides


def train(model_dir, out, **extra) -> int:
    return main(["train", *tiny_overrides(model_dir, out, **{"model.threads": 1, **extra})])


def names(run_dir: Path) -> list[str]:
    return [p.name for p in sorted((run_dir / "checkpoints").iterdir())]


def deterministic(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}
            for r in read_metrics(run_dir)]


def test_layout_keep_last_k_and_whole_state(tiny_model_dir, tmp_path):
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 4, "train.save_every": 1,
                                             "train.keep_checkpoints": 2}) == 0
    run_dir = tmp_path / "t"
    assert names(run_dir) == ["step-000003", "step-000004"]
    newest = run_dir / "checkpoints" / "step-000004"
    assert (newest / "policy" / "config.json").is_file() and (newest / "config.yaml").is_file()
    state = torch.load(newest / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4
    assert state["stream"] == {"epoch": 0, "position": 8}  # 4 steps x 2 prompts of 16
    assert {"python", "numpy", "torch"} <= state["rng"].keys()
    assert state["optimizer"]["state"], "Adam moments are saved"
    assert state["scheduler"]["last_epoch"] == 4
    # The log length at save time: every line up to step 4's, not the final eval line after it.
    lines = (run_dir / "metrics.jsonl").read_bytes()[:state["logs"]["metrics.jsonl"]].decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4]


def test_save_every_zero_still_checkpoints_the_end(tiny_model_dir, tmp_path):
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3}) == 0
    assert names(tmp_path / "t") == ["step-000003"]


@pytest.mark.parametrize("variant", [
    {},  # GRPO
    {"algo.estimator": "gae", "algo.kl_in": "reward", "algo.kl_estimator": "k1",
     "algo.loss_agg": "token_mean", "algo.normalize": "global_token", "algo.epochs": 2, "algo.minibatches": 2},
    {"algo.dynamic_sampling": "true", "algo.ref_refresh_every": 2, "algo.adaptive_kl.target": 0.05},
], ids=["grpo", "ppo-critic", "dynamic-sampling-ref-refresh"])
def test_extending_a_finished_run_equals_a_longer_run(tiny_model_dir, tmp_path, variant):
    """resume=auto with more steps: the same numbers as one longer run, the short run's final line cut."""
    extra = {"optim.lr": 1e-3, "reward.functions": "tests.helpers:varied_reward", **variant}
    assert train(tiny_model_dir, tmp_path / "long", **{"train.steps": 4, **extra}) == 0
    assert train(tiny_model_dir, tmp_path / "short", **{"train.steps": 2, **extra}) == 0
    assert train(tiny_model_dir, tmp_path / "short", **{"train.steps": 4, "train.resume": "auto", **extra}) == 0
    long = deterministic(tmp_path / "long" / "t")
    assert deterministic(tmp_path / "short" / "t") == long
    assert [r["step"] for r in long] == [0, 1, 2, 3, 4, 4]
    assert long[1]["policy/entropy"] != long[4]["policy/entropy"], "the policy moved: the test can fail"


@pytest.mark.parametrize("failure, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "[Errno 28] No space left on device"),
    # what torch.save's zip writer raises when the disk fills under it (seen on a real run)
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 743481600 vs 743481492"),
     "[enforce fail at inline_container.cc:672] . unexpected pos 743481600 vs 743481492"),
])
def test_disk_full_mid_write_keeps_previous_checkpoint(failure, reason, tiny_model_dir, tmp_path, monkeypatch, capsys):
    real_save = torch.save
    calls = {"n": 0}

    def full_disk_on_second_checkpoint(obj, path, *args, **kwargs):
        if str(path).endswith("trainer_state.pt"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise failure
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_on_second_checkpoint)
    code = train(tiny_model_dir, tmp_path, **{"train.steps": 3, "train.save_every": 1})
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: progress bars
    run_dir = tmp_path / "t"
    assert code == 2
    assert re.fullmatch(re.escape(f"covey train: error: writing checkpoint {run_dir}/checkpoints/step-000002 "
                                  f"failed: {reason} (") + r"\d+\.\d GB free there\); "
                        + re.escape(f"newest complete checkpoint: {run_dir}/checkpoints/step-000001"), err), err
    assert names(run_dir) == ["step-000001"], "no half checkpoint, no temporary folder left"
    monkeypatch.setattr(torch, "save", real_save)
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3, "train.resume": "auto"}) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 3]


@pytest.fixture
def tiny_run(tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path))
    run = build_run(make_plan(cfg), tmp_path / "t", 16, record=as_dict(cfg))
    (tmp_path / "t").mkdir()
    return run


@pytest.mark.parametrize("where", ["policy", "optimizer"])
def test_nan_state_is_never_checkpointed(tiny_run, where):
    param = next(tiny_run.policy.parameters())
    if where == "policy":
        with torch.no_grad():
            param[0, 0] = float("nan")
    else:
        tiny_run.optimizer.state[param] = {"exp_avg": torch.full_like(param, float("inf"))}
    with pytest.raises(CheckpointError, match=f"{where} .* is not finite"):
        save_checkpoint(tiny_run, {})
    assert list_checkpoints(tiny_run.run_dir) == []
    assert not (tiny_run.run_dir / "checkpoints").exists() or not any((tiny_run.run_dir / "checkpoints").iterdir())


def test_config_change_refused_naming_keys_unless_forced(tiny_model_dir, tmp_path, capsys):
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 2}) == 0
    code = train(tiny_model_dir, tmp_path, **{"train.steps": 3, "train.resume": "auto",
                                             "algo.beta": 0.1, "optim.lr": 2e-5})
    err = capsys.readouterr().err
    assert code == 2
    assert "config changed in keys that change results: algo.beta (0.04 -> 0.1), optim.lr (1e-05 -> 2e-05)" in err
    assert "train.resume_force=true" in err
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3, "train.resume": "auto", "algo.beta": 0.1,
                                             "optim.lr": 2e-5, "train.resume_force": "true"}) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "t")][-2:] == [3, 3]


def test_config_differences_ignore_neutral_keys_and_default_missing_ones():
    saved = as_dict(load_config(None, ["train.steps=5", "train.progress=false"]))
    current = as_dict(load_config(None, ["train.steps=9", "algo.epochs=2", "train.eval_before_cache=e.json"]))
    del saved["optim"]["max_skipped_steps"]  # a key added to covey after the checkpoint was written
    assert config_differences(saved, current) == ["algo.epochs (1 -> 2)"]


def test_a_config_recorded_before_settling_resumes_as_what_it_settles_to(tmp_path, monkeypatch):
    """Older runs recorded eval.metric=auto and relative data paths; a run records them settled now
    (absolute paths, the verifier chosen). Resuming such a run is no difference; another file is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    saved = as_dict(load_config(None, ["task.name=file", "task.path=data.jsonl"]))
    current = as_dict(load_config(None, ["task.name=file", f"task.path={tmp_path / 'data.jsonl'}", "eval.metric=math"]))
    assert config_differences(saved, current) == []
    other = as_dict(load_config(None, ["task.name=file", f"task.path={tmp_path / 'other.jsonl'}"]))
    assert config_differences(saved, other) == [f"task.path ('data.jsonl' -> '{tmp_path / 'other.jsonl'}')"]


@pytest.mark.parametrize("extra, message", [
    ({"train.resume": "auto", "train.run_name": ""}, "train.resume=auto needs train.run_name"),
    ({"train.resume": "/no/such/checkpoint"}, "train.resume=/no/such/checkpoint: not a complete covey checkpoint"),
])
def test_bad_resume_requests_fail_before_the_model_loads(extra, message, tmp_path, capsys):
    code = train("/no/such/model", tmp_path, **extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "model path not found" not in err


def test_fresh_start_refuses_to_overwrite_checkpoints(tiny_model_dir, tmp_path, capsys):
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 1}) == 0
    before = (tmp_path / "t" / "metrics.jsonl").read_text()
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 1}) == 2
    assert "already holds checkpoints (newest step-000001): set train.resume=auto" in capsys.readouterr().err
    assert (tmp_path / "t" / "metrics.jsonl").read_text() == before


def test_resume_from_a_path_of_another_run(tiny_model_dir, tmp_path):
    """resume=<run folder> takes its newest checkpoint; the new run's logs start at that step."""
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 2, "train.save_every": 1}) == 0
    source = tmp_path / "t"
    assert train(tiny_model_dir, tmp_path, **{"train.steps": 3, "train.resume": str(source),
                                             "train.run_name": "b"}) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [3, 3]
    assert names(tmp_path / "b") == ["step-000003"]


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    from covey.runtime.metrics import make_run_dir
    base = tmp_path / "runs" / "grpo-20261128-062504"
    assert make_run_dir(base, unique=True) == base
    assert make_run_dir(base, unique=True) == base.with_name("grpo-20261128-062504-2")  # a second run that second
    assert make_run_dir(base, unique=False) == base  # a named run (resume) takes its folder as it is
    assert sorted(p.name for p in base.parent.iterdir()) == ["grpo-20261128-062504", "grpo-20261128-062504-2"]
