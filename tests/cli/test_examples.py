"""Each shipped example's command, as its file gives it, runs on the tiny model: the paths, keys and the
example's own files are what a user copies."""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

from covey.cli.main import main
from tests.helpers import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def command_of(path: Path) -> list[str]:
    """The `covey train ...` command in a module's docstring, continuation lines joined."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    text = doc.split("covey train", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    return shlex.split(text)


def test_the_number_guess_command_runs_its_episodes(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the command's paths are the repository's
    argv = command_of(ROOT / "examples" / "number_guess" / "guess_env.py")
    assert "rollout.tool_demo=examples/number_guess/demo.json" in argv
    assert main(["train", *argv, *tiny_overrides(tiny_model_dir, tmp_path, **{
        "train.steps": 1, "task.eval_size": 2, "rollout.max_new_tokens": 16})]) == 0
    step = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()][1]
    assert "episode/turns_mean" in step and "reward/tool_use" in step and "reward/environment" in step
