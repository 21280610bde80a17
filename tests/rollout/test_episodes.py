"""Multi-turn episodes (covey/rollout/episodes.py) with a scripted sampler and scripted tools: the
ids trained are the ids sampled, the environment's ids are attended but not trained, budgets cut."""

from __future__ import annotations

import torch

from covey.batch import Rollout
from covey.models.tiny import tiny_tokenizer
from covey.rollout.base import encode_prompts
from covey.rollout.episodes import EpisodeOptions, run_episodes
from covey.rollout.hf import response_mask_from_ids

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
TRAP = [40, 97]  # ids whose text the tokenizer encodes back to other ids (checked below)
TOOL_IDS = [7, 8, 9]  # what the template would write for a tool reply and the next assistant turn


class ScriptedSampler:
    """Returns the scripted turns in order, one list of row ids per call, as an engine would; records
    the prompts it was given."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.seen = list(turns), []

    def __call__(self, prompts, group_size: int, max_new_tokens: int) -> Rollout:
        self.seen.append(([list(p) for p in prompts], max_new_tokens))
        rows = [r[:max_new_tokens] for r in self.turns.pop(0)]
        enc = encode_prompts(TOK, prompts)
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), TOK.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        mask, truncated = response_mask_from_ids(ids, [EOS])
        return Rollout(prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index], response_ids=ids,
                       response_mask=mask, group_ids=index.clone(), truncated=truncated,
                       completions=TOK.batch_decode(ids, skip_special_tokens=True), example_index=index.tolist())


class ScriptedHost:
    """Calls a tool after the turns listed in `calls_after` (1-based), answering each with TOOL_IDS."""

    def __init__(self, calls_after=()):
        self.calls_after, self.turn = set(calls_after), 0

    def calls_in(self, text: str) -> list:
        self.turn += 1
        return [{"name": "calc", "arguments": {"expression": "2+2"}}] if self.turn in self.calls_after else []

    def reply(self, calls) -> list[dict]:
        return [{"role": "tool", "name": "calc", "content": "4"} for _ in calls]

    def append_ids(self, messages) -> list[int]:
        return list(TOOL_IDS)


def options(turns=3, turn_tokens=8, episode_tokens=64) -> EpisodeOptions:
    return EpisodeOptions(max_turns=turns, max_turn_tokens=turn_tokens, max_episode_tokens=episode_tokens)


def test_the_trained_ids_are_the_sampled_ids_and_the_environment_is_attended_only():
    # The trap: decoding the model's ids and encoding the text again gives other ids. An episode that
    # re-encoded its text would train on ids the model never sampled.
    assert TOK(TOK.decode(TRAP), add_special_tokens=False)["input_ids"] != TRAP
    prompts = [[11, 12, 13], [14, 15]]
    sampler = ScriptedSampler([[TRAP + [EOS], [60, EOS]],   # turn 1 of both episodes
                               [[50, 51, EOS]]])            # turn 2 of episode 0 (episode 1 ended)
    rollout, metrics = run_episodes(sampler, TOK, prompts, 1, [ScriptedHost([1]), ScriptedHost()], options())
    # Episode 0: model [40, 97, EOS], tool [7, 8, 9], model [50, 51, EOS]; episode 1: model [60, EOS].
    assert rollout.response_ids[0].tolist() == TRAP + [EOS] + TOOL_IDS + [50, 51, EOS]
    assert rollout.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert rollout.response_attention[0].tolist() == [1] * 9
    assert rollout.response_ids[1, :2].tolist() == [60, EOS] and rollout.response_mask[1].tolist() == [1, 1] + [0] * 7
    assert rollout.response_attention[1].tolist() == [1, 1] + [0] * 7
    # The second turn continued from the exact ids: the prompt, the sampled trap ids, the tool's ids.
    assert sampler.seen[1][0] == [prompts[0] + TRAP + [EOS] + TOOL_IDS]
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool", "assistant"]
    assert rollout.messages[1] == [{"role": "assistant", "content": TOK.decode([60], skip_special_tokens=True)}]
    assert rollout.truncated.tolist() == [False, False]
    # turns (2 + 1) / 2, tool calls (1 + 0) / 2, environment tokens 3 of 9 + 2 = 11, nothing cut off
    assert metrics == {"episode/turns_mean": 1.5, "episode/tool_calls_mean": 0.5,
                       "episode/env_token_frac": 3 / 11, "episode/cut_off_frac": 0.0}


def test_groups_share_their_prompt_and_each_episode_keeps_its_own_tools():
    sampler = ScriptedSampler([[[21, EOS], [22, EOS]], [[23, EOS]]])
    rollout, _ = run_episodes(sampler, TOK, [[11, 12]], 2, [ScriptedHost(), ScriptedHost([1])], options())
    assert rollout.group_ids.tolist() == [0, 0]
    assert rollout.response_mask.sum(1).tolist() == [2, 4]  # episode 1: [22, EOS], tool, [23, EOS]
    assert sampler.seen[1][0] == [[11, 12, 22, EOS] + TOOL_IDS]


def test_budgets_cut_episodes_and_say_so():
    # A call on the last allowed turn: no turn is left to read the reply, so the episode is cut there.
    rollout, metrics = run_episodes(ScriptedSampler([[[21, EOS]]]), TOK, [[11]], 1, [ScriptedHost([1])],
                                    options(turns=1))
    assert rollout.response_ids[0].tolist() == [21, EOS] and rollout.truncated.tolist() == [True]
    assert metrics["episode/cut_off_frac"] == 1.0 and metrics["episode/tool_calls_mean"] == 0.0
    # The episode budget: 3 + 3 tool ids = 6 of 8 leaves 2 for turn 2, which wanted 4 tokens.
    sampler = ScriptedSampler([[[21, 22, EOS]], [[31, 32, 33, EOS]]])
    rollout, _ = run_episodes(sampler, TOK, [[11]], 1, [ScriptedHost([1])], options(episode_tokens=8))
    assert sampler.seen[1][1] == 2  # turn 2 sampled at most the 2 tokens left
    assert rollout.response_ids[0].tolist() == [21, 22, EOS] + TOOL_IDS + [31, 32]
    assert rollout.truncated.tolist() == [True]
    # A tool reply that does not fit: the episode ends before it, the reply is not appended.
    rollout, _ = run_episodes(ScriptedSampler([[[21, 22, EOS]]]), TOK, [[11]], 1, [ScriptedHost([1])],
                              options(episode_tokens=6))
    assert rollout.response_ids[0].tolist() == [21, 22, EOS] and rollout.truncated.tolist() == [True]
    # A turn without an end token (the turn budget) ends the episode too, its calls unread.
    rollout, _ = run_episodes(ScriptedSampler([[[21, 22, 23]]]), TOK, [[11]], 1, [ScriptedHost([1])],
                              options(turn_tokens=3))
    assert rollout.response_ids[0].tolist() == [21, 22, 23] and rollout.truncated.tolist() == [True]


class SlowHost(ScriptedHost):
    """Calls a tool after turn 1 whose reply takes `seconds`."""

    def __init__(self, seconds: float):
        super().__init__([1])
        self.seconds = seconds

    def reply(self, calls) -> list[dict]:
        import time
        time.sleep(self.seconds)
        return super().reply(calls)


def test_the_tools_of_every_episode_run_at_once():
    """Four episodes whose tool takes 0.6 s each: the turn's replies take about 0.6 s, not 2.4 s."""
    import time
    sampler = ScriptedSampler([[[21, EOS]] * 4, [[31, EOS]] * 4])
    started = time.perf_counter()
    rollout, metrics = run_episodes(sampler, TOK, [[11]], 4, [SlowHost(0.6) for _ in range(4)], options())
    assert time.perf_counter() - started < 1.5
    assert metrics["episode/tool_calls_mean"] == 1.0 and rollout.response_ids[:, -2:].tolist() == [[31, EOS]] * 4
