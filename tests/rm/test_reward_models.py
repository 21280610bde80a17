"""Reward models: agreement by hand, step alignment, data generation, training, saving, the loop."""

import json
import random

import pytest
import torch

from covey import algos
from covey.batch import Rollout
from covey.cli.main import main
from covey.config import load_config
from covey.models.tiny import tiny_tokenizer
from covey.rewards.learned import (
    OutcomeRewardModel,
    ProcessRewardModel,
    RewardModelError,
    decode_separator,
    encode,
    end_marker_text,
    step_spans,
    step_token_ends,
)
from covey.rewards.steps import process_step_inputs
from covey.rm.data import (
    PreferencePair,
    RewardDataError,
    StepExample,
    corrupted_solutions,
    counterfactual_pairs,
    counterfactual_steps,
    load_rm_data,
    pairs_from_group,
    save_rm_data,
    split_by_prompt,
    swap_final_answer,
)
from covey.rm.refresh import ReplayBuffer, pairwise_agreement, replay_count
from covey.rm.trainer import RMRun, train_reward_model
from covey.tasks.multistep import generate_multistep, label_steps, reference_steps, split_steps
from tests.helpers import tiny_overrides

# --------------------------------------------------------------------------- agreement by hand


def test_pairwise_agreement_by_hand():
    scores = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    # group 0: (0>1) yes, (0>2) yes; group 1: (3 vs 4) tie -> 1/2. Mean = 2.5 / 3
    assert pairwise_agreement(scores, labels, groups) == pytest.approx(2.5 / 3)
    assert pairwise_agreement(scores, torch.zeros(5), groups) is None


# --------------------------------------------------------------------------- steps and tokens


def test_step_spans_are_the_pieces_of_split_steps():
    text = "  12 + 7 = 19 \n\n19 * 3 = 57\n  \nAnswer: 57\n"
    assert [text[a:b] for a, b in step_spans(text)] == split_steps(text)
    assert [text[a:b] for a, b in step_spans(text, "\n\n")] == split_steps(text, "\n\n")
    assert decode_separator("\\n") == "\n" and decode_separator(" || ") == " || "


def test_read_out_positions_are_each_steps_last_token():
    tok = tiny_tokenizer()
    text = "12 + 7 = 19\n19 * 3 = 57\nAnswer: 57"
    enc = encode(tok, ["What?"], [text], max_length=384, separator="\n")
    prefix = [tok.decode(enc.input_ids[0, :p + 1]) for p in enc.positions[0].tolist()]
    assert [p.endswith(end) for p, end in zip(prefix, ["= 19", "= 57", "Answer: 57"])] == [True] * 3
    assert not any(tok.decode(enc.input_ids[0, :p]).endswith(end)  # one token earlier is not enough
                   for p, end in zip(enc.positions[0].tolist(), ["= 19", "= 57", "Answer: 57"]))
    short = encode(tok, ["What?"], [text], max_length=10, separator="\n")  # the first step is cut off
    assert short.position_mask[0].tolist() == [False, True, True] and short.counts == [3]


def test_end_marker_moves_the_last_read_out_onto_eos():
    """With the end marker a PRM reads its last step on the EOS token after it, so "stopped here"
    and "goes on" read different tokens; the other steps and the step count stay the same."""
    tok = tiny_tokenizer()
    eos = end_marker_text(tok, True)
    assert eos == tok.eos_token and end_marker_text(tok, False) == ""
    text = "12 + 7 = 19\n19 * 3 = 57\n\n"  # trailing blank lines go first: still two steps
    plain = encode(tok, ["What?"], [text], max_length=384, separator="\n")
    marked = encode(tok, ["What?"], [text], max_length=384, separator="\n", end_text=eos)
    assert marked.counts == plain.counts == [2]
    first, last = marked.positions[0].tolist()
    assert first == plain.positions[0, 0] and marked.input_ids[0, last] == tok.eos_token_id
    assert last == int(marked.attention_mask[0].sum()) - 1
    assert encode(tok, ["What?"], ["  "], 384, "\n", eos).counts == [0]  # no step: no marker either


def test_a_continued_prm_keeps_its_end_marker_setting(tmp_path):
    from covey.rm.trainer import uses_end_marker
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, meta in ((old, {"objective": "prm"}), (new, {"objective": "prm", "end_marker": True})):
        folder.mkdir()
        (folder / "covey_rm.json").write_text(json.dumps(meta))
    assert uses_end_marker(str(old), "prm") is False  # saved before the marker: read as it was trained
    assert uses_end_marker(str(new), "prm") is True
    assert uses_end_marker(str(tmp_path / "a-policy"), "prm") is True  # a new PRM from a policy backbone
    assert uses_end_marker(str(new), "bt") is False  # an outcome RM reads the last token anyway


