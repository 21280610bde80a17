"""On-policy distillation (algo.learner=distill) on the tiny model: the teacher's tokenizer checked before any
model loads, 2-step runs of both losses, and a teacher equal to the student teaching nothing (its KL and
the advantages are exactly 0), which a wrong pairing of student and teacher log-probs would not give."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from covey.algos import generalized_jsd
from covey.cli.main import main
from covey.models.load import load_policy
from covey.models.tiny import build_tiny_model, tiny_llama, tiny_tokenizer
from covey.passes.sequences import layout, layout_logits, stack
from covey.runtime.metrics import read_metrics
from covey.tasks.sft_data import render_demo, row_to_demo
from covey.training.distill import tokenizer_mismatch
from tests.helpers import tiny_overrides
from tests.training.test_sft import ROWS, write_rows

DOC = (Path(__file__).resolve().parents[2] / "docs" / "distillation.md").read_text()
COMMANDS = [line for line in re.search(r"## Commands.*?```bash\n(.*?)```", DOC, re.S).group(1).splitlines()
            if line.strip()]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model with the tiny model's tokenizer (the same seed's) and other weights."""
    out = tmp_path_factory.mktemp("teacher") / "model"
    tokenizer = tiny_tokenizer(seed=0)
    model = tiny_llama(len(tokenizer), seed=1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def distill(model_dir, out, teacher, **extra) -> int:
    overrides = tiny_overrides(model_dir, out, **{"model.threads": 1, "train.max_minutes": 0, "algo.beta": 0,
                                                  "algo.learner": "distill", "algo.distill.teacher": teacher,
                                                  "optim.lr": 1e-3, **extra})
    return main(["train", *overrides])


def test_tokenizer_mismatch_names_the_difference(tiny_model_dir, tmp_path):
    mine = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer_mismatch(mine, AutoTokenizer.from_pretrained(tiny_model_dir)) is None
    other = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "other", seed=1))  # other BPE merges
    assert "against the policy's" in tokenizer_mismatch(mine, other) or "encodes to other ids" in \
        tokenizer_mismatch(mine, other)


def test_a_teacher_with_another_tokenizer_fails_before_any_model_loads(tiny_model_dir, tmp_path, capsys):
    other = build_tiny_model(tmp_path / "other", seed=1)
    capsys.readouterr()
    assert distill(tiny_model_dir, tmp_path / "runs", str(other)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"covey train: error: algo.distill.teacher={other}: its tokenizer is not the policy's")
    assert "\n" not in err and not (tmp_path / "runs" / "t").exists()  # refused before the run folder, before loading


