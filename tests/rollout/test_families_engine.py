"""The fast engine on a tiny random model of every family (covey/models/tiny.py): greedy tokens equal to
`generate`'s with left-padded prompts and responses longer than the sliding window, the sampler's log-probs
equal to a plain forward's, rows leaving the batch, sliding buffers of two windows, linear-attention states
held still for waiting rows, and tool episodes equal to the turn-by-turn runner's."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from covey.models.tiny import FAMILY_NAMES, TINY_WINDOW, tiny_family_config
from covey.rollout.decode_cache import SLIDING_SPAN, SlidingBufferLayer, StateLayer, buffer_cache, rows_held
from covey.rollout.episodes import EpisodeOptions, run_episodes
from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.lean_decode import supports_lean_step
from covey.rollout.static_step import supports_static_decode

PROMPTS = [list(range(3, 6)), list(range(3, 14))]  # 3 and 11 ids: left padding of 8 on the first row
NEW = 24  # 3 + 24 > SLIDING_SPAN * TINY_WINDOW = 16: every sliding buffer moves its columns
DEFAULT_INIT = 0.02  # transformers' initializer_range
SHARP = {"gemma3": DEFAULT_INIT}
"""Weight init range of the token tests per family, else 0.3: at the default most tiny models repeat one token
greedily, which a wrong window would not change; Gemma 3 (embeddings scaled by sqrt(width)) repeats at 0.3.
The log-prob test keeps the default: its logits' float32 rounding stays under 1e-6 there (up to 1e-4 at 0.3,
where Qwen3.5's chunked prefill and recurrent steps round apart), while a window off by one column moves
them by 0.1 or more."""


@pytest.fixture(scope="module")
def models(tok):
    built = {}

    def get(family, init_range=None):
        init_range = init_range or SHARP.get(family, 0.3)
        if (family, init_range) not in built:
            config = tiny_family_config(family, len(tok))
            config.initializer_range = init_range
            torch.manual_seed(0)
            built[family, init_range] = AutoModelForCausalLM.from_config(config).eval()
        return built[family, init_range]
    return get


def forward_logp(model, rollout) -> torch.Tensor:
    """(N, L) log-softmax of one plain forward over prompt + response at the response ids (0 past EOS)."""
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    mask = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.response_ids)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    width = rollout.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1].float(), -1)
    return logp.gather(2, rollout.response_ids[:, :, None]).squeeze(2) * rollout.response_mask


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_tokens_equal_generate_past_the_window(family, share_prefix, models, tok):
    model = models(family)
    theirs = HFEngine(model, tok, max_new_tokens=NEW).generate(PROMPTS, 1, greedy=True)
    ours = FastEngine(model, tok, max_new_tokens=NEW, share_prefix=share_prefix).generate(PROMPTS, 1, greedy=True)
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    # the rows ran past two windows (every sliding buffer moved), with varied tokens (a window that is
    # wrong changes them)
    assert int(ours.response_mask[0].sum()) + len(PROMPTS[0]) > SLIDING_SPAN * TINY_WINDOW
    assert len(set(ours.response_ids[1].tolist())) > 4


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sampler_log_probs_equal_a_plain_forward(family, models, tok):
    """Sampled at temperature 1 (the log-probs are of the raw logits), two samples per prompt: the engine's
    log-prob of each token equals the log-softmax of one forward over the whole row, in float32."""
    model = models(family, DEFAULT_INIT)
    torch.manual_seed(0)
    rollout = FastEngine(model, tok, max_new_tokens=NEW).generate(PROMPTS, 2)
    assert rollout.response_mask[:, TINY_WINDOW:].sum() > 0  # some log-probs past the window
    torch.testing.assert_close(rollout.sample_logp, forward_logp(model, rollout), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rows_leaving_the_batch_keep_the_others_tokens(family, models, tok):
    """A stop id that ends the first row at step 5 and no other row before the last step (chosen from the
    greedy tokens without it): after the first row leaves the cache, the others' tokens are still `generate`'s."""
    model = models(family)
    prompts = [*PROMPTS, list(range(20, 27))]
    free = HFEngine(model, tok, max_new_tokens=NEW).generate(prompts, 1, greedy=True).response_ids
    step = next(s for s in range(5, NEW - 1) if free[0, s] not in free[0, :s] and free[0, s] not in free[1:, :-1])
    stop = sorted({tok.eos_token_id, int(free[0, step])})
    hf, ours = HFEngine(model, tok, max_new_tokens=NEW), FastEngine(model, tok, max_new_tokens=NEW)
    hf.eos = ours.eos = stop
    theirs, mine = hf.generate(prompts, 1, greedy=True), ours.generate(prompts, 1, greedy=True)
    assert int(mine.response_mask[0].sum()) == step + 1 and mine.response_mask[1:, -1].all()
    assert torch.equal(mine.response_ids, theirs.response_ids)


@pytest.mark.parametrize("prefill, steps", [(11, 30), (40, 10), (3, 30)])
def test_a_sliding_buffer_holds_two_windows_and_returns_every_key_in_reach(prefill, steps):
    """Keys numbered by their absolute column. After each write of q columns ending at column e, the keys
    returned are columns kv_offset .. e - 1 as `get_mask_sizes` said, kv_offset <= e - q - (window - 1)
    (the first new query reaches that far back), and the buffer never holds more than 2 windows."""
    window = 8
    layer = SlidingBufferLayer(window, positions=prefill + steps)
    column = 0
    for q in [prefill] + [1] * steps:
        keys = torch.arange(column, column + q, dtype=torch.float).view(1, 1, q, 1)
        kv_length, kv_offset = layer.get_mask_sizes(q)
        out, _ = layer.update(keys, keys.clone())
        column += q
        assert out[0, 0, :, 0].tolist() == list(range(kv_offset, column)) and kv_length == column - kv_offset
        assert kv_offset <= max(column - q - (window - 1), 0)
        assert layer.get_seq_length() == column and layer.key_buf.shape[2] <= SLIDING_SPAN * window


def test_sliding_layers_hold_their_window_in_a_long_generation(models, tok):
    """Gemma 3's tiny model (3 sliding layers, 1 full) decodes 2 rows of 11 + 200 columns. Each buffer holds
    2 rows x 2 kv heads x 16 dims x 4 bytes = 256 bytes per position for keys and again for values (512). The
    full layer: 211 positions (108,032 bytes); each sliding layer: 2 windows, 16 positions (8,192 bytes);
    132,608 in all, where one buffer of 211 positions in every layer held 432,128."""
    model = models("gemma3")
    engine = FastEngine(model, tok, max_new_tokens=200)
    engine.eos = [len(tok)]  # no id ends a row: every row decodes 200 tokens
    rollout = engine.generate(PROMPTS, 1, greedy=True)
    assert rollout.response_mask.sum().item() == 2 * 200
    per_position = 2 * 2 * 2 * 16 * 4
    assert engine.cache_bytes == per_position * (211 + 3 * SLIDING_SPAN * TINY_WINDOW) == 132_608


def test_a_prompt_longer_than_the_sliding_buffer(models, tok):
    """A 40-id prompt: the prefill attends over more columns than the buffer holds (the one concatenation);
    the next steps' tokens are still `generate`'s."""
    model = models("gemma3")
    prompts = [list(range(3, 43)), list(range(3, 6))]
    theirs = HFEngine(model, tok, max_new_tokens=12).generate(prompts, 1, greedy=True)
    ours = FastEngine(model, tok, max_new_tokens=12).generate(prompts, 1, greedy=True)
    assert torch.equal(ours.response_ids, theirs.response_ids)


def test_held_rows_keep_their_linear_attention_state(models, tok):
    """Qwen3.5's layers 0-2 are Gated DeltaNet: a step with row 1 held changes row 0's conv and recurrent
    states and leaves row 1's as they were."""
    model = models("qwen3_5")
    cache = buffer_cache(model, 16)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        state = cache.layers[0]
        assert isinstance(state, StateLayer)
        before = [s.clone() for s in (state.conv_states[0], state.recurrent_states[0])]
        with rows_held(cache, torch.tensor([False, True])):
            model(input_ids=torch.tensor([[11], [12]]), cache=cache, use_cache=True)
    for now, then in zip((state.conv_states[0], state.recurrent_states[0]), before):
        assert torch.equal(now[1], then[1]) and not torch.equal(now[0], then[0])


