"""Tokens balanced across torchrun's ranks (covey/training/balance.py, train.balance_ranks).

The assignment by hand and as a permutation; the exchange of rows between 2 gloo processes on a long-tailed
batch (every row arrives whole, the tokens per rank end within 10%); and the real CLI under
`torchrun --nproc_per_node 2` on prompts of long-tailed lengths: balanced and unbalanced runs end on the
same weights (1e-5, where the weights move by more than 1e-3), the balanced one within 10% of even tokens.
"""

import json
import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from covey.batch import Rollout
from covey.config import load_config
from covey.training.balance import balance_ranks, balanced_assignment, max_over_mean, row_tokens
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides
from tests.training.test_torchrun import TORCHRUN, run_torchrun, step_rows

PAD = 2


# --------------------------------------------------------------------------- the assignment, by hand


def test_greedy_assignment_by_hand():
    # lengths [9, 7, 6, 5, 4, 3, 2, 2] onto 2 ranks of 4 rows each, longest first to the rank with the
    # fewest tokens (rank 0 on a tie); totals after each row:
    #   9 (row 0) -> r0 (tie 0, 0)        [9, 0]
    #   7 (row 1) -> r1                   [9, 7]
    #   6 (row 2) -> r1 (7 < 9)           [9, 13]
    #   5 (row 3) -> r0 (9 < 13)          [14, 13]
    #   4 (row 4) -> r1 (13 < 14)         [14, 17]
    #   3 (row 5) -> r0 (14 < 17)         [17, 17]
    #   2 (row 6) -> r0 (tie 17, 17)      [19, 17]  r0 now holds 4 rows: full
    #   2 (row 7) -> r1 (the only open)   [19, 19]
    # r0 = rows 0, 3, 5, 6 = 9 + 5 + 3 + 2 = 19; r1 = rows 1, 2, 4, 7 = 7 + 6 + 4 + 2 = 19: even.
    lengths = [9, 7, 6, 5, 4, 3, 2, 2]
    assert balanced_assignment(lengths, [4, 4]) == [[0, 3, 5, 6], [1, 2, 4, 7]]
    # As sampled (consecutive siblings, rows 0-3 on rank 0): 27 and 11 tokens, mean 19: 27 / 19 = 1.421
    assert max_over_mean([27, 11]) == pytest.approx(27 / 19)
    assert max_over_mean([19, 19]) == 1.0 and max_over_mean([0, 0]) == 1.0


def test_equal_counts_bind_the_greedy():
    # lengths [10, 1, 1, 1], 2 rows per rank: 10 -> r0 [10, 0]; 1 -> r1 [10, 1]; 1 -> r1 [10, 2], r1 full;
    # 1 -> r0 [11, 2]. Without the counts the last row would go to r1 as well (2 < 10), leaving r1 three rows.
    assert balanced_assignment([10, 1, 1, 1], [2, 2]) == [[0, 3], [1, 2]]
    # unequal counts are kept as given: 3 rows to r0, 1 to r1: 5 -> r0 [5, 0]; 4 -> r1 [5, 4], r1 full;
    # 3, 2 -> r0 [10, 4]
    assert balanced_assignment([5, 4, 3, 2], [3, 1]) == [[0, 2, 3], [1]]
    assert balanced_assignment([], [0, 0]) == [[], []]


@pytest.mark.parametrize("counts", [[3, 4], [2, -1, 3], []])
def test_counts_that_do_not_cover_the_rows_are_refused(counts):
    with pytest.raises(ValueError, match=r"^balanced_assignment: counts .* must be >= 0 and sum to the 4 rows"):
        balanced_assignment([1, 2, 3, 4], counts)


def test_the_assignment_is_a_permutation_with_the_counts_asked():
    rng = random.Random(0)
    for _ in range(200):
        ranks = rng.randint(1, 6)
        counts = [rng.randint(0, 9) for _ in range(ranks)]
        lengths = [rng.choice([1, 2, 3, 50, 400]) + rng.randint(0, 5) for _ in range(sum(counts))]
        rows = balanced_assignment(lengths, counts)
        assert [len(r) for r in rows] == counts
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(r == sorted(r) for r in rows)
        if len(set(counts)) == 1 and counts[0] > 0:  # equal counts: no rank ends above the mean by more than
            totals = [sum(lengths[i] for i in r) for r in rows]  # the longest row (the greedy's bound)
            assert max(totals) <= sum(lengths) / ranks + max(lengths)


