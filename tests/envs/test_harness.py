"""Agent harnesses (`task.source=harness:<command>`, covey/envs/harness.py): an agent script written for these tests
(tests/envs/agent_script.py) talks to the policy server through the real `openai` client, calls its calculator
in a second turn and prints its reward; covey turns each episode into one row (the model's ids trained with the
sampler's log-probs, the tool's and the template's attended) and counts the harness's failures."""

import json
import sys

import pytest
import torch

import covey
from covey.config import ConfigError, load_config
from covey.envs.harness import (
    HarnessEngine,
    HarnessError,
    HarnessOptions,
    harness_command,
    harness_options,
    harness_prompts,
    reward_line,
    task_json,
)
from covey.tasks.base import Example
from tests.helpers import resumed_step_two, tiny_overrides

AGENT = f"{sys.executable} tests/envs/agent_script.py"


# --------------------------------------------------------------------------- without a model


def test_the_reward_is_the_last_nonempty_stdout_line():
    assert reward_line('thinking...\n{"reward": 0.75}\n\n') == 0.75
    assert reward_line('{"reward": 1}') == 1.0
    assert reward_line('{"reward": 0.75}\ndone') is None  # not the last line
    assert reward_line('{"reward": "high"}') is None and reward_line('{"reward": true}') is None
    assert reward_line('{"reward": NaN}') is None  # Python's json reads NaN: not a reward
    assert reward_line("") is None and reward_line("[1, 2]") is None


def test_a_command_covey_cannot_start_is_one_line_before_any_model():
    with pytest.raises(HarnessError, match="no program 'no-such-agent-7'"):
        harness_command("no-such-agent-7 --x")
    with pytest.raises(HarnessError, match="No closing quotation"):
        harness_command("python 'agent.py")
    with pytest.raises(HarnessError, match="task.harness.concurrency=0"):
        harness_options(AGENT, 0, 10.0, 8, 1.0, 1.0)
    assert harness_command(AGENT) == (sys.executable, "tests/envs/agent_script.py")


def test_task_source_is_parsed_once_and_refused_in_one_line():
    from covey.config import parse_source
    assert parse_source("harness: python a.py --x 1") == ("harness", "python a.py --x 1")
    assert parse_source("") == ("", "")
    with pytest.raises(ValueError, match="harness: names nothing"):
        parse_source("harness:")
    with pytest.raises(ConfigError, match="task.source='agents:x'"):
        load_config(None, ["task.source=agents:x"])


def test_the_row_a_harness_is_given():
    class Plain:  # no chat template: the prompt is the question
        chat_template = None
    ex = Example("What is 2 + 3?", "5", meta={"level": 1})
    prompt = harness_prompts(Plain(), [ex], system_prompt="Be brief.")[0]
    assert prompt == "Be brief.\n\nWhat is 2 + 3?" and prompt.example is ex
    assert json.loads(task_json(prompt)) == {
        "level": 1, "prompt": "What is 2 + 3?", "answer": "5",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]}


# --------------------------------------------------------------------------- against the tiny model


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from covey.models.load import load_policy
    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


def harness_engine(policy, timeout_s: float = 60.0) -> HarnessEngine:
    from covey.rollout.fast import FastEngine
    from covey.serve import context_length
    model, tokenizer = policy
    options = HarnessOptions(concurrency=4, timeout_s=timeout_s, max_new_tokens=6, temperature=1.0, top_p=1.0,
                             command=harness_command(AGENT))
    return HarnessEngine(FastEngine(model, tokenizer, max_new_tokens=6, temperature=1.0), options,
                         context_length(model))


def rows(tokenizer, *modes: str):
    examples = [Example(f"What is {12 + i} * 3?", str((12 + i) * 3), meta={"mode": m}) for i, m in enumerate(modes)]
    return harness_prompts(tokenizer, examples)