def test_only_the_models_a_step_computes_exactly_take_it(models):
    """The lean step is for plain Llamas (in bf16 on a CPU); the static step refuses a sliding-window Qwen2."""
    assert not supports_static_decode(models("qwen2_window"))
    lean = {f: supports_lean_step(copy.deepcopy(models(f)).to(torch.bfloat16)) for f in FAMILY_NAMES}
    assert lean == {f: f == "llama" for f in FAMILY_NAMES}


def test_the_decode_path_line_names_the_cache_and_the_episode_runner(models, tok):
    hybrid, sliding = FastEngine(models("qwen3_5"), tok, max_new_tokens=4), FastEngine(models("gemma3"), tok,
                                                                                       max_new_tokens=4)
    assert hybrid.decode_path().endswith("tool episodes in one loop")
    assert "3 linear-attention states" in hybrid.decode_path()
    assert "turn-by-turn episodes: gemma3_text has sliding-window layers" in sliding.decode_path()
    assert "3 sliding buffers of at most 16 positions" in sliding.decode_path()
    assert "rows through 4 slots" in FastEngine(hybrid.model, tok, max_new_tokens=8, slots=4).decode_path()
    assert "every row at once (rollout.slots=4: gemma3_text has sliding-window layers" in FastEngine(
        sliding.model, tok, max_new_tokens=8, slots=4).decode_path()


