"""Tool episodes on a GPU (marked `gpu`: skipped without one; run by scripts/gpu_check.sh). The CPU twin:
test_fast_episodes.py.

The fast engine's episode loop on CUDA (eager steps) gives the greedy episodes of the turn-by-turn runner
driving the CUDA-graph engine (each turn a prefill of the episode so far, then graph replays); a second
batch of episodes replays the graphs the first captured.
"""

import pytest
import torch

from covey.models.tiny import tiny_llama
from covey.rollout.episodes import run_episodes
from covey.rollout.fast import FastEngine
from covey.rollout.local import DecodeOptions
from tests.rollout.test_fast_episodes import PROMPTS, hosts, options

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok)).cuda().eval()


def stop_early(engine, tok):
    engine.eos = sorted({tok.eos_token_id, *range(40, 90)})
    return engine


def test_greedy_episodes_of_the_loop_equal_the_graph_engines_turn_by_turn(model, tok):
    loop = stop_early(FastEngine(model, tok, max_new_tokens=10), tok)
    graphs = stop_early(FastEngine(model, tok, max_new_tokens=10, **DecodeOptions("graphs").resolve("cuda")), tok)
    assert loop.continues_episodes and not graphs.continues_episodes

    def turn_by_turn():
        def sample(batch, g, budget):
            return graphs.generate(batch, g, greedy=True, max_new_tokens=budget)
        return run_episodes(sample, tok, PROMPTS, 2, hosts(6), options())[0]

    ours, _ = loop.decode_episodes(PROMPTS, 2, hosts(6), options(), greedy=True)
    theirs = turn_by_turn()
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_attention, theirs.response_attention)
    captured = graphs.static.runner.captures
    turn_by_turn()
    assert graphs.static.runner.captures == captured  # the turns of a second batch replay the same graphs