def test_row_tokens_count_real_prompt_and_response_tokens():
    # row 0: prompt [pad, 5, 6] (2 real), response [7, 8, pad] with mask [1, 1, 0] (2): 4 tokens
    # row 1: prompt [4, 5, 6] (3 real), response [9, pad, pad] (1): 4 tokens
    ro = Rollout(prompt_ids=torch.tensor([[PAD, 5, 6], [4, 5, 6]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                 response_ids=torch.tensor([[7, 8, PAD], [9, PAD, PAD]]),
                 response_mask=torch.tensor([[1.0, 1, 0], [1, 0, 0]]), group_ids=torch.tensor([0, 1]),
                 truncated=torch.tensor([False, False]), completions=["a", "b"], example_index=[0, 1])
    assert row_tokens(ro).tolist() == [4, 4]
    # an episode: its environment's tokens (attended, not trained) are forward-pass tokens too: row 1 then 3
    ro.response_attention = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    assert row_tokens(ro).tolist() == [4, 6]


def test_one_process_is_a_pass_through():
    ro = long_tailed_batch()
    out, metrics = balance_ranks(ro, PAD)
    assert out is ro and metrics == {}


# --------------------------------------------------------------------------- the exchange between 2 processes


def long_tailed_batch(groups: int = 8, group_size: int = 4, seed: int = 0) -> Rollout:
    """A batch whose groups come sorted longest first (rank 0 of 2 takes all the long answers): prompts of
    3-6 tokens, response lengths from a Pareto-like tail (4 / u**0.9, cut at 160), each row's `scores` its
    index; every per-row field the update reads is set."""
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    u = torch.rand(n, generator=g).clamp(min=1e-3)
    lengths = (4 / u ** 0.9).clamp(max=160).long()
    by_group = lengths.view(groups, group_size).sum(1).argsort(descending=True)
    lengths = lengths.view(groups, group_size)[by_group].flatten()
    prompt_lens = torch.randint(3, 7, (groups,), generator=g).repeat_interleave(group_size)
    width_p, width_l = int(prompt_lens.max()), int(lengths.max())
    prompt_mask = (torch.arange(width_p)[None] >= width_p - prompt_lens[:, None]).long()
    mask = (torch.arange(width_l)[None] < lengths[:, None]).float()
    prompt_ids = torch.where(prompt_mask.bool(), torch.randint(3, 500, (n, width_p), generator=g), PAD)
    response_ids = torch.where(mask.bool(), torch.randint(3, 500, (n, width_l), generator=g), PAD)
    advantages = torch.randn(n, 1, generator=g) * mask
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=mask,
                   group_ids=torch.arange(groups).repeat_interleave(group_size), truncated=lengths == 160,
                   completions=[f"row {i}" for i in range(n)], example_index=list(range(n)),
                   scores=torch.arange(n, dtype=torch.float), reward_parts={"part": torch.arange(n) * 2.0},
                   old_logp=-torch.rand(n, width_l, generator=g) * mask, advantages=advantages, kept_tokens=mask.bool(),
                   messages=[[{"role": "assistant"}]] * n)


def local_share(ro: Rollout, rank: int, size: int) -> Rollout:
    """Rank `rank`'s consecutive block of rows, cut to its own widths (as a rank's own sampling leaves it),
    group ids numbered from 0 on each rank."""
    per = len(ro) // size
    part = ro.select(torch.arange(rank * per, (rank + 1) * per))
    keep_p = int(part.prompt_mask.sum(1).max())
    keep_l = int(part.response_mask.sum(1).max())
    for name in ("prompt_ids", "prompt_mask"):
        setattr(part, name, getattr(part, name)[:, -keep_p:])
    for name in ("response_ids", "response_mask", "old_logp", "advantages", "kept_tokens"):
        setattr(part, name, getattr(part, name)[:, :keep_l])
    part.group_ids = part.group_ids - int(part.group_ids.min())
    return part


def exchange_worker(rank: int, size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        mine = local_share(long_tailed_batch(), rank, size)
        balanced, metrics = balance_ranks(mine, PAD)
        _, off = balance_ranks(mine, PAD, enabled=False)
        torch.save({"rollout": balanced, "metrics": metrics, "off": off}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_processes_exchange_whole_rows_and_even_out_tokens(tmp_path):
    mp.spawn(exchange_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    whole = long_tailed_batch()
    tokens = row_tokens(whole)
    sampled = [float(tokens[:16].sum()), float(tokens[16:].sum())]
    # rows of 7 to 128 tokens (median 13); rank 0 drew the long tail: 446 against 204 tokens, 1.37 times the mean
    assert sampled == [446, 204] and max_over_mean(sampled) > 1.3
    balanced = [float(row_tokens(g["rollout"]).sum()) for g in got]
    assert sum(balanced) == sum(sampled) and max_over_mean(balanced) <= 1.1
    for g in got:
        assert g["metrics"] == pytest.approx({"dist/sampled_tokens_max_over_mean": max_over_mean(sampled),
                                              "dist/tokens_max_over_mean": max_over_mean(balanced)})
        assert g["off"] == {"dist/sampled_tokens_max_over_mean": g["metrics"]["dist/sampled_tokens_max_over_mean"],
                            "dist/tokens_max_over_mean": g["metrics"]["dist/sampled_tokens_max_over_mean"]}
    rows = [int(s) for g in got for s in g["rollout"].scores]
    assert sorted(rows) == list(range(32)) and [len(g["rollout"]) for g in got] == [16, 16]
    for g in got:  # each row whole (to the common widths: both ranks' widest), in increasing global order
        ro, index = g["rollout"], g["rollout"].scores.long()
        assert index.tolist() == sorted(index.tolist())
        expect = whole.select(index)
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "old_logp", "advantages",
                     "kept_tokens", "truncated", "scores"):
            assert torch.equal(getattr(ro, name), getattr(expect, name)), name
        assert torch.equal(ro.reward_parts["part"], expect.reward_parts["part"])
        assert ro.completions == expect.completions and ro.example_index == expect.example_index
        assert ro.messages is None  # not read by the update: not moved
        # group ids made unique across ranks: rank 0's groups 0-3 stay, rank 1's 0-3 become 4-7
        assert ro.group_ids.tolist() == whole.group_ids[index].tolist()


# --------------------------------------------------------------------------- the real CLI under torchrun


def test_the_key_reaches_the_plan(tiny_model_dir, tmp_path):
    assert make_plan(load_config(None, tiny_overrides(tiny_model_dir, tmp_path))).run.balance_ranks
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"balance_ranks": "false"}))
    assert not cfg.train.balance_ranks and not make_plan(cfg).run.balance_ranks