@pytest.mark.parametrize("extra, message", [
    ({"algo.learner": "advantage"}, "algo.distill.teacher is read by algo.learner=distill"),
    ({"algo.distill.beta": 0.2}, "read by algo.distill.loss=jsd, not reverse_kl"),
    ({"algo.distill.loss": "jsd", "algo.distill.reward_weight": 1}, "loss=jsd has no advantages"),
    ({"algo.distill.teacher": ""}, "algo.learner=distill needs a teacher"),
])
def test_distill_settings_that_mean_nothing_are_refused(tmp_path, capsys, extra, message):
    assert distill("tiny", tmp_path, "some/teacher", **extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("loss,group", [("reverse_kl", 4), ("jsd", 4), ("reverse_kl", 1)])
def test_two_step_distill_run(tiny_model_dir, teacher_dir, tmp_path, capsys, loss, group):
    """Both losses train 2 steps from another teacher: distill/teacher_kl is logged each step and positive (two
    random models disagree, about 0.1 nats a token: a sampled estimate over 2 prompts x 4 samples of 8 tokens
    stays above 0), the policy moves; one sample per prompt is enough (no group baseline): 8 prompts x 1."""
    assert distill(tiny_model_dir, tmp_path, teacher_dir, **{"algo.distill.loss": loss, "rollout.group_size": group,
                                                            "rollout.prompts_per_step": 8 // group}) == 0
    out = capsys.readouterr().out
    assert f"covey: distill | teacher {teacher_dir}" in out and "parameters in float32" in out
    steps = [r for r in read_metrics(tmp_path / "t") if r["step"] in (1, 2) and "final" not in r]
    assert len(steps) == 2 and all(r["distill/teacher_kl"] > 0 for r in steps)
    assert all(r["optim/grad_norm"] > 0 for r in steps)
    if loss == "jsd":
        assert all(r["distill/jsd"] > 0 for r in steps)
    else:
        assert all(r["signal/advantage_abs_max"] > 0 and "reward/mean" in r for r in steps)
        assert all(r["signal/samples"] == 8 for r in steps)


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_a_teacher_equal_to_the_student_teaches_nothing(tiny_model_dir, tmp_path, loss):
    """The student's own folder as its teacher: at step 1 (before any update) the teacher's log-probs of the
    sampled tokens are the student's, so every advantage, the divergence and the gradient are exactly 0."""
    assert distill(tiny_model_dir, tmp_path, tiny_model_dir, **{"algo.distill.loss": loss, "train.steps": 1}) == 0
    first = read_metrics(tmp_path / "t")[1]
    assert first["step"] == 1 and first["distill/teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["optim/grad_norm"] == pytest.approx(0.0, abs=1e-6)
    if loss == "reverse_kl":
        assert first["signal/advantage_abs_max"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert first["distill/jsd"] == pytest.approx(0.0, abs=1e-6)


def test_reward_advantages_beside_the_teachers(tiny_model_dir, tmp_path):
    """reward_weight=1 with the student as its own teacher: the advantages trained are GRPO's alone (the teacher's
    are 0), so the largest |advantage| in the loss is a GRPO run's on the same samples (without the reward term it
    is 0, as the test above shows)."""
    extra = {"train.steps": 1, "reward.functions": "tests.helpers:varied_reward"}
    assert distill(tiny_model_dir, tmp_path / "d", tiny_model_dir, **{"algo.distill.reward_weight": 1, **extra}) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path / "g", **{
        "model.threads": 1, "train.max_minutes": 0, "algo.beta": 0, "optim.lr": 1e-3, **extra})]) == 0
    mine, grpo = (read_metrics(tmp_path / name / "t")[1] for name in ("d", "g"))
    assert mine["reward/mean"] == grpo["reward/mean"]
    assert mine["signal/advantage_abs_max"] == pytest.approx(grpo["signal/advantage_abs_max"])
    assert grpo["signal/advantage_abs_max"] > 0


def test_the_documented_commands_run_as_written(tiny_model_dir, teacher_dir, tmp_path, capsys):
    """docs/distillation.md's commands, each on the tiny model for 2 steps (the warm-up's 2 supervised steps
    then 2 GRPO steps), with demonstrations written here and the tiny teacher in place of the documented one."""
    data = write_rows(tmp_path / "demos.jsonl", ROWS)
    assert [c.split()[:2] for c in COMMANDS] == [["covey", "sft"]] + [["covey", "train"]] * 3
    for command in COMMANDS:
        args = [a.replace("demos.jsonl", str(data)).replace("/path/to/SmolLM2-360M-Instruct", teacher_dir)
                for a in shlex.split(command)[1:]]
        name = next(a.split("=", 1)[1] for a in args if a.startswith("train.run_name="))
        small = {"train.run_name": name, "train.max_minutes": 0, "model.threads": 1, "sft.batch_size": 2}
        args += tiny_overrides(tiny_model_dir, tmp_path, **small) + (
            ["sft.num_steps=2"] if "sft.num_steps=20" in command else [])
        assert main(args) == 0, command
        capsys.readouterr()
        lines = read_metrics(tmp_path / name)
        assert lines[-1]["final"] == 1 and lines[-1]["step"] == (4 if "sft.num_steps" in command else 2), command
        assert ("sft/loss" in lines[1]) == ("sft" in command) and ("distill/teacher_kl" in lines[1]) == (
            "distill" in command), command


def test_gkd_on_the_packed_layout_equals_the_padded_one(tiny_model_dir, teacher_dir):
    """Student and teacher logits on the packed layout, the trained mask laid onto it: the same summed divergence
    and the same per-row values as on the padded rows (covey/training/sft.py, Layout.laid and Layout.rows)."""
    student, tokenizer = load_policy(tiny_model_dir)
    teacher, _ = load_policy(teacher_dir)
    rendered = [render_demo(tokenizer, row_to_demo(r, "d"), 1024) for r in ROWS]
    seqs = stack([(t.ids, t.trained) for t in rendered], tokenizer.pad_token_id)
    sums, rows = [], []
    with torch.no_grad():
        for packed in (True, False):
            lay = layout(student, seqs, "none", packed)
            per = generalized_jsd(layout_logits(student, lay, "none"), layout_logits(teacher, lay, "none"), 0.5)
            sums.append(float((per * lay.laid(seqs.target_mask)).sum()))
            rows.append(lay.rows(per) * seqs.target_mask)
    assert (lay.packing is None) and sums[0] == pytest.approx(sums[1], rel=1e-5) and sums[0] > 0
    assert torch.allclose(rows[0], rows[1], atol=1e-6)
