"""Supervised fine-tuning: the assistant-only marks (a template with generation tags and one without, tool
calls), bad demonstrations, the packed pass against a padded one, the gradient's independence of the
micro-batch size, a 2-step `covey sft` whose first loss is recomputed here by a plain forward, and a warm-up
then RL in one run that resumes exactly across the switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from covey.cli.main import main
from covey.config import load_config
from covey.models.load import load_policy
from covey.passes.sequences import stack, token_scores
from covey.runtime.metrics import NONDETERMINISTIC_PREFIXES, read_metrics
from covey.tasks.data import PromptStream
from covey.tasks.files import DataError
from covey.tasks.sft_data import load_demos, render_demo, row_to_demo
from covey.training.plan import make_plan
from covey.training.sft import Demos, sft_gradient
from tests.helpers import tiny_overrides

# The tiny template with generation tags around what the assistant writes: its content and <|im_end|>, not the
# newline the template adds after it (the same tokens covey's turn-by-turn rendering marks).
TAGGED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7 * 8"}}}
TOOL_CHAT = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 7 * 8?"},
             {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "56"},
             {"role": "assistant", "content": "The answer is 56."}]
ROWS = [
    {"messages": [{"role": "user", "content": "What is 12 * 3?"}, {"role": "assistant", "content": "It is 36."}]},
    {"messages": TOOL_CHAT},
    {"prompt": "What is 5 + 4?", "completion": "The answer is 9."},
    {"prompt": [{"role": "user", "content": "What is 9 - 2?"}],
     "completion": [{"role": "assistant", "content": "The answer is 7."}]},
]


def trained_text(tokenizer, tokens) -> str:
    return tokenizer.decode([i for i, m in zip(tokens.ids, tokens.trained) if m])


def untrained_text(tokenizer, tokens) -> str:
    return tokenizer.decode([i for i, m in zip(tokens.ids, tokens.trained) if not m])


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- which tokens train


def test_turn_by_turn_marks_the_assistants_tokens_only(tiny_tokenizer):
    """The tiny template has no generation tags: covey renders turn by turn. The trained tokens are exactly the
    two assistant turns through <|im_end|>; the ids are the whole rendering's (this template only appends)."""
    demo = row_to_demo({"messages": [{"role": "user", "content": "What is 12 * 3?"},
                                     {"role": "assistant", "content": "It is 36."},
                                     {"role": "user", "content": "And 12 * 4?"},
                                     {"role": "assistant", "content": "It is 48."}]}, "demos.jsonl:1")
    tokens = render_demo(tiny_tokenizer, demo, 1024)
    assert trained_text(tiny_tokenizer, tokens) == "It is 36.<|im_end|>It is 48.<|im_end|>"
    assert untrained_text(tiny_tokenizer, tokens) == (
        "<|im_start|>user\nWhat is 12 * 3?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nAnd 12 * 4?<|im_end|>\n<|im_start|>assistant\n\n")
    full = tiny_tokenizer.apply_chat_template(list(demo.messages), tokenize=False)
    assert tokens.ids == tiny_tokenizer(full, add_special_tokens=False)["input_ids"]


def test_generation_tags_give_the_same_marks_as_turn_by_turn(tiny_tokenizer):
    """A template with {% generation %} tags: transformers' assistant mask is used; on these conversations it
    marks the very tokens covey's turn-by-turn rendering marks with the plain template."""
    plain = [render_demo(tiny_tokenizer, row_to_demo(r, f"d:{i}"), 1024) for i, r in enumerate(ROWS)]
    tiny_tokenizer.chat_template = TAGGED_TEMPLATE
    tagged = [render_demo(tiny_tokenizer, row_to_demo(r, f"d:{i}"), 1024) for i, r in enumerate(ROWS)]
    assert trained_text(tiny_tokenizer, tagged[0]) == "It is 36.<|im_end|>"
    for p, t in zip(plain, tagged):  # the tool calls too: neither template writes tool_calls
        assert (p.ids, p.trained) == (t.ids, t.trained)


