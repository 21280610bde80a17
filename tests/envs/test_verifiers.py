"""verifiers environments (`task.source=verifiers:<taskset>`, covey/envs/verifiers.py) on three environments written
with verifiers' own classes (tests/envs/vf_envs/): a single-turn taskset scored by two weighted rewards and a
metric, a multi-turn guessing game whose Env answers each guess, and a tool taskset whose harness runs a
calculator between two calls. Their rollouts run against covey's policy server on the tiny model; each episode's
calls become one row, the environment's weighted reward its reward, its parts logged.

verifiers (0.4) is an optional extra with many dependencies, not in the `test` extra: these tests skip without
it (the one on the missing-extra message runs always)."""

import importlib.util
import json
import re
import sys

import pytest
import torch

import covey
from covey.config import load_config
from covey.envs.harness import harness_prompts
from covey.envs.verifiers import VerifiersEngine, VerifiersError, verifiers_data, verifiers_options
from tests.helpers import tiny_overrides

ENVS = "tests/envs/vf_envs"


def test_without_verifiers_the_source_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(VerifiersError, match=r"pip install 'covey\[verifiers\]'"):
        verifiers_data(f"verifiers:{ENVS}/covey_vf_arith.py", 4, 2)
    assert verifiers_data("harness:python a.py", 4, 2) is None  # another source: covey's own data


needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="verifiers is an optional extra: pip install 'covey[verifiers]'")


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from covey.models.load import load_policy
    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


def play(policy, name: str, rows: int = 2, group: int = 2):
    """`rows` tasks of tests/envs/vf_envs/<name>.py, `group` episodes each: (rollout, metrics, examples)."""
    from covey.rollout.fast import FastEngine
    from covey.serve import context_length
    model, tokenizer = policy
    target = f"{ENVS}/{name}.py"
    data = verifiers_data(f"verifiers:{target}", rows, 0)
    engine = VerifiersEngine(FastEngine(model, tokenizer, max_new_tokens=6, temperature=1.0),
                             verifiers_options(target, 4, 120.0, 6, 1.0, 1.0), context_length(model))
    out = engine.generate(harness_prompts(tokenizer, data.train), group, seeds=list(range(7, 7 + rows)))
    return out, engine.take_metrics(), data.train


def sampled_faithfully(model, out) -> bool:
    """Every trained token with the sampler's log-prob: a plain forward of the rows agrees."""
    logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
    width = out.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1], -1).gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
    mask = out.response_mask.bool()
    return bool(torch.allclose(logp[mask], out.sample_logp[mask], atol=1e-4))


@needs_verifiers
def test_the_taskset_s_tasks_are_the_rows():
    data = verifiers_data(f"verifiers:{ENVS}/covey_vf_arith.py", 4, 2)
    # 4 + 2 tasks read in load() order, the last 2 held out; the answer is the environment's to judge
    assert [ex.prompt for ex in data.train] == [f"What is {a} + 3?" for a in range(4)]
    assert [ex.meta for ex in data.eval] == [{"answer": "7", "verifiers_idx": 4}, {"answer": "8", "verifiers_idx": 5}]
    assert all(ex.answer is None for ex in data.train + data.eval)


@needs_verifiers
def test_a_target_verifiers_cannot_load_is_one_line():
    with pytest.raises(VerifiersError, match="task.source=verifiers:no_such_taskset_7: ModuleNotFoundError"):
        verifiers_data("verifiers:no_such_taskset_7", 4, 2)
    with pytest.raises(VerifiersError, match="after the taskset id, a JSON object"):
        verifiers_options("covey_vf_arith {bad", 4, 10.0, 6, 1.0, 1.0)


@needs_verifiers
def test_a_single_turn_taskset_s_weighted_rewards_score_each_row(policy):
    out, metrics, examples = play(policy, "covey_vf_arith")
    assert len(out) == 4 and metrics["verifiers/episodes"] == 4 and metrics["verifiers/failed"] == 0
    assert out.group_ids.tolist() == [0, 0, 1, 1]
    assert bool((out.response_mask == out.response_attention).all())  # one turn: every response token sampled
    assert sampled_faithfully(policy[0], out)
    for i, text in enumerate(out.completions):
        # the taskset's rewards: correct (weight 1) + has_digit (weight 0.5), on the reply as the model wrote it
        reply, answer = text.strip(), examples[out.example_index[i]].meta["answer"]
        expected = 1.0 * (answer in reply) + 0.5 * any(c.isdigit() for c in reply)
        assert out.environment_rewards[i].item() == expected
    parts = [metrics["verifiers/reward/correct"], metrics["verifiers/reward/has_digit"]]
    assert all(0.0 <= p <= 1.0 for p in parts) and "verifiers/metric/reply_chars" in metrics


def guess_score(secret: int, replies: list[str]) -> float:
    """The game's rule (tests/envs/vf_envs/covey_vf_guess.py) replayed on the model's replies."""
    score = 0.0
    for reply in replies:
        guess = re.search(r"\d", reply.strip())
        if guess and int(guess.group(0)) == secret:
            return 1.0
        score += 0.2 if guess else 0.0
    return score


@needs_verifiers
def test_a_multi_turn_game_is_one_row_the_environment_s_turns_attended(policy):
    model, tokenizer = policy
    out, metrics, examples = play(policy, "covey_vf_guess")
    assert len(out) == 4 and metrics["verifiers/turns_mean"] > 1
    assert sampled_faithfully(model, out)
    for i in range(len(out)):
        replies = [m["content"] for m in out.messages[i] if m["role"] == "assistant"]
        hints = [m["content"] for m in out.messages[i] if m["role"] == "user"]
        assert len(replies) == len(hints) + 1
        env_text = tokenizer.decode(out.response_ids[i][(out.response_attention[i] - out.response_mask[i]).bool()])
        assert env_text.count("Guess again.") == len(hints)  # the game's answers: attended, not trained
        assert out.environment_rewards[i].item() == pytest.approx(
            guess_score(examples[out.example_index[i]].meta["secret"], replies))


@needs_verifiers
def test_a_tool_taskset_s_tool_reply_sits_between_the_model_s_turns(policy):
    model, tokenizer = policy
    out, metrics, examples = play(policy, "covey_vf_calc")
    assert metrics["verifiers/turns_mean"] == 2.0 and sampled_faithfully(model, out)
    for i in range(len(out)):
        answer = examples[out.example_index[i]].meta["answer"]
        env_ids = out.response_ids[i][(out.response_attention[i] - out.response_mask[i]).bool()].tolist()
        assert f"<|im_start|>tool\n{answer}<|im_end|>" in tokenizer.decode(env_ids)
        assert out.environment_rewards[i].item() == float(answer in out.messages[i][-1]["content"].strip())


@needs_verifiers
def test_a_verifiers_run_trains_on_the_environment_s_reward(tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "task.source": f"verifiers:{ENVS}/covey_vf_arith.py", "task.train_size": 4, "task.eval_size": 2,
        "rollout.group_size": 2, "rollout.max_new_tokens": 6, "rollout.seeding": "per_prompt"}))
    result = covey.train(cfg)
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    step2 = [r for r in lines if r["step"] == 2 and "final" not in r][0]
    assert step2["verifiers/episodes"] == 4 and "verifiers/reward/correct" in step2
    assert step2["reward/environment"] == step2["reward/mean"]  # the correctness reward is off: no answers
    assert "eval/reward_mean" in lines[0] and lines[0]["eval/verifiers/episodes"] == 2