def test_step_token_ends_map_steps_to_policy_tokens():
    tok = tiny_tokenizer()
    ids = tok("12 + 7 = 19\n19 * 3 = 57\nAnswer: 57", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text, ends = step_token_ends(tok, ids)
    assert text == "12 + 7 = 19\n19 * 3 = 57\nAnswer: 57"
    assert tok.decode(ids[:ends[0] + 1]).endswith("= 19") and tok.decode(ids[:ends[1] + 1]).endswith("= 57")
    assert ends[-1] == len(ids) - 1  # the last step carries the EOS token too
    assert step_token_ends(tok, [tok.eos_token_id]) == ("", [])


# --------------------------------------------------------------------------- data


def test_pairs_from_group_pairs_distinct_correct_with_incorrect():
    pairs = pairs_from_group("q", ["12", "12", "13", "x", "The answer is 12", ""], [1, 1, 0, 0, 1, 0], limit=5)
    assert pairs == [PreferencePair("q", "12", "13"), PreferencePair("q", "The answer is 12", "x")]
    assert len(pairs_from_group("q", ["1", "2"], [1, 1], limit=5)) == 0


def test_swap_final_answer_rewrites_the_answer_not_the_operands():
    # the restated answer changes everywhere it stands
    assert swap_final_answer("What is 42 * 9?", "42 * 9 = 378. The answer is 378.", "378", "374") == \
        "42 * 9 = 374. The answer is 374."
    # 10 is also an operand of the prompt: only its last occurrence is the answer
    assert swap_final_answer("What is 10 * 1?", "10 * 1 = 10", "10", "12") == "10 * 1 = 12"
    # 37 inside 378 is not the number 37
    assert swap_final_answer("What is 42 * 9?", "42 * 9 = 378", "37", "40") is None
    # a marked answer elsewhere wins over the swapped last number: the result would not read as 5
    assert swap_final_answer("q", "#### 7\nthen 3", "3", "5") is None


def test_counterfactual_pairs_differ_only_in_a_verified_answer():
    pair = PreferencePair("What is 42 * 9?", "42 * 9 = 378", "I think it is 374.")
    made = counterfactual_pairs([pair], per_pair=4, rng=random.Random(0))
    assert len(made) == 4
    # 1: the correct text with the sampled wrong answer; 2: the wrong text with the right answer
    assert (made[0].chosen, made[0].rejected) == ("42 * 9 = 378", "42 * 9 = 374")
    assert (made[1].chosen, made[1].rejected) == ("I think it is 378.", "I think it is 374.")
    for p in made[2:]:  # 3-4: the correct text against nearby wrong numbers, same wording
        wrong = int(p.rejected.split("= ")[1])
        assert p.chosen == "42 * 9 = 378" and 0 < abs(wrong - 378) <= 30 and wrong != 374
    # no pair repeats the sampled one; pairs whose answers cannot be read are skipped
    assert all((p.chosen, p.rejected) != (pair.chosen, pair.rejected) for p in made)
    assert counterfactual_pairs([PreferencePair("q", "no number", "1")], 4, random.Random(0)) == []
    # near numbers keep the sign of the right answer: offsets -3..-1 and 1..30 (33), less the
    # sampled wrong answer 4 = 32 pairs; both swaps of "= 3" / "= 4" give back the sampled pair
    small = counterfactual_pairs([PreferencePair("What is 1 * 3?", "= 3", "= 4")], 40, random.Random(0))
    assert sorted(int(p.rejected.split("= ")[1]) for p in small) == [0, 1, 2] + list(range(5, 34))


def test_counterfactual_steps_are_wrong_results_with_exact_labels():
    examples = generate_multistep(3, seed=2, min_ops=3, max_ops=3)
    train = [StepExample(ex.prompt, ex.meta["solution"], [1, 1, 1]) for ex in examples[:2]]
    made = counterfactual_steps(train, examples, per_prompt=2, rng=random.Random(0))
    assert {m.prompt for m in made} <= {ex.prompt for ex in examples[:2]}  # only training prompts
    assert 3 <= len(made) <= 4  # 2 per prompt, fewer only if two draws coincide
    for row in made:
        ex = next(e for e in examples if e.prompt == row.prompt)
        right = reference_steps(ex.meta["start"], ex.meta["ops"])
        lines = split_steps(row.completion)
        k = row.labels.index(0)  # the first wrong step: same operands and operator, another result
        assert lines[:k] == right[:k] and row.labels[:k] == [1] * k
        assert lines[k].rsplit("=", 1)[0] == right[k].rsplit("=", 1)[0]
        assert 1 <= abs(int(lines[k].rsplit("=", 1)[1]) - int(right[k].rsplit("=", 1)[1])) <= 12
        assert row.labels[k:] == [0] * (len(lines) - k)  # later steps carry the wrong value, the answer too
        assert row.labels == label_steps(ex, row.completion)[1]


def test_corrupted_solutions_have_exact_labels():
    for ex in generate_multistep(20, seed=3):
        right, wrong = corrupted_solutions(ex, random.Random(0))
        assert label_steps(ex, right)[1] == [1] * (len(ex.meta["ops"]) + 1)
        labels = label_steps(ex, wrong)[1]
        k = labels.index(0)
        assert labels == [1] * k + [0] * (len(labels) - k)  # right until the injected error, wrong after


def test_rm_data_files_roundtrip_and_errors(tmp_path):
    pairs = [PreferencePair("q", "a", "b"), PreferencePair("r", "c", "d")]
    save_rm_data(tmp_path / "p.jsonl", pairs)
    assert load_rm_data(tmp_path / "p.jsonl", "bt") == pairs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q"\n')
    with pytest.raises(RewardDataError, match=f"{bad}:2: invalid JSON"):
        load_rm_data(bad, "bt")
    bad.write_text('{"prompt": "q", "completion": "1 + 1 = 2\\nAnswer: 2", "labels": [1]}\n')
    with pytest.raises(RewardDataError, match=":1: 1 labels for 2 steps"):
        load_rm_data(bad, "prm")
    bad.write_text('{"prompt": "q"}\n')
    with pytest.raises(RewardDataError, match=r":1: missing key\(s\) chosen, rejected for objective bt"):
        load_rm_data(bad, "bt")


def test_split_by_prompt_keeps_prompts_on_one_side():
    pairs = [PreferencePair(f"q{i % 10}", "a", str(i)) for i in range(50)]
    train, held = split_by_prompt(pairs, 0.2, seed=0)
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    assert len({p.prompt for p in held}) == 2 and len(train) + len(held) == 50


def test_replay_buffer_fraction_capacity_and_state():
    assert replay_count(90, 0.1) == 10 and replay_count(9, 0.5) == 9 and replay_count(10, 0.0) == 0
    buf = ReplayBuffer(capacity=5, seed=1)
    buf.add([StepExample("q", str(i), [1]) for i in range(20)])
    assert len(buf) == 5 and buf.seen == 20
    copy = ReplayBuffer(capacity=5, seed=9)
    copy.load_state_dict(buf.state_dict())
    assert copy.items == buf.items and copy.sample(3) == buf.sample(3)


# --------------------------------------------------------------------------- training on the tiny model


def train_rm(cfg, log):
    """`train_reward_model` on the sections of a whole config, as `covey train-rm` calls it."""
    return train_reward_model(cfg.rm, cfg.task, cfg.rollout, cfg.model,
                              RMRun(cfg.reward.step_separator, cfg.train.seed), log=log)


def _separable_pairs(n):
    """Chosen answers end with the real product, rejected ones with a '?': learnable by a tiny model."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        out.append(PreferencePair(f"What is {a} * {b}?", f"The answer is {a * b}.", f"I think ?? {a}"))
    return out


@pytest.fixture(scope="module")
def tiny_rm(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    save_rm_data(root / "pairs.jsonl", _separable_pairs(40))
    cfg = load_config(None, [f"rm.base_model={tiny_model_dir}", f"rm.data={root / 'pairs.jsonl'}",
                             f"rm.output={root / 'rm'}", "rm.train_epochs=3", "rm.learning_rate=3e-3",
                             "rm.batch_size=8"])
    meta = train_rm(cfg, log=lambda *a: None)
    return root / "rm", meta


def test_bt_training_separates_held_out_pairs_and_saves(tiny_rm):
    folder, meta = tiny_rm
    assert meta["before"]["rm/pair_accuracy"] == 0.5  # zero head: every pair is a tie
    assert meta["after"]["rm/pair_accuracy"] >= 0.9 and meta["n_train"] + meta["n_eval"] == 40
    rm = OutcomeRewardModel.load(folder)
    held = load_rm_data(folder / "eval_data.jsonl", "bt")
    chosen = rm([p.prompt for p in held], [p.chosen for p in held])
    rejected = rm([p.prompt for p in held], [p.rejected for p in held])
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(held)
    assert accuracy == pytest.approx(meta["after"]["rm/pair_accuracy"])  # the saved model is the trained one
    with pytest.raises(RewardModelError, match="holds a 'bt' reward model, expected 'prm'"):
        ProcessRewardModel.load(folder)


def test_counterfactual_pairs_join_the_training_side_only(tiny_model_dir, tmp_path):
    sampled = _separable_pairs(20)
    save_rm_data(tmp_path / "pairs.jsonl", sampled)
    cfg = load_config(None, [f"rm.base_model={tiny_model_dir}", f"rm.data={tmp_path / 'pairs.jsonl'}",
                             f"rm.output={tmp_path / 'rm'}", "rm.train_epochs=1", "rm.counterfactuals=3"])
    meta = train_rm(cfg, log=lambda *a: None)
    train = load_rm_data(tmp_path / "rm" / "train_data.jsonl", "bt")
    held = load_rm_data(tmp_path / "rm" / "eval_data.jsonl", "bt")
    # held-out accuracy is measured on sampled pairs only; every training pair gets 3 more
    # ("The answer is a*b." vs "I think ?? a": swap a in, swap a*b in, one nearby number)
    assert all(p in sampled for p in held) and meta["n_eval"] == len(held)
    assert meta["n_counterfactual"] == 3 * (20 - len(held)) and len(train) == meta["n_train"] == 4 * (20 - len(held))
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})


def test_train_rm_cli_errors_are_one_line(tmp_path, capsys, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["train-rm", f"rm.data={bad}", f"rm.base_model={tiny_model_dir}"]) == 2
    assert capsys.readouterr().err.strip() == (f"covey train-rm: error: {bad}:1: invalid JSON "
                                               "(Expecting property name enclosed in double quotes)")
    assert main(["train-rm", "rm.objective=orm"]) == 2
    assert "rm.objective='orm' is not one of: bt, prm" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_prm(tiny_model_dir, tmp_path_factory):
    """A PRM trained on generated multistep data (tiny policy samples + reference + corrupted)."""
    root = tmp_path_factory.mktemp("prm")
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"rm.base_model={tiny_model_dir}", "rm.objective=prm",
                             "task.name=multistep", "task.train_size=16", "rm.num_examples=40",
                             "rm.samples_per_prompt=2", "rollout.max_new_tokens=8", "rollout.prompts_per_step=8",
                             f"rm.output={root / 'prm'}", "rm.train_epochs=1", "rm.learning_rate=1e-3",
                             f"rm.save_data={root / 'generated.jsonl'}"])
    return root / "prm", train_rm(cfg, log=lambda *a: None)


def test_prm_generation_and_training_report_step_accuracy(tiny_prm):
    folder, meta = tiny_prm
    rows = load_rm_data(folder / "train_data.jsonl", "prm") + load_rm_data(folder / "eval_data.jsonl", "prm")
    generated = load_rm_data(folder.parent / "generated.jsonl", "prm")  # rm.save_data: the same rows, reusable
    assert sorted(map(repr, generated)) == sorted(map(repr, rows))
    assert len(rows) == 40 and any(1 in r.labels for r in rows) and any(0 in r.labels for r in rows)
    assert meta["end_marker"] and ProcessRewardModel.load(folder).end_text  # a new PRM reads the end; kept on reload
    for key in ("rm/step_accuracy", "rm/step_balanced_accuracy", "rm/positive_step_frac"):
        assert 0.0 <= meta["after"][key] <= 1.0
    prm = ProcessRewardModel.load(folder)
    probs = prm.step_probabilities(["q", "q"], ["1 + 1 = 2\nAnswer: 2", ""])
    assert len(probs[0]) == 2 and probs[1] == [] and all(0 < p < 1 for p in probs[0])
    assert prm(["q", "q"], ["1 + 1 = 2\nAnswer: 2", ""]) == [min(probs[0]), 0.0]


def test_prm_counterfactuals_join_the_training_side_only(tiny_prm, tiny_model_dir, tmp_path):
    folder, _ = tiny_prm  # trained on generated.jsonl; the same data again with 2 wrong results per prompt
    cfg = load_config(None, [f"rm.base_model={tiny_model_dir}", "rm.objective=prm", "task.name=multistep",
                             "task.train_size=16", f"rm.data={folder.parent / 'generated.jsonl'}",
                             f"rm.output={tmp_path / 'prm'}", "rm.train_epochs=1", "rm.counterfactuals=2"])
    meta = train_rm(cfg, log=lambda *a: None)
    assert (tmp_path / "prm" / "eval_data.jsonl").read_text() == (folder / "eval_data.jsonl").read_text()
    train = load_rm_data(tmp_path / "prm" / "train_data.jsonl", "prm")
    before = load_rm_data(folder / "train_data.jsonl", "prm")
    assert train[:len(before)] == before and len(train) == len(before) + meta["n_counterfactual"]
    prompts = {row.prompt for row in before}
    assert 0 < meta["n_counterfactual"] <= 2 * len(prompts)
    assert all(row.prompt in prompts and 0 in row.labels for row in train[len(before):])


def test_prm_batch_metrics_by_hand():
    from covey.rewards.steps import prm_batch_metrics
    # 6 steps: labels 1 0 0 | 0 0 1; PRM p: .9 .8 .1 | .2 .6 .4 -> called right: steps 1, 2, 5.
    # accuracy: steps 1, 3, 4 agree -> 3/6; precision: of 3 called right, 1 is right -> 1/3;
    # false positives: of 4 wrong steps (2, 3, 4, 5), 2 are called right (2, 5) -> 1/2.
    out = prm_batch_metrics([[0.9, 0.8, 0.1], [0.2, 0.6, 0.4]], [[1, 0, 0], [0, 0, 1]])
    assert out == pytest.approx({"prm/step_accuracy": 0.5, "prm/step_precision": 1 / 3,
                                 "prm/step_false_positive_rate": 0.5})
    # nothing called right, no wrong step: only the accuracy is defined
    assert prm_batch_metrics([[0.1]], [[1]]) == {"prm/step_accuracy": 0.0}


def test_process_step_inputs_exact_labels_feed_grpo_process():
    tok = tiny_tokenizer()
    ex = generate_multistep(1, seed=5, min_ops=2, max_ops=2)[0]
    right, wrong = corrupted_solutions(ex, random.Random(1))
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in (right, wrong)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    rollout = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                      response_ids=ids, response_mask=mask, group_ids=torch.tensor([0, 0]),
                      truncated=torch.tensor([False, False]), completions=[right, wrong], example_index=[0, 0],
                      scores=torch.zeros(2))
    steps, metrics = process_step_inputs(rollout, tok, ["p"], [ex], None, "exact", "\\n")
    labels = [label_steps(ex, t)[1] for t in (right, wrong)]
    assert steps["step_scores"][steps["step_mask"]].tolist() == [float(v) for lab in labels for v in lab]
    assert steps["step_ends"][0, 2].item() == len(rows[0]) - 1 and metrics["steps/per_sample"] == 3.0
    adv, _, _ = algos.compute_advantages("grpo_process", algos.AdvantageInput(
        scores=rollout.scores, response_mask=mask, group_ids=rollout.group_ids, **steps))
    assert adv[0, 0] > 0 > adv[1, -1 if mask[1, -1] else int(mask[1].sum()) - 1]  # right > wrong where they differ


# --------------------------------------------------------------------------- the training loop


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_rewarded_only_by_the_learned_rm(tiny_rm, tiny_model_dir, tmp_path):
    folder, _ = tiny_rm
    code = main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "reward.correctness": 0, "reward.model_path": str(folder), "reward.iterative_every": 1})])
    assert code == 0
    steps = [r for r in _metrics(tmp_path / "t") if "reward/mean" in r]
    for row in steps:
        assert row["reward/mean"] == pytest.approx(row["reward/rm"], abs=1e-5)  # only the RM pays
        assert "reward/correctness" in row and "accuracy" in row  # the verifier is only watched
        assert row.get("rm/refresh_skipped") == 1 or "rm/acc_before_refresh" in row


def test_process_supervision_with_iterative_prm_and_resume(tiny_prm, tiny_model_dir, tmp_path):
    folder, _ = tiny_prm
    extra = {"task.name": "multistep", "algo.estimator": "grpo_process", "reward.prm_path": str(folder),
             "reward.iterative_every": 1, "train.save_every": 1, "rollout.group_size": 2, "task.eval_size": 2}
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **extra)]) == 0
    rows = [r for r in _metrics(tmp_path / "t") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("steps/per_sample", "prm/step_accuracy", "prm/acc_before_refresh", "prm/acc_after_refresh",
                "prm/replay_size", "time/score_steps"):
        assert key in rows[-1], key
    assert rows[-1]["prm/refresh_replayed"] == replay_count(rows[-1]["prm/refresh_fresh"], 0.1)
    state = torch.load(tmp_path / "t" / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    saved = state["extra"]["reward_model/prm"]
    assert set(saved) == {"model", "trainer", "replay", "pending"} and saved["pending"] == []
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **extra, **{
        "train.steps": 3, "train.resume": "auto"})]) == 0  # the PRM, its optimizer and replay come back
    assert [r["step"] for r in _metrics(tmp_path / "t") if "reward/mean" in r][-1] == 3


def test_process_supervision_with_the_outcome_on_the_last_step_runs_in_the_loop(tiny_model_dir, tmp_path, monkeypatch):
    from covey.training import rl
    seen = []
    real = rl.add_outcome_to_last_step

    def spy(scores, mask, outcome, weight):
        seen.append(weight)
        return real(scores, mask, outcome, weight)
    monkeypatch.setattr(rl, "add_outcome_to_last_step", spy)
    extra = {"task.name": "multistep", "algo.estimator": "grpo_process", "reward.step_source": "exact",
             "reward.process_outcome_weight": 0.5, "task.eval_size": 2}
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **extra)]) == 0
    assert seen == [0.5, 0.5]  # once per step, with the configured weight


@pytest.mark.parametrize("overrides, message", [
    (["algo.estimator=grpo_process"], "scores steps with a PRM: set reward.prm_path"),
    (["algo.estimator=grpo_process", "reward.step_source=exact"], "needs task.name=multistep"),
    (["reward.iterative_every=2"], "needs a learned reward model"),
    (["reward.replay_fraction=1.0", "reward.model_path=x"], "replay_fraction must lie in [0, 1)"),
    (["rm.samples_per_prompt=0"], "rm.samples_per_prompt must be >= 1 for bt pairs"),
    (["rm.objective=prm", "rm.samples_per_prompt=-1"], "and >= 0 for prm data, got -1"),
    (["rm.objective=prm", "rm.samples_per_prompt=0", "rm.corruptions_per_prompt=0"], "a PRM needs wrong steps too"),
    (["rm.corruptions_per_prompt=-2"], "rm.corruptions_per_prompt must be >= 0, got -2"),
    (["rm.corruption_kinds=result,typo"], "rm.corruption_kinds='result,typo': choose from result, operand"),
    (["rm.counterfactuals=-1"], "rm.counterfactuals must be >= 0, got -1"),
    (["rm.objective=prm", "rm.counterfactuals=2"], "rm.counterfactuals for a PRM needs exact step labels"),
])
def test_config_rejects_unusable_reward_setups(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_prm_data_without_the_policy_is_reference_plus_corruptions(tmp_path):
    from covey.rm.data import generate_rm_data
    # model.path does not exist: with rm.samples_per_prompt=0 the policy is never loaded
    cfg = load_config(None, [f"model.path={tmp_path / 'absent'}", "rm.objective=prm", "task.name=multistep",
                             "task.train_size=10", "rm.num_examples=1000", "rm.samples_per_prompt=0",
                             "rm.corruptions_per_prompt=3", "rm.corruption_kinds=operator,carry"])
    rows = generate_rm_data(cfg.rm, cfg.task, cfg.rollout, policy_path=cfg.model.path,
                            step_separator=cfg.reward.step_separator, seed=cfg.train.seed, log=lambda *a: None)
    by_prompt = {}
    for row in rows:
        by_prompt.setdefault(row.prompt, []).append(row)
    assert len(by_prompt) == 10
    for group in by_prompt.values():
        # the reference (all steps right) first, then up to 3 distinct corrupted copies, each with an error
        assert set(group[0].labels) == {1} and 2 <= len(group) <= 4
        assert all(0 in row.labels for row in group[1:])
        # operator / carry errors keep every result consistent with its own operands
        for row in group[1:]:
            for line in row.completion.split("\n")[:-1]:
                a, op, b, _, c = line.split()
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)


def test_rewarder_composes_language_rm_and_monitors_the_verifier(tiny_rm):
    from covey.rewards.build import build_rewarder
    from covey.training.plan import make_plan
    folder, _ = tiny_rm
    cfg = load_config(None, ["reward.correctness=0", f"reward.model_path={folder}", "reward.language=0.5",
                             "reward.language_target=zh"])
    rewarder = build_rewarder(make_plan(cfg).rewards)
    assert [(t.name, t.weight) for t in rewarder.terms] == [("correctness", 0.0), ("language", 0.5), ("rm", 1.0)]
    scores = rewarder(["What is 3 * 4?"] * 2, ["答案是 12", "The answer is 12."], {"answer": ["12", "12"]})
    assert scores.parts["correctness"].tolist() == [1.0, 1.0] and scores.parts["language"].tolist() == [1.0, 0.0]
    expected = 0.5 * scores.parts["language"] + scores.parts["rm"]  # the verifier is watched, not paid
    assert torch.allclose(scores.total, expected)


@pytest.mark.slow
def test_real_backbone_bt_training_step_and_reload(tmp_path):
    """SmolLM2 backbone: a short Bradley-Terry run lowers the training loss and the folder reloads."""
    pairs = [PreferencePair(f"What is {a} * 7?", f"{a} * 7 = {a * 7}", f"{a} * 7 = {a * 7 + 3}") for a in range(12, 20)]
    save_rm_data(tmp_path / "pairs.jsonl", pairs)
    cfg = load_config(None, ["rm.base_model=default", f"rm.data={tmp_path / 'pairs.jsonl'}", "rm.train_layers=2",
                             "rm.train_epochs=2", "rm.batch_size=4", "rm.learning_rate=1e-4", "rm.eval_fraction=0.25",
                             f"rm.output={tmp_path / 'rm'}"])
    losses = []
    meta = train_rm(cfg, log=lambda *a: losses.append(a[0]) if isinstance(a[0], str) and "loss" in a[0] else None)
    first, last = (float(line.split("loss ")[1].split()[0]) for line in (losses[0], losses[-1]))
    assert last < first and meta["n_train"] == 6
    rm = OutcomeRewardModel.load(tmp_path / "rm")
    assert len(rm(["What is 12 * 7?"], ["84"])) == 1


def test_iterative_refresh_is_refused_under_torchrun():
    from covey.config import ConfigError, validate_world
    cfg = load_config(None, ["reward.iterative_every=2", "reward.model_path=x", "rollout.prompts_per_step=4"])
    validate_world(cfg, 1)
    with pytest.raises(ConfigError, match="reward.iterative_every is not supported yet"):
        validate_world(cfg, 2)


# --------------------------------------------------------------------------- frozen-layer cache


def _tiny_value_model(train_layers):
    from covey.models.critic import ValueModel
    from covey.models.tiny import tiny_llama
    from covey.rm.trainer import freeze_lower_layers
    tok = tiny_tokenizer()
    model = ValueModel(tiny_llama(len(tok), num_layers=4, seed=3).model)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # a non-zero head, so values differ per position
    freeze_lower_layers(model, train_layers)
    return model, tok


def test_frozen_prefix_split_forward_equals_the_full_forward():
    model, tok = _tiny_value_model(train_layers=1)
    assert model.frozen_prefix() == 3  # 4 layers, the top one trains
    enc = encode(tok, ["q one", "a longer question two"], ["1 + 1 = 2\nAnswer: 2", "x"], 64, "\n")
    assert enc.attention_mask[1].sum() != enc.attention_mask[0].sum()  # right padding is exercised
    full = model(enc.input_ids, enc.attention_mask)
    hidden = model.hidden_below(enc.input_ids, enc.attention_mask, 3)
    split = model.values_from_hidden(hidden, enc.attention_mask, 3)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(split[real], full[real], atol=1e-5, rtol=1e-5)
    assert len(model.backbone.layers) == 4 and not isinstance(model.backbone.norm, torch.nn.Identity)  # restored
    everything, _ = _tiny_value_model(train_layers=0)
    assert everything.frozen_prefix() == 0  # embeddings train: nothing can be cached


def test_fit_with_the_frozen_layer_cache_matches_fit_without_it(monkeypatch):
    from covey.rm.trainer import RMTrainer
    examples = [StepExample(ex.prompt, sol, label_steps(ex, sol)[1])
                for ex in generate_multistep(6, seed=2) for sol in corrupted_solutions(ex, random.Random(0))]
    runs = []
    for cached in (True, False):
        model, tok = _tiny_value_model(train_layers=1)
        trainer = RMTrainer(model, tok, "prm", lr=1e-2, batch_size=4, max_length=128, seed=0)
        if not cached:
            monkeypatch.setattr(trainer, "cache_frozen_layers", lambda ex: 0)
        losses = []
        trainer.fit(examples, epochs=3, log=lambda epoch, loss: losses.append(loss))
        assert trainer.hidden_cache == {}  # dropped after fit: evaluation reads the live model
        runs.append((losses, trainer.evaluate(examples)["rm/step_accuracy"], model.head.weight.detach().clone()))
    (cached_losses, cached_acc, cached_head), (plain_losses, plain_acc, plain_head) = runs
    assert cached_losses == pytest.approx(plain_losses, abs=1e-5) and cached_losses[-1] < cached_losses[0]
    assert cached_acc == plain_acc
    torch.testing.assert_close(cached_head, plain_head, atol=1e-5, rtol=1e-4)


def test_bf16_autocast_values_match_fp32_and_training_still_learns():
    """model.autocast=bfloat16 runs the RM's passes in bf16 (native on AVX512-BF16 / AMX / GPUs):
    values stay within bf16 rounding of fp32 on both paths (whole inputs and the frozen-layer
    cache), come back as fp32, and a bf16 fit still lowers the loss."""
    from covey.rm.trainer import RMTrainer
    examples = [StepExample(ex.prompt, sol, label_steps(ex, sol)[1])
                for ex in generate_multistep(6, seed=2) for sol in corrupted_solutions(ex, random.Random(0))]
    model, tok = _tiny_value_model(train_layers=1)
    plain = RMTrainer(model, tok, "prm", lr=1e-2, batch_size=4, max_length=128, seed=0)
    bf16 = RMTrainer(model, tok, "prm", lr=1e-2, batch_size=4, max_length=128, seed=0, precision="bfloat16")
    rows = plain._rows(examples[:4])
    with torch.no_grad():
        reference, enc = plain._values(*rows)
        whole, _ = bf16._values(*rows)
        bf16.cache_frozen_layers(examples[:4])
        cached, _ = bf16._values(*rows)
        bf16.hidden_cache, bf16.cached_layers = {}, 0
    assert whole.dtype == cached.dtype == torch.float32
    real = enc.position_mask
    scale = reference[real].abs().max()
    for values in (whole, cached):  # bf16 keeps 8 bits of mantissa: ~1% of the values' scale
        assert (values[real] - reference[real]).abs().max() < 0.05 * scale
    losses = []
    bf16.fit(examples, epochs=3, log=lambda epoch, loss: losses.append(loss))
    assert losses[-1] < losses[0]


def test_step_accuracy_by_category_by_hand():
    from covey.rm.trainer import step_accuracy_by_category
    ex = generate_multistep(1, seed=5, min_ops=2, max_ops=2)[0]
    first, second = reference_steps(ex.meta["start"], ex.meta["ops"])
    right = f"{first}\n{second}"
    value = int(first.rsplit("=", 1)[1])
    wrong = f"{first.rsplit('=', 1)[0]}= {value + 1}\nAnswer: {value + 1}"  # result error, then a wrong answer
    rows = [StepExample(ex.prompt, right, [1, 1]), StepExample(ex.prompt, wrong, [0, 0]),
            StepExample("not a task prompt", "1 + 1 = 2", [1])]
    # hits: both correct steps right; first error missed; the step after it right; the stray row ignored
    out = step_accuracy_by_category([ex], rows, [[True, True], [False, True], [False]])
    assert out == {"rm/step_accuracy/correct": 1.0, "rm/step_count/correct": 2,
                   "rm/step_accuracy/first_error_result": 0.0, "rm/step_count/first_error_result": 1,
                   "rm/step_accuracy/after_error": 1.0, "rm/step_count/after_error": 1}


def test_evaluate_reports_hits_per_step():
    from covey.rm.trainer import RMTrainer
    model, tok = _tiny_value_model(train_layers=0)
    torch.nn.init.zeros_(model.head.weight)  # logit 0 everywhere: every step is predicted wrong
    rows = [StepExample("q", "1 + 1 = 2\n2 + 2 = 5", [1, 0]), StepExample("q", "a\nb\nc", [0, 0, 1])]
    trainer = RMTrainer(model, tok, "prm", lr=1e-3, batch_size=8, max_length=128)
    hits: list = []
    out = trainer.evaluate(rows, hits)
    assert hits == [[False, True], [True, True, False]]
    assert out["rm/step_accuracy"] == pytest.approx(3 / 5)


def test_eval_rm_cli_matches_training_and_breaks_steps_down(tiny_prm, capsys, tmp_path):
    folder, meta = tiny_prm
    # overrides may follow an option (argparse alone would reject them there)
    assert main(["eval-rm", str(folder), "--data", str(folder / "eval_data.jsonl"), "task.name=multistep",
                 "task.train_size=16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rm/step_accuracy"] == pytest.approx(meta["after"]["rm/step_accuracy"])  # same data, same model
    counts = {k: v for k, v in out.items() if k.startswith("rm/step_count/")}
    assert sum(counts.values()) == out["rm/eval_n"] and "rm/step_count/correct" in counts
    assert main(["eval-rm", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"covey eval-rm: error: {tmp_path}: not a covey reward model folder "
                                               "(no covey_rm.json)")


@pytest.mark.parametrize("objective", ["bt", "prm"])
def test_prompt_shared_scoring_equals_whole_inputs(objective, tiny_rm, tiny_prm, monkeypatch):
    """Completions of one prompt scored on its KV cache give the values of whole padded inputs."""
    cls, (folder, _) = (OutcomeRewardModel, tiny_rm) if objective == "bt" else (ProcessRewardModel, tiny_prm)
    model = cls.load(folder, max_length=60)
    prompts = ["What is 12 * 3?"] * 4 + ["What is 7 * 8?"] * 3 + ["q"]
    completions = ["12 * 3 = 36\nAnswer: 36", "36", "I think\n12 * 3 = 38", " leading space 36",
                   "7 * 8 = 56", "\n\nAnswer: 54", "x " * 80 + "56",  # longer than max_length: runs whole, cut
                   "1 + 1 = 2"]
    shared_rows = []
    original = cls._prefix_values
    monkeypatch.setattr(cls, "_prefix_values",
                        lambda self, head, pieces: shared_rows.append(len(pieces)) or original(self, head, pieces))

    def values():
        if objective == "bt":
            return [[score] for score in model.scores(prompts, completions)]
        return model.step_probabilities(prompts, completions)

    shared = values()
    model.share_prompt = False
    whole = values()
    assert 5 <= sum(shared_rows) <= 7  # the cut input never shares
    assert [len(v) for v in shared] == [len(v) for v in whole]
    assert sum(len(v) for v in whole) > len(whole) or objective == "bt"  # several steps per completion
    flat = [torch.tensor([x for v in values for x in v], dtype=torch.float64) for values in (shared, whole)]
    torch.testing.assert_close(*flat, atol=1e-5, rtol=1e-5)


def test_outcome_on_the_last_step_makes_a_whole_right_answer_beat_a_right_first_step():
    from covey.rewards.steps import add_outcome_to_last_step
    # Group of 3: a whole right solution (steps 1, 1, answer 1; outcome 1), a stop after one
    # right step (1; outcome 0) and an empty response (no step).
    scores = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    ends = torch.tensor([[1, 3, 5], [1, 0, 0], [0, 0, 0]])
    out = add_outcome_to_last_step(scores, mask, torch.tensor([1.0, 0.0, 1.0]), 2.0)
    # Only the last real step moves: 1 + 2 * 1 = 3 for row 0; row 1 gets + 2 * 0; row 2 has no step.
    assert out.tolist() == [[1.0, 1.0, 3.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert scores[0, 2] == 1.0  # the input is left as it was
    inp = dict(scores=torch.zeros(3), response_mask=torch.ones(3, 6), group_ids=torch.zeros(3, dtype=torch.long),
               step_ends=ends, step_mask=mask)
    # Without the outcome all four step rewards are 1: every advantage is 0, the stop looks as good.
    plain, _, _ = algos.compute_advantages("grpo_process", algos.AdvantageInput(step_scores=scores, **inp))
    assert plain[:2].abs().max() == 0
    # With it the steps are (1, 1, 3, 1): mean 1.5, std (ddof 0) sqrt((.5^2 * 3 + 1.5^2) / 4) = sqrt(.75);
    # row 0's first token sums its three centred steps, -.5 - .5 + 1.5 = 0.5, over sqrt(.75): 0.5774;
    # row 1's single step: -0.5 / sqrt(.75) = -0.5774.
    shaped, _, _ = algos.compute_advantages("grpo_process", algos.AdvantageInput(step_scores=out, **inp))
    assert shaped[0, 0].item() == pytest.approx(0.5 / 0.75 ** 0.5, abs=1e-4)
    assert shaped[1, 0].item() == pytest.approx(-0.5 / 0.75 ** 0.5, abs=1e-4)
