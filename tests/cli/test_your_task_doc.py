"""docs/your-task.md: the worked example runs as written (on the tiny model), and the default model's
held-out accuracy on the capitals questions is what a string verifier should see."""

import json
import re
import shlex
from pathlib import Path

from covey.cli.main import main
from tests.helpers import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "your-task.md").read_text()
EXAMPLE = DOC.split("## A worked example", 1)[1]
COMMANDS = [line for line in re.search(r"```bash\n(.*?)```", EXAMPLE, re.S).group(1).splitlines() if line.strip()]
DATA = ["task.name=file", "task.path=examples/capitals/train.jsonl", "task.eval_path=examples/capitals/test.jsonl"]


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def test_the_worked_example_runs_as_written(tiny_model_dir, tmp_path, capsys):
    assert [c.split()[:2] for c in COMMANDS] == [["covey", "eval"], ["covey", "train"], ["covey", "eval"]]
    run_dir = tmp_path / "capitals"
    tiny = [o for o in tiny_overrides(tiny_model_dir, tmp_path, **{"train.run_name": "capitals"})
            if not o.startswith("task.")]
    for command in COMMANDS:
        args = shlex.split(command.replace("runs/capitals", str(run_dir)))[1:]
        if args[1] != str(run_dir):  # a run folder brings its own model and settings
            args += tiny if args[0] == "train" else [f"model.path={tiny_model_dir}", "rollout.eval_max_new_tokens=8"]
        assert main(args) == 0, command
        out = capsys.readouterr().out
        if args[0] == "eval":
            result = last_json(out)
            metric = "normalized" if args[1] == str(run_dir) else "contains"
            assert result["metric"] == f"accuracy ({metric})" and result["eval/n"] == 18
        else:
            assert "held-out metric: accuracy by the contains verifier" in out
            assert re.search(r"held-out accuracy \(contains\) [\d.]+% -> [\d.]+% after 2 steps", out)
    saved = json.loads(next(line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                            if '"reward/capital_reward"' in line))
    assert 0.0 <= saved["reward/capital_reward"] <= 1.0 and "accuracy" not in saved  # no verifier in the reward


def test_default_model_answers_capitals_by_a_string_verifier(capsys):
    """SmolLM2 names the capital in a sentence: `contains` sees it, `normalized` (the answer alone) does not."""
    found = {}
    for metric in ("contains", "normalized"):
        assert main(["eval", *DATA, f"eval.metric={metric}"]) == 0
        found[metric] = last_json(capsys.readouterr().out)["eval/accuracy"]
    assert found["contains"] >= 10 / 18, found  # docs/your-task.md: 14 of 18
    assert found["normalized"] < found["contains"]


def test_eval_of_an_unfinished_or_wrong_folder_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"covey eval: error: {tmp_path}: not a run folder (no config.yaml)"
    (tmp_path / "config.yaml").write_text("train:\n  steps: 3\n")
    assert main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"covey eval: error: {tmp_path}: no trained model in final/ "
                                               "(the run did not finish): name a checkpoint with --model")