def test_tool_calls_train_as_the_model_writes_them_and_tool_results_do_not(tiny_tokenizer):
    """The tiny template writes no tool_calls: the call goes into the assistant's content in covey's tags
    format, as an episode's model writes it; the tool's reply (56) and the system message are not trained."""
    tokens = render_demo(tiny_tokenizer, row_to_demo({"messages": TOOL_CHAT}, "d:1"), 1024)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
    assert trained_text(tiny_tokenizer, tokens) == f"{call}<|im_end|>The answer is 56.<|im_end|>"
    assert "<|im_start|>tool\n56<|im_end|>" in untrained_text(tiny_tokenizer, tokens)
    # arguments given as a JSON string (OpenAI's form) are read the same
    as_string = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7 * 8"}'}}
    chat = [*TOOL_CHAT[:2], {"role": "assistant", "content": None, "tool_calls": [as_string]}, *TOOL_CHAT[3:]]
    assert render_demo(tiny_tokenizer, row_to_demo({"messages": chat}, "d:2"), 1024) == tokens.__class__(
        tokens.ids, tokens.trained, "d:2")


def test_a_template_that_writes_tool_calls_is_given_them(tiny_tokenizer):
    tiny_tokenizer.chat_template = TAGGED_TEMPLATE.replace(
        "{{ message['content'] + '<|im_end|>' }}",
        "{{ message['content'] }}{% for c in message.get('tool_calls', []) %}[call {{ c['function']['name'] }}]"
        "{% endfor %}{{ '<|im_end|>' }}")
    tokens = render_demo(tiny_tokenizer, row_to_demo({"messages": TOOL_CHAT}, "d:1"), 1024)
    assert trained_text(tiny_tokenizer, tokens) == "[call calculator]<|im_end|>The answer is 56.<|im_end|>"


