"""An episode's recorded calls as one row (covey/envs/rows.py), on calls written by hand: the first call's prompt
is the row's prompt, each call's completion the model's (trained, with its log-probs), the ids a later call's
prompt adds after it the environment's (attended, not trained); a call that does not extend the last is refused
in one line naming the episode and the call."""

import pytest
import torch

from covey.envs.rows import EpisodeCallsError, episode_row, rows_rollout


def call(prompt, *choices):
    """A call as PolicyServer.take_episode gives it; each choice (ids, logprobs[, finish_reason])."""
    return {"route": "continue", "prompt_ids": list(prompt), "seed": 0,
            "choices": [{"completion_ids": list(c[0]), "logprobs": c[1], "finish_reason": c[2] if len(c) > 2
                         else "stop"} for c in choices]}


class CharTokenizer:
    """Decodes id i as chr(ord('a') + i - 10); ids below 10 are special (dropped with skip_special_tokens)."""
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i - 10) if i >= 10 else ("" if skip_special_tokens else f"<{i}>") for i in ids)


def two_turns():
    # turn 1: prompt [1, 2, 3], the model samples [10, 11]; the environment appends [20, 21];
    # turn 2: prompt [1, 2, 3, 10, 11, 20, 21], the model samples [12, 2] (2: its end token)
    return [call([1, 2, 3], ([10, 11], [-0.5, -0.25])),
            call([1, 2, 3, 10, 11, 20, 21], ([12, 2], [-1.0, -0.125]))]


def test_two_calls_make_one_row_model_tokens_trained_environment_tokens_attended():
    row = episode_row(two_turns(), "ep")
    assert row.prompt_ids == [1, 2, 3]
    assert row.ids == [10, 11, 20, 21, 12, 2]
    assert row.trained == [1, 1, 0, 0, 1, 1]
    assert row.logps == [-0.5, -0.25, 0.0, 0.0, -1.0, -0.125]  # the sampler's, 0 on the environment's ids
    assert (row.turn_starts, row.turn_ends) == ([0, 4], [1, 5])
    assert row.model_ids == [[10, 11], [12, 2]]
    assert row.turns == 2 and not row.truncated


def test_a_call_that_does_not_extend_the_last_is_refused_naming_episode_and_call():
    calls = two_turns()
    calls[1]["prompt_ids"] = [1, 2, 3, 10, 99, 20]  # the environment rewrote the model's second token
    with pytest.raises(EpisodeCallsError) as err:
        episode_row(calls, "ep-7")
    message = str(err.value)
    assert "\n" not in message
    # the previous prompt and completion are [1, 2, 3, 10, 11]: 5 tokens, first differing at index 4
    assert "episode 'ep-7': call 1's prompt (6 tokens) does not extend call 0's prompt and completion (5 tokens)" \
        in message and "first differ at token 4" in message


def test_a_later_prompt_shorter_than_the_last_completion_is_refused():
    calls = two_turns()
    calls[1]["prompt_ids"] = [1, 2, 3, 10]
    with pytest.raises(EpisodeCallsError, match="first differ at token 4"):
        episode_row(calls, "ep")


def test_the_row_follows_the_choice_the_next_call_continues():
    calls = [call([5], ([10, 11], [-1.0, -1.0]), ([13], [-0.5])),  # n=2: the episode goes on from the second
             call([5, 13, 30], ([14], [-2.0], "length"))]
    row = episode_row(calls, "ep")
    assert row.ids == [13, 30, 14] and row.trained == [1, 0, 1] and row.logps == [-0.5, 0.0, -2.0]
    assert row.truncated  # the last turn ran out of tokens


def test_no_calls_and_several_last_choices_are_refused():
    with pytest.raises(EpisodeCallsError, match="episode 'e': no calls recorded"):
        episode_row([], "e")
    with pytest.raises(EpisodeCallsError, match="call 0 \\(the last\\) has 2 choices"):
        episode_row([call([5], ([10], [-1.0]), ([11], [-1.0]))], "e")


def test_a_call_without_logprobs_leaves_the_row_without_them():
    calls = two_turns()
    calls[0]["choices"][0]["logprobs"] = None
    assert episode_row(calls, "ep").logps is None


def test_an_empty_turn_is_a_turn_of_no_tokens():
    row = episode_row([call([1], ([], [])), call([1, 20], ([12], [-0.5]))], "ep")
    assert row.ids == [20, 12] and row.trained == [0, 1] and row.turn_ends == [-1, 1]
    assert row.model_ids == [[], [12]]


def test_rows_rollout_pads_prompts_left_and_responses_right():
    long = episode_row(two_turns(), "a")
    short = episode_row([call([7, 8], ([15], [-0.75], "length"))], "b")
    out = rows_rollout([long, short], [0, 1], CharTokenizer())
    assert out.prompt_ids.tolist() == [[1, 2, 3], [0, 7, 8]]
    assert out.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert out.response_ids.tolist() == [[10, 11, 20, 21, 12, 2], [15, 0, 0, 0, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0]]
    assert out.response_attention.tolist() == [[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]
    assert out.sample_logp.tolist() == [[-0.5, -0.25, 0.0, 0.0, -1.0, -0.125], [-0.75, 0, 0, 0, 0, 0]]
    assert out.truncated.tolist() == [False, True]
    assert out.group_ids.tolist() == [0, 1] and out.example_index == [0, 1]
    # the model's turns decoded, special tokens (ids < 10) removed: 10 11 -> "ab", 12 -> "c"; 15 -> "f"
    assert out.completions == ["abc", "f"]
    # every pass attends the prompt and the whole episode: 3 + 6 and 2 + 1 tokens
    assert out.attention_mask.sum(1).tolist() == [9, 3]


def test_rows_rollout_of_no_rows_is_an_empty_batch():
    out = rows_rollout([], [], CharTokenizer())
    assert len(out) == 0 and out.group_ids.shape == (0,) and out.sample_logp is None
    assert out.response_mask.shape == torch.Size([0, 0])
