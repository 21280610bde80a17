"""Process rewards per model turn (algo.estimator=grpo_process, reward.step_source=turns), worked by hand.

The episodes are built by the runners' own functions (end_turn after each model turn, append_replies
after its tools answered), so the turn ends and scores are those the runners record; then the step
inputs (covey/rewards/steps.py), the outcome on the last turn, and grpo_process.

One group of three episodes, L = 6 (t0..t5), reward.process_outcome_weight w = 1:

    row A  model t0 t1 | tool t2 t3 | model t4 t5   turn 1 calls, answered      -> 1; turn 2 -> 0; outcome 1
    row B  model t0    | tool t1..t3 | model t4     turn 1 calls, answered {"error"} -> 0; turn 2 -> 0; outcome 0
    row C  model t0..t2 | tool t3    | model t4 t5  turn 1 calls, answered      -> 1; turn 2 -> 0; outcome 0

    turn ends (last model token of each turn): A [1, 5], B [0, 4], C [2, 5]
"""

from types import SimpleNamespace

import pytest
import torch

from covey.algos import AdvantageInput, AdvantageOptions, compute_advantages
from covey.algos.advantages import steps_to_tokens
from covey.batch import Rollout
from covey.config import ConfigError, load_config
from covey.rewards.rules import tool_turn_score
from covey.rewards.steps import add_outcome_to_last_step, process_step_inputs
from covey.rollout.agents import ToolHost
from covey.rollout.episodes import Episode, EpisodeOptions, append_replies, end_turn, episode_rollout
from covey.rollout.tools import Toolbox, ToolError, environment_tools
from covey.training.plan import make_plan

F64 = torch.float64
OPTIONS = EpisodeOptions(max_turns=2, max_turn_tokens=8, max_episode_tokens=32)
OK = {"role": "tool", "name": "calc", "content": "42"}
ERROR = {"role": "tool", "name": "calc", "content": '{"error": "calc raised ZeroDivisionError"}'}


class Host:
    """A turn whose text is 'call' asks for one tool; its reply is `reply`, rendered as `width` ids."""

    def __init__(self, reply: dict, width: int):
        self.reply_message, self.width = reply, width

    def calls_in(self, text: str) -> list:
        return ["calc"] if text == "call" else []

    def reply(self, calls: list) -> list[dict]:
        return [self.reply_message]

    def append_ids(self, messages) -> list[int]:
        return [7] * self.width


def run(host: Host, turn_1: int, turn_2: int) -> Episode:
    """Two model turns of `turn_1` and `turn_2` ids, the first calling the tool, as the runners drive them."""
    ep = Episode(prompt=[1, 2], host=host)
    calls = end_turn(ep, [5] * turn_1, None, "call", False, OPTIONS)
    append_replies(ep, calls, host.reply(calls), OPTIONS)
    assert end_turn(ep, [6] * turn_2, None, "the answer is 42", False, OPTIONS) == []
    return ep


def group() -> Rollout:
    episodes = [run(Host(OK, 2), 2, 2), run(Host(ERROR, 3), 1, 1), run(Host(OK, 1), 3, 2)]
    first = Rollout(prompt_ids=torch.tensor([[1, 2]] * 3), prompt_mask=torch.ones(3, 2), response_ids=torch.zeros(3, 0),
                    response_mask=torch.zeros(3, 0), group_ids=torch.zeros(3, dtype=torch.long),
                    truncated=torch.zeros(3, dtype=torch.bool), completions=[""] * 3, example_index=[0, 0, 0])
    rollout = episode_rollout(first, episodes, SimpleNamespace(pad_token_id=0))
    rollout.scores = torch.tensor([1.0, 0.0, 0.0], dtype=F64)  # the outcome rewards
    return rollout


def test_the_runners_record_each_turns_last_model_token_and_score():
    rollout = group()
    assert rollout.response_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 1, 0], [1, 1, 1, 0, 1, 1]]
    assert rollout.turn_steps == [[(1, 1.0), (5, 0.0)], [(0, 0.0), (4, 0.0)], [(2, 1.0), (5, 0.0)]]
    # a turn's end is a model token (mask 1), never the environment's
    for row, turns in enumerate(rollout.turn_steps):
        assert all(rollout.response_mask[row, end] == 1 for end, _ in turns)