def test_plain_pairs_without_a_chat_template_train_the_completion_and_eos(tiny_tokenizer):
    tiny_tokenizer.chat_template = None
    tokens = render_demo(tiny_tokenizer, row_to_demo({"prompt": "2 + 2 =", "completion": " 4"}, "d:1"), 1024)
    assert trained_text(tiny_tokenizer, tokens) == " 4<|im_end|>"
    assert untrained_text(tiny_tokenizer, tokens) == "2 + 2 ="
    with pytest.raises(DataError, match=r"^d:2: chat messages need a chat template"):
        render_demo(tiny_tokenizer, row_to_demo(ROWS[0], "d:2"), 1024)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_tokenizer):
    """A template that drops an earlier assistant turn once a later one follows (as reasoning templates drop
    earlier thinking) cannot be marked turn by turn: refused naming the row and the message."""
    tiny_tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    demo = row_to_demo({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
                       "demos.jsonl:7")
    with pytest.raises(DataError, match=r"^demos.jsonl:7: the chat template renders the conversation before "
                                        r"message 1 differently once later messages follow"):
        render_demo(tiny_tokenizer, demo, 1024)


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "holds no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "message 0 needs a role among"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
     "content must be a string, got int"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "starts with an assistant message"),
    ('{"question": "hi"}', "a row needs 'messages', or 'prompt' and 'completion' (the row has: question)"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"name": 1}]}]}',
     "a tool call needs a function name"),
    ('{"messages": [', "invalid JSON"),
])
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + line + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: .*{message[:30]}") as err:
        load_demos(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_demos_from_a_saved_dataset_and_too_long_rows(tmp_path, tiny_tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": r["messages"]} for r in ROWS[:2]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    demos = load_demos(tmp_path / "ds")
    assert [d.source for d in demos] == [f"{tmp_path / 'ds'} row 0", f"{tmp_path / 'ds'} row 1"]
    assert render_demo(tiny_tokenizer, demos[1], 1024).trained == render_demo(
        tiny_tokenizer, row_to_demo({"messages": TOOL_CHAT}, "x"), 1024).trained
    with pytest.raises(DataError, match=r"row 0: the conversation is \d+ tokens, more than the model's context of 5"):
        render_demo(tiny_tokenizer, demos[0], 5)
    with pytest.raises(DataError, match="no split 'test'"):
        load_demos(tmp_path / "ds", "test")


# --------------------------------------------------------------------------- the pass and the gradient


def sequences(tokenizer):
    return stack([(t.ids, t.trained) for t in (render_demo(tokenizer, row_to_demo(r, "d"), 1024) for r in ROWS)],
                 tokenizer.pad_token_id)


def test_packed_pass_equals_a_plain_padded_forward(tiny_model_dir):
    """token_scores packs whole conversations; a plain forward of each row alone gives the same log-probs and
    the same most-likely tokens."""
    model, tokenizer = load_policy(tiny_model_dir)
    seqs = sequences(tokenizer)
    logp, right = token_scores(model, seqs, "none")
    for i, n in enumerate(seqs.lengths.tolist()):
        with torch.no_grad():
            logits = model(input_ids=seqs.ids[i:i + 1, :n]).logits[0, :-1].float()
        expected = logits.log_softmax(-1).gather(-1, seqs.ids[i, 1:n, None])[:, 0]
        assert torch.allclose(logp[i, :n - 1], expected, atol=1e-5)
        assert torch.equal(right[i, :n - 1], logits.argmax(-1) == seqs.ids[i, 1:n])
        assert (logp[i, n - 1:] == 0).all()  # nothing predicted past the row's end


def test_the_gradient_does_not_depend_on_the_micro_batch_size(tiny_model_dir):
    """One optimizer step's gradient with micro-batches of 1 equals the whole batch's at once: each micro-batch's
    loss is divided by the step's trained tokens, not its own."""
    cfg = load_config(None, ["algo.micro_batch_size=4", "model.autocast=none"])
    opts = make_plan(cfg).update
    grads = []
    for size in (4, 1):
        model, tokenizer = load_policy(tiny_model_dir)
        seqs = sequences(tokenizer)
        step = sft_gradient(model, seqs, torch.arange(4), size, opts)
        assert step.finite
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        losses = step.micro.result()
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    # the token-weighted mean of the micro-batches' losses is the step's: recomputed from the scores
    model, tokenizer = load_policy(tiny_model_dir)
    seqs = sequences(tokenizer)
    with torch.no_grad():
        logp, _ = token_scores(model, seqs, "none")
    mask = seqs.target_mask.bool()
    assert losses["sft/loss"] == pytest.approx(float(-logp[mask].mean()), rel=1e-5)


# --------------------------------------------------------------------------- runs


def sft_run(model_dir, out, data, *command, **extra) -> int:
    overrides = tiny_overrides(model_dir, out, **{"model.threads": 1, "train.max_minutes": 0, "optim.lr": 1e-3,
                                                  "sft.batch_size": 2, "algo.micro_batch_size": 1, **extra})
    return main([*command, str(data), *overrides] if command == ("sft",) else
                [*command, f"sft.data={data}", *overrides])


def test_two_step_covey_sft(tiny_model_dir, tmp_path, capsys):
    """`covey sft DATA`: two supervised steps through the run machinery. Step 1's sft/loss and token accuracy are
    recomputed here from the untrained model on the stream's first two conversations; step 2 trains on the next
    two after one optimizer step; checkpoint, final model and held-out evaluation are there."""
    data = write_rows(tmp_path / "demos.jsonl", ROWS)
    assert sft_run(tiny_model_dir, tmp_path, data, "sft", **{"model.autocast": "none"}) == 0
    out = capsys.readouterr().out
    assert "covey: sft data" in out and "4 conversations" in out and "turn-by-turn" in out
    assert "covey: sft | loss on the assistant's tokens" in out and "held-out accuracy" in out
    lines = read_metrics(tmp_path / "t")
    assert [r["step"] for r in lines] == [0, 1, 2, 2] and "eval/accuracy" in lines[0] and lines[-1]["final"] == 1
    model, tokenizer = load_policy(tiny_model_dir)
    first = PromptStream(4, 0).next(2)
    seqs = Demos([render_demo(tokenizer, d, 1024) for d in load_demos(data)], tokenizer.pad_token_id).batch(first)
    with torch.no_grad():
        logits = model(input_ids=seqs.ids, attention_mask=(seqs.ids != -1).long()).logits[:, :-1].float()
    mask = seqs.target_mask.bool() & (torch.arange(seqs.ids.shape[1] - 1) < (seqs.lengths - 1)[:, None])
    nll = -logits.log_softmax(-1).gather(-1, seqs.ids[:, 1:, None])[..., 0]
    assert lines[1]["sft/loss"] == pytest.approx(float(nll[mask].mean()), rel=1e-5)
    assert lines[1]["sft/token_accuracy"] == pytest.approx(float((logits.argmax(-1) == seqs.ids[:, 1:])[mask]
                                                                 .float().mean()))
    assert lines[1]["sft/tokens"] == float(mask.sum()) and lines[1]["sft/sequences"] == 2.0
    assert lines[2]["sft/loss"] != lines[1]["sft/loss"] and lines[1]["optim/grad_norm"] > 0
    assert (tmp_path / "t" / "checkpoints" / "step-000002" / "trainer_state.pt").is_file()
    assert (tmp_path / "t" / "final" / "config.json").is_file()


def test_covey_sft_with_lora(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "demos.jsonl", ROWS)
    assert sft_run(tiny_model_dir, tmp_path, data, "sft", **{"model.lora_rank": 4}) == 0
    assert (tmp_path / "t" / "final" / "adapter_config.json").is_file()


@pytest.mark.parametrize("extra, message", [
    ({"sft.num_steps": 2}, "with algo.learner=sft every one of train.steps is supervised"),
    ({"sft.data": ""}, "algo.learner=sft trains on demonstrations: set sft.data"),
])
def test_sft_settings_that_mean_nothing_fail_before_a_model_loads(tmp_path, capsys, extra, message):
    code = main(["train", "algo.learner=sft", "sft.data=demos.jsonl", *[f"{k}={v}" for k, v in extra.items()],
                 f"train.output_dir={tmp_path}"])
    assert code == 2 and message in capsys.readouterr().err


def deterministic(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in read_metrics(run_dir)]


def test_warm_up_then_rl_resumes_exactly_across_the_switch(tiny_model_dir, tmp_path, capsys):
    """`covey train ... sft.data=D sft.num_steps=2`: steps 1-2 supervised, steps 3-4 GRPO, in one run folder.
    A run resumed from its checkpoint in the middle of the warm-up (step 1), at the switch (step 2) or after it
    (step 3) writes exactly the lines of the uninterrupted run after that step; the reference became the policy
    at the switch (the KL to it is 0 before the first RL update)."""
    data = write_rows(tmp_path / "demos.jsonl", ROWS)
    extra = {"sft.num_steps": 2, "train.save_every": 1, "train.keep_checkpoints": 4,
             "reward.functions": "tests.helpers:varied_reward", "algo.micro_batch_size": 2}
    assert sft_run(tiny_model_dir, tmp_path / "long", data, "train", **extra) == 0
    out = capsys.readouterr().out
    assert "covey: phases: sft steps 1-2 on" in out and "then grpo steps 3-4" in out
    long = deterministic(tmp_path / "long" / "t")
    assert [r["step"] for r in long] == [0, 1, 2, 3, 4, 4]
    assert "sft/loss" in long[2] and "reward/mean" in long[3] and "sft/loss" not in long[3]
    assert long[3]["kl/ref"] == pytest.approx(0.0, abs=1e-6) and long[4]["kl/ref"] > 0
    for resume_at in (1, 2, 3):
        checkpoint = tmp_path / "long" / "t" / "checkpoints" / f"step-{resume_at:06d}"
        again = tmp_path / f"again-{resume_at}"
        assert sft_run(tiny_model_dir, again, data, "train", **{**extra, "train.resume": checkpoint}) == 0
        assert deterministic(again / "t") == long[resume_at + 1:], resume_at