class Host:
    """Calls a tool after turns 1 and 2; its reply is `reply_ids`, answered after `delay` seconds."""

    def __init__(self, reply_ids, delay=0.0):
        self.reply_ids, self.delay, self.turn = list(reply_ids), delay, 0

    def calls_in(self, text: str) -> list:
        self.turn += 1
        return [{"name": "calc", "arguments": {}}] if self.turn in (1, 2) else []

    def reply(self, calls) -> list[dict]:
        time.sleep(self.delay)
        return [{"role": "tool", "name": "calc", "content": "4"} for _ in calls]

    def append_ids(self, messages) -> list[int]:
        return list(self.reply_ids)


def hosts(delays=(0.0, 0.3, 0.0, 0.0)) -> list[Host]:
    """Replies of 1-4 ids; the second episode's tool is slow, so the others decode while it waits."""
    return [Host(range(7, 8 + i), delay) for i, delay in enumerate(delays)]


OPTIONS = EpisodeOptions(max_turns=3, max_turn_tokens=8, max_episode_tokens=40)
EPISODE_PROMPTS = [*PROMPTS, list(range(20, 27)), list(range(30, 35))]  # one episode each (greedy: G = 1)
TURN_ENDS = range(0, 512, 4)
"""Stop ids: a quarter of the vocabulary, so most turns end before their 8 tokens (a turn cut by its budget
reads no tool call and ends the episode)."""


def turn_by_turn(engine, host_list):
    def sample(batch, g, budget):
        return engine.generate(batch, g, greedy=True, max_new_tokens=budget)
    return run_episodes(sample, engine.tokenizer, EPISODE_PROMPTS, 1, host_list, OPTIONS)[0]


def test_hybrid_episodes_in_one_loop_equal_the_turn_by_turn_runners(models, tok):
    """Qwen3.5 continues its episodes in the loop: while the second episode waits for its slow tool the others
    decode, and its linear-attention state is held still through those hole steps (without the hold its
    tokens differ): the same greedy episodes as encoding every id again at each turn."""
    engine = FastEngine(models("qwen3_5"), tok, max_new_tokens=8)
    engine.eos = list(TURN_ENDS)
    assert engine.continues_episodes
    ours, metrics = engine.decode_episodes(EPISODE_PROMPTS, 1, hosts(), OPTIONS, greedy=True)
    theirs = turn_by_turn(engine, hosts((0.0,) * 4))
    assert metrics["episode/tool_calls_mean"] > 1  # most episodes called both tools
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_attention, theirs.response_attention)


def test_sliding_episodes_run_turn_by_turn_with_generates_tokens(models, tok):
    """Gemma 3's sliding windows would count the loop's holes: the engine refuses the loop, and its turns
    (later ones from prompts past the window, left-padded to different lengths) are `generate`'s."""
    model = models("gemma3")
    engine, hf = FastEngine(model, tok, max_new_tokens=8), HFEngine(model, tok, max_new_tokens=8)
    engine.eos = hf.eos = list(TURN_ENDS)
    assert not engine.continues_episodes
    with pytest.raises(ValueError, match="sliding-window layers"):
        engine.decode_episodes(EPISODE_PROMPTS, 1, hosts(), OPTIONS, greedy=True)
    ours, theirs = turn_by_turn(engine, hosts((0.0,) * 4)), turn_by_turn(hf, hosts((0.0,) * 4))
    assert int(ours.response_attention.sum(1).max()) + len(PROMPTS[1]) > SLIDING_SPAN * TINY_WINDOW
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_attention, theirs.response_attention)