def test_grpo_process_over_turns_by_hand():
    rollout = group()
    steps, metrics = process_step_inputs(rollout, None, [], [], None, "turns", "\n")
    # turn scores A [1, 0], B [0, 0], C [1, 0]: 2 turns per episode, mean score 2/6
    assert metrics["steps/per_sample"] == 2.0 and metrics["steps/score_mean"] == pytest.approx(1 / 3)
    assert steps["step_ends"].tolist() == [[1, 5], [0, 4], [2, 5]] and steps["step_mask"].all()
    # outcome x w = 1 on the last turn: A [1, 0 + 1] = [1, 1], B [0, 0], C [1, 0]
    scores = add_outcome_to_last_step(steps["step_scores"], steps["step_mask"], rollout.scores, 1.0)
    assert scores.tolist() == [[1, 1], [0, 0], [1, 0]]
    inp = AdvantageInput(scores=rollout.scores, response_mask=rollout.response_mask, group_ids=rollout.group_ids,
                         step_scores=scores, step_ends=steps["step_ends"], step_mask=steps["step_mask"])
    adv, ret, _ = compute_advantages("grpo_process", inp, AdvantageOptions(eps=0.0))
    # the group's six real steps {1, 1, 0, 0, 1, 0}: mean 0.5, population std 0.5
    #   normalised (r - 0.5) / 0.5: A [1, 1], B [-1, -1], C [1, -1]
    # A_t = sum of the normalised rewards of the steps ending at or after t; tools' tokens and padding 0:
    #   A: t0 t1 (both steps) 1 + 1 = 2, t2 t3 tool 0, t4 t5 (step 2) 1
    #   B: t0 -1 - 1 = -2, t1..t3 tool 0, t4 -1, t5 padding 0
    #   C: t0..t2 1 - 1 = 0, t3 tool 0, t4 t5 -1
    assert adv.tolist() == [[2, 2, 0, 0, 1, 1], [-2, 0, 0, 0, -1, 0], [0, 0, 0, 0, -1, -1]]
    # returns: the raw step rewards summed the same way: A t0 t1 2, t4 t5 1; C t0..t2 1
    assert ret.tolist() == [[2, 2, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]


def test_the_tools_tokens_get_no_advantage_only_through_the_mask():
    # steps_to_tokens alone spreads a step over every position up to its end, the tool's t2 t3 of row A
    # included (A's normalised steps [1, 1] at ends [1, 5]: t2..t5 sum 1); the response mask makes them 0
    values, ends, valid = torch.tensor([[1.0, 1.0]]), torch.tensor([[1, 5]]), torch.ones(1, 2, dtype=torch.bool)
    unmasked = steps_to_tokens(values, ends, valid, torch.ones(1, 6, dtype=torch.bool))
    assert unmasked.tolist() == [[2, 2, 1, 1, 1, 1]]
    masked = steps_to_tokens(values, ends, valid, torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.bool))
    assert masked.tolist() == [[2, 2, 0, 0, 1, 1]]


def test_the_default_turn_score_and_an_environments_turn_reward():
    assert tool_turn_score([OK, OK]) == 1.0
    assert tool_turn_score([OK, ERROR]) == 0.0  # every call must come back without an error
    assert tool_turn_score([{"role": "tool", "content": "error: division by zero"}]) == 0.0  # a tool's own refusal
    assert tool_turn_score([]) == 0.0  # no call (or calls left unrun at the turn limit)
    # a host's turn_reward() replaces the rule; None leaves the rule in charge
    ep = run(Host(ERROR, 2), 1, 1)
    assert ep.turn_scores == [0.0, 0.0]
    scores = iter([0.25, None])
    host = Host(ERROR, 2)
    host.turn_reward = lambda: next(scores)
    assert run(host, 1, 1).turn_scores == [0.25, 0.0]


class CounterEnv:
    def reset(self, **row) -> str:
        self.count = 0
        return ""

    def increment(self, step: int) -> int:
        """Add a step to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def turn_reward(self) -> float:
        return self.count / 10


def test_an_environments_turn_reward_is_read_by_its_host_and_is_not_a_tool():
    env = CounterEnv()
    env.reset()
    assert [f.__name__ for f in environment_tools(env)] == ["increment"]
    host = ToolHost(None, [], Toolbox(environment=env))
    env.increment(3)
    assert host.turn_reward() == 0.3
    assert ToolHost(None, [], Toolbox()).turn_reward() is None  # plain tools: the default rule scores
    env.turn_reward = lambda: 1 / 0
    with pytest.raises(ToolError, match="environment CounterEnv: turn_reward.. raised ZeroDivisionError"):
        host.turn_reward()


@pytest.mark.parametrize("overrides, message", [
    (["reward.step_source=turns"], "reward.step_source=turns scores the model turns of tool-calling episodes"),
    (["rollout.tools=calculator", "algo.estimator=grpo_process"],
     "reward.step_source=prm scores the reasoning steps of one answer: algo.estimator=grpo_process with tools "
     "needs reward.step_source=turns"),
    (["rollout.tools=calculator", "algo.estimator=grpo_process", "reward.step_source=turns"],
     "reward.process_outcome_weight must be > 0 with reward.step_source=turns"),
])
def test_turn_steps_are_refused_where_they_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_plan(load_config(None, overrides))


def test_turn_steps_with_tools_and_an_outcome_weight_are_planned():
    plan = make_plan(load_config(None, ["rollout.tools=calculator", "algo.estimator=grpo_process",
                                        "reward.step_source=turns", "reward.process_outcome_weight=1"]))
    assert plan.step_scoring.enabled and plan.step_scoring.source == "turns"
    assert plan.step_scoring.outcome_weight == 1.0
    with_python_tools = make_plan(load_config(None, ["algo.estimator=grpo_process", "reward.step_source=turns",
                                                     "reward.process_outcome_weight=1"]), with_tools=True)
    assert with_python_tools.step_scoring.source == "turns"
