"""covey.runtime.dist and covey.training.global_batch in one process: the split of a global batch and
split-independent sampling.

The multi-process behaviour itself is tested end to end in tests/training/test_torchrun.py.
"""

import pytest
import torch

from covey.config import ConfigError, load_config, validate_world
from covey.models.load import load_policy
from covey.rollout.hf import HFEngine
from covey.runtime.dist import SilentLogger, World, rank_share, reduce_metrics, uneven_share
from covey.runtime.fsdp import unsharded
from covey.tasks.data import PromptStream
from covey.training.global_batch import draw_share, global_normalizer, prompt_seed
from tests.helpers import tiny_overrides


def test_rank_shares_keep_prompts_whole_and_cover_the_batch():
    ids = [7, 3, 9, 1, 4, 8]
    shares = [rank_share(ids, World(rank=r, size=3)) for r in range(3)]
    assert shares == [[7, 3], [9, 1], [4, 8]]
    with pytest.raises(ValueError, match="evenly"):
        rank_share(ids, World(rank=0, size=4))
    assert sorted(sum((uneven_share(list(range(5)), World(rank=r, size=2)) for r in range(2)), [])) == list(range(5))


def test_every_rank_draws_the_same_global_batch():
    """Rank r's share of draw indices is what one process would draw at those positions."""
    single = PromptStream(6, seed=3)
    whole = single.next(4) + single.next(4)  # two steps in one process
    got = []
    streams = [PromptStream(6, seed=3) for _ in range(2)]
    for _ in range(2):
        for rank, stream in enumerate(streams):
            ids, draws = draw_share(stream, 4, World(rank=rank, size=2))
            got += list(zip(ids, draws))
    assert sorted(got, key=lambda x: x[1]) == list(zip(whole, range(8)))  # draws 0..7, crossing an epoch


def test_per_prompt_seeds_make_samples_independent_of_the_split(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir)
    engine = HFEngine(model, tokenizer, max_new_tokens=6)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("What is 2+3?", "Add 40 and 2")]
    seeds = [prompt_seed(0, d) for d in (5, 6)]
    state = torch.get_rng_state()
    together = engine.generate(prompts, 3, seeds=seeds)
    assert torch.equal(torch.get_rng_state(), state)  # the run's own RNG stream is left alone
    apart = [engine.generate([p], 3, seeds=[s]) for p, s in zip(prompts, seeds)]
    for i, part in enumerate(apart):
        width = part.response_ids.shape[1]
        assert torch.equal(together.response_ids[3 * i:3 * i + 3, :width], part.response_ids)
        assert part.completions == together.completions[3 * i:3 * i + 3]
    assert together.group_ids.tolist() == [0, 0, 0, 1, 1, 1] and together.example_index == [0, 0, 0, 1, 1, 1]
    other = engine.generate(prompts, 3, seeds=[prompt_seed(0, 7), prompt_seed(0, 8)])
    assert other.completions != together.completions


def test_single_process_is_a_pass_through(tiny_model_dir, tmp_path):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    norm = global_normalizer("token_mean", mask, 8)
    assert (norm.total_tokens, norm.num_seqs, norm.num_processes) == (3.0, 2.0, 1)
    metrics = {"reward/mean": 0.5, "time/step": 1.0}
    assert reduce_metrics(metrics) is metrics
    model, _ = load_policy(tiny_model_dir)
    with unsharded(model):  # no FSDP: nothing to gather
        pass
    SilentLogger().log(1, {"a": 1})  # every method exists and does nothing


def test_world_size_checks(tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"rollout.prompts_per_step": 3}))
    validate_world(cfg, 1)
    with pytest.raises(ConfigError, match="multiple of the 2 processes"):
        validate_world(cfg, 2)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"algo.dynamic_sampling": "true"}))
    with pytest.raises(ConfigError, match="not supported yet"):
        validate_world(cfg, 2)
