"""The real CLI, end to end, on a tiny random Llama (seconds per run). Every preset's two steps
through `covey train PRESET` are in tests/training/test_presets_pinned.py (one run per preset)."""

import json
import subprocess
import sys

import pytest
import yaml

from covey.cli.main import main
from covey.config import as_dict, load_config, preset_names
from tests.helpers import tiny_overrides


def test_console_script_and_eval_of_saved_model(tiny_model_dir, tmp_path):
    """`python -m covey.cli train` in a subprocess, then `covey eval --model runs/<name>/final`."""
    cmd = [sys.executable, "-m", "covey.cli", "train", *tiny_overrides(tiny_model_dir, tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out accuracy" in done.stdout
    # transformers draws these bars on each load and save unless the command turns them off
    assert "Loading weights" not in done.stderr and "Writing model shards" not in done.stderr
    final = tmp_path / "t" / "final"
    cmd = [sys.executable, "-m", "covey.cli", "eval", "--model", str(final), "task.eval_size=4",
           "task.train_size=16", "rollout.eval_max_new_tokens=4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["eval/n"] == 4


# Runs `covey ARGS` in a fresh interpreter, then prints which heavy modules it imported.
LOADED = """
import sys
from covey.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:  # --help ends by raising it
    code = stop.code
heavy = [m for m in ("torch", "transformers", "covey.algos", "covey.training.loop", "covey.models.load",
                     "covey.rollout.hf") if m in sys.modules]
print("# loaded:", ",".join(heavy))
sys.exit(code)
"""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["train", "--help-config"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    """Help comes back at once: the parser of every command and the config's key list load no torch
    (the advantages command names covey.algos' registries only when its own help is printed)."""
    done = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text, loaded = done.stdout.rsplit("# loaded:", 1)
    assert "covey" in text and loaded.strip() == "", f"covey {' '.join(argv)} imported {loaded.strip()}"


def test_advantages_help_names_the_registries(capsys):
    with pytest.raises(SystemExit):
        main(["advantages", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "grpo, grpo_process, rloo" in text and "shared | uniform | discounted" in text
    assert "auto | group | batch | global_token | none" in text


@pytest.mark.parametrize("argv, preset, overrides", [
    (["train", "ppo", "--print-config"], "ppo", []),
    (["train", "rloo", "algo.beta=0.1", "steps=3", "--print-config"], "rloo", ["algo.beta=0.1", "steps=3"]),
    (["train", "--print-config", "steps=3"], None, ["steps=3"]),
])
def test_print_config_prints_the_resolved_config_and_loads_nothing(argv, preset, overrides):
    done = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text, loaded = done.stdout.rsplit("# loaded:", 1)
    assert loaded.strip() == ""  # no torch, no model, no training loop
    assert yaml.safe_load(text) == as_dict(load_config(preset, overrides))


def test_train_with_a_yaml_file_and_an_unknown_preset(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text("algo:\n  estimator: rloo\n")
    assert main(["train", str(path), "steps=2", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algo"]["estimator"] == "rloo" and printed["train"]["steps"] == 2
    assert main(["train", "pppo", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("covey train: error: unknown preset 'pppo' (did you mean 'ppo'?); presets: "
                   + ", ".join(preset_names()))


@pytest.mark.parametrize("args, message", [
    (["train", "stepz=3"], "unknown config key 'stepz' (did you mean 'steps'?)"),
    (["train", "algo.beta=x"], "config key 'algo.beta' expects float"),
    (["train", "model.path=./no/such/model"], "model path not found"),
    (["train", "task.name=jsonl", "task.path=/no/such.jsonl"], "file not found"),
    # key=value overrides on both sides of an option reach the config (so the bad key is named)
    (["compare", "task.eval_size=4", "--algos", "grpo", "bogus.key=1"], "unknown config key 'bogus.key'"),
])
def test_bad_input_one_line_exit_2(args, message, capsys, tmp_path):
    code = main(args + [f"train.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err


def test_malformed_jsonl_names_file_and_line(tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"\n')
    code = main(["train", "task.name=jsonl", f"task.path={data}", *tiny_overrides(tiny_model_dir, tmp_path)])
    assert code == 2
    assert f"{data}:2:" in capsys.readouterr().err


def test_prompt_longer_than_context(tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": "7 " * 3000, "answer": "1"}, {"prompt": "1+1?", "answer": "2"},
            {"prompt": "2+2?", "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "task.name=jsonl", f"task.path={data}", "task.eval_size=1",
                 *tiny_overrides(tiny_model_dir, tmp_path)])
    assert code == 2
    assert "prompt is" in capsys.readouterr().err


def test_unknown_option_is_still_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["eval", "--bogus", "task.eval_size=4"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("environ, enabled_after", [({}, False), ({"HF_HUB_DISABLE_PROGRESS_BARS": "0"}, True)])
def test_quiet_progress_bars_leaves_a_users_own_setting(environ, enabled_after):
    """Bars off unless the user set HF_HUB_DISABLE_PROGRESS_BARS (then theirs decides: untouched here)."""
    from transformers.utils import logging as hf_logging

    from covey.cli.common import quiet_progress_bars
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        quiet_progress_bars(environ)
        assert hf_logging.is_progress_bar_enabled() is enabled_after
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