def long_tailed_prompts(path) -> str:
    """8 questions whose lengths have a long tail: 6 short ones, one of 12 terms and one of 40."""
    terms = [1, 1, 2, 2, 3, 3, 12, 40]
    with open(path, "w") as f:
        for k in terms:
            f.write(json.dumps({"prompt": "Add " + " + ".join(["7"] * k) + ".", "answer": str(7 * k)}) + "\n")
    return str(path)


def cli_overrides(model_dir, tmp_path, run_name, balance):
    return tiny_overrides(model_dir, tmp_path, **{
        "train.run_name": run_name, "train.balance_ranks": balance, "task.name": "file",
        "task.path": long_tailed_prompts(tmp_path / "prompts.jsonl"), "task.eval_size": 0, "task.train_size": 8,
        "rollout.prompts_per_step": 4, "rollout.seeding": "per_prompt", "optim.lr": 1e-3,
        "reward.functions": "tests.training.test_torchrun:digit_share:1.0", "reward.correctness": 0.0,
        "algo.minibatches": 1, "train.eval_every": 0, "rollout.precision": "float32", "model.autocast": "none"})


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found next to the Python executable")
def test_balanced_and_unbalanced_runs_end_on_the_same_weights(tiny_model_dir, tmp_path):
    for name, balance in (("balanced", "true"), ("unbalanced", "false")):
        run_torchrun(cli_overrides(tiny_model_dir, tmp_path, name, balance))
    on, off = step_rows(tmp_path / "balanced"), step_rows(tmp_path / "unbalanced")
    assert [r["step"] for r in on] == [1, 2]
    for a, b in zip(on, off):
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], abs=1e-5)
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        assert a["dist/sampled_tokens_max_over_mean"] == b["dist/tokens_max_over_mean"]  # as sampled
        assert a["dist/tokens_max_over_mean"] <= 1.1  # balanced: within 10% of even
    assert max(r["dist/tokens_max_over_mean"] for r in off) > 1.2  # the 40-term prompt fell on one rank
    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    one = load_file(str(tmp_path / "balanced" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "unbalanced" / "final" / "model.safetensors"))
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-3  # the weights did move
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