def test_two_turn_episodes_become_rows_the_model_s_tokens_trained(policy):
    model, tokenizer = policy
    engine = harness_engine(policy)
    out = engine.generate(rows(tokenizer, "ok", "header"), 2, seeds=[11, 12])
    metrics = engine.take_metrics()
    assert metrics["harness/episodes"] == 4 and metrics["harness/failed"] + metrics["harness/dropped"] <= 4
    assert len(out) == 4 - metrics["harness/dropped"]
    assert out.group_ids.tolist() == out.example_index and set(out.example_index) <= {0, 1}
    for i in range(len(out)):
        trained, attended = out.response_mask[i], out.response_attention[i]
        assert bool((trained <= attended).all()) and trained.sum() > 0
        turns = out.messages[i]
        if len(turns) == 3:  # both turns ran: the tool's message, then the model's second turn
            assert [m["role"] for m in turns] == ["assistant", "tool", "assistant"]
            env_ids = out.response_ids[i][(attended - trained).bool()].tolist()
            # the tool's reply and the template's markers are the environment's: attended, not trained
            expected = str((12 + out.example_index[i]) * 3)
            assert f"<|im_start|>tool\n{expected}<|im_end|>" in tokenizer.decode(env_ids)
    # every model token is a token the engine sampled, with the sampler's log-prob: a plain forward agrees
    logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
    width = out.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1], -1).gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
    mask = out.response_mask.bool()
    assert torch.allclose(logp[mask], out.sample_logp[mask], atol=1e-4)
    assert set(out.environment_rewards.tolist()) <= {0.0, 0.5, 1.0}


def test_the_episodes_seeds_make_their_tokens(policy):
    _, tokenizer = policy
    engine = harness_engine(policy)
    prompts = rows(tokenizer, "ok")
    first, again, other = (engine.generate(prompts, 2, seeds=[s]) for s in (5, 5, 7))
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.response_mask, again.response_mask)
    assert not torch.equal(first.response_ids[:, :4], other.response_ids[:, :4])
    greedy = [engine.generate(prompts, 1, greedy=True, seeds=[s]) for s in (1, 2)]
    assert torch.equal(greedy[0].response_ids, greedy[1].response_ids)  # greedy: whatever the seeds


def test_failing_slow_silent_and_unscored_harnesses_are_counted_outcomes(policy, capsys):
    _, tokenizer = policy
    engine = harness_engine(policy, timeout_s=12.0)
    out = engine.generate(rows(tokenizer, "fail", "sleep", "silent", "noreward"), 1, seeds=[1, 2, 3, 4])
    metrics = engine.take_metrics()
    assert {k: metrics[f"harness/{k}"] for k in ("episodes", "failed", "timeouts", "dropped", "unscored")} == \
        {"episodes": 4, "failed": 1, "timeouts": 1, "dropped": 1, "unscored": 1}
    # the silent one asked nothing: no row; the failed and the killed one keep their first turn, scored 0;
    # the one that printed no reward is left to covey's reward terms (NaN: none from the harness)
    assert out.example_index == [0, 1, 3]
    rewards = out.environment_rewards.tolist()
    assert rewards[:2] == [0.0, 0.0] and rewards[2] != rewards[2]
    printed = capsys.readouterr().out
    assert "failed (reward 0): exit code 1: the agent gave up" in printed
    assert "timed out (reward 0)" in printed and "dropped: episode" in printed


def test_every_episode_dropped_is_an_empty_batch(policy):
    _, tokenizer = policy
    engine = harness_engine(policy)
    out = engine.generate(rows(tokenizer, "silent"), 2)
    assert len(out) == 0 and engine.take_metrics()["harness/dropped"] == 2


def harness_config(model_dir, out_dir, *extra: str, **keys):
    return load_config(None, [*tiny_overrides(model_dir, out_dir, **{
        "task.source": f"harness:{AGENT}", "rollout.max_new_tokens": 6, "task.train_size": 8, "task.eval_size": 2,
        "rollout.group_size": 2, "rollout.seeding": "per_prompt", "train.save_every": 1, **keys}), *extra])


def test_a_harness_run_trains_and_resumes_exactly(tiny_model_dir, tmp_path):
    """Two steps in one go, and one step then a resume to two: the same second step (timings aside)."""
    def run(folder, steps: int, *extra: str) -> list[dict]:
        result = covey.train(harness_config(tiny_model_dir, tmp_path / folder, *extra, **{"train.steps": steps}))
        return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]

    whole, step2 = resumed_step_two(run)
    assert step2["harness/episodes"] == 4 and "reward/environment" in step2  # the harness's reward, as a term
    assert step2["optim/grad_norm"] > 0  # the agent's rewards differ within a group: the step learns
    assert whole[0]["eval/harness/episodes"] == 2  # held-out rows run the harness too (greedy)
