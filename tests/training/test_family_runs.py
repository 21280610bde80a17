"""Every model family trains two steps of `covey train` and resumes exactly, and a family covey cannot serve
is refused before the model loads.

Each run samples 16 new tokens after an arithmetic prompt of about 30 tokens: every sequence runs past the
tiny models' sliding window of 8 (covey/models/tiny.py). The run stopped after step 1 and resumed must log
the same step 2 as the run that went through: the same sampled tokens, losses and gradient norm.
"""

import json

import pytest

from covey.cli.main import main
from covey.models.tiny import FAMILY_NAMES, build_tiny_family
from covey.runtime.metrics import NONDETERMINISTIC_PREFIXES
from tests.helpers import tiny_overrides


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: str(build_tiny_family(root / name, name)) for name in FAMILY_NAMES}


def train(model_dir, out, **extra) -> int:
    return main(["train", *tiny_overrides(model_dir, out, **{
        "model.threads": 1, "optim.lr": 1e-3, "rollout.max_new_tokens": 16, "train.resume": "auto",
        "reward.functions": "tests.helpers:varied_reward", "reward.correctness": 0.0, **extra})])


def deterministic(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in rows]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_steps_and_an_exact_resume(family, family_dirs, tmp_path, capsys):
    assert train(family_dirs[family], tmp_path / "whole") == 0
    out = capsys.readouterr().out
    assert f"covey: model {family.split('_window')[0]}" in out.replace("_text", "")  # the family's start-up line
    whole = deterministic(tmp_path / "whole" / "t")
    steps = [r for r in whole if "optim/grad_norm" in r]  # the two training steps (beside the eval lines)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["optim/grad_norm"] > 0 for r in steps)  # the varied reward gives every step a gradient
    assert steps[0]["response/len_mean"] > 8  # responses past the window, after prompts past it
    assert train(family_dirs[family], tmp_path / "cut", **{"train.steps": 1}) == 0
    assert train(family_dirs[family], tmp_path / "cut") == 0
    assert deterministic(tmp_path / "cut" / "t") == whole


def test_a_family_with_layers_covey_cannot_serve_is_refused_before_loading(tmp_path, capsys):
    # Llama 4's chunked attention: a layer kind with no exact packed pass or engine cache in covey
    from transformers import LlamaConfig
    folder = tmp_path / "chunked"
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config.layer_types = ["chunked_attention", "full_attention"]
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not read")  # the refusal comes before any weight is read
    assert train(str(folder), tmp_path / "run") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model family llama is not served" in err[0] and "chunked_attention" in err[0]
