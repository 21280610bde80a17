"""Tokens balanced across torchrun's ranks: which rank trains which row of the step's batch.

Each rank samples B/W whole groups (covey/training/global_batch.py: a prompt's G answers stay on
one rank), so one rank can draw every long answer while the others wait for it at each FSDP
collective of the update. After the advantages (computed on whole groups of the gathered batch)
`balance_ranks` hands the rows out again (`train.balance_ranks`): `balanced_assignment` sends the
longest row first to the rank with the fewest tokens so far, each rank keeping its number of rows,
so every rank still runs the same number of mini- and micro-batches, hence of FSDP collectives.

Exact: every optimizer step's loss normaliser is global (all-reduced token and sequence counts,
covey/algos/aggregation.py) and each rank's loss is scaled by W before FSDP averages the ranks'
gradients, so the gradient is the sum over the step's rows whichever rank computes each of them;
only float rounding differs (tests/training/test_balance_ranks.py).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from covey.batch import Rollout, pad
from covey.runtime.dist import all_reduce, gather_rows, world_size

PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
"""The (N, P) fields: left-padded. Every other (N, L) field is right-padded."""
TOKEN_ID_FIELDS = ("prompt_ids", "response_ids")
"""The fields padded with the pad token; the others with 0 (False)."""
UNUSED_BY_UPDATE = ("messages", "environments", "turn_steps")
"""Per-row fields the update never reads (an episode's environment objects need not even pickle): not moved."""


def balanced_assignment(lengths: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Rows onto ranks, greedily by length: the longest row first, each to the rank with the fewest
    tokens so far (the lowest rank on a tie) among those holding fewer than `counts[r]` rows.

    lengths: (N,) tokens of each row; counts: (W,) rows each rank takes, summing to N.
    Returns each rank's row indices in increasing order (a partition of range(N)).
    """
    if len(counts) == 0 or any(c < 0 for c in counts) or sum(counts) != len(lengths):
        raise ValueError(f"balanced_assignment: counts {list(counts)} must be >= 0 and sum to the "
                         f"{len(lengths)} rows")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    open_ranks = [(0, r) for r in range(len(counts)) if counts[r] > 0]  # (tokens so far, rank): a heap
    rows: list[list[int]] = [[] for _ in counts]
    for i in order:
        tokens, r = heapq.heappop(open_ranks)
        rows[r].append(i)
        if len(rows[r]) < counts[r]:  # a full rank leaves the heap for good
            heapq.heappush(open_ranks, (tokens + int(lengths[i]), r))
    return [sorted(r) for r in rows]


def max_over_mean(tokens: Sequence[float]) -> float:
    """Imbalance of tokens per rank: the largest over the mean (1 = even; W = one rank holds them all)."""
    mean = sum(tokens) / max(len(tokens), 1)
    return max(tokens) / mean if mean > 0 else 1.0


def row_tokens(rollout: Rollout) -> Tensor:
    """(N,) tokens each row puts through a training forward pass: its real prompt and response tokens."""
    return rollout.prompt_mask.long().sum(1) + rollout.response_attended.bool().long().sum(1)


def balance_ranks(rollout: Rollout, pad_token_id: int, enabled: bool = True) -> tuple[Rollout, dict]:
    """This rank's rows for the update, and the imbalance metrics; in one process (rollout, {}).

    `dist/sampled_tokens_max_over_mean`: tokens per rank as sampled; `dist/tokens_max_over_mean`: as
    the update runs them (the same when `enabled` is False). Balanced, the rows keep every per-row
    tensor (log-probs, advantages, ...) but not `UNUSED_BY_UPDATE`, and their group ids are made
    unique across ranks (each rank numbers its groups from 0).
    """
    size = world_size()
    if size == 1:
        return rollout, {}
    rank = dist.get_rank()
    every = gather_rows({"tokens": row_tokens(rollout), "rank": torch.full((len(rollout),), rank)})
    lengths, ranks = every["tokens"].tolist(), every["rank"]
    counts = [int((ranks == r).sum()) for r in range(size)]
    sampled = [float(every["tokens"][ranks == r].sum()) for r in range(size)]
    metrics = {"dist/sampled_tokens_max_over_mean": max_over_mean(sampled)}
    if not enabled:
        return rollout, {**metrics, "dist/tokens_max_over_mean": metrics["dist/sampled_tokens_max_over_mean"]}
    assignment = balanced_assignment(lengths, counts)
    metrics["dist/tokens_max_over_mean"] = max_over_mean([sum(lengths[i] for i in rows) for rows in assignment])
    return exchange_rows(rollout, assignment, sum(counts[:rank]), pad_token_id), metrics


def exchange_rows(rollout: Rollout, assignment: list[list[int]], first: int, pad_token_id: int) -> Rollout:
    """Rank r's rows `assignment[r]` (indices into the ranks' rows in rank order; this rank's start at
    `first`) from every rank, in that order: one scatter per sending rank, of the rows it sends each rank."""
    rank, size = dist.get_rank(), world_size()
    common = all_reduce(torch.tensor([rollout.prompt_ids.shape[1], rollout.response_ids.shape[1],
                                      int(rollout.group_ids.max()) + 1 if len(rollout) else 0]), dist.ReduceOp.MAX)
    width_p, width_l, groups = (int(v) for v in common)
    mine = widened(dataclasses.replace(rollout, **dict.fromkeys(UNUSED_BY_UPDATE)), width_p, width_l, pad_token_id)
    mine.group_ids = mine.group_ids + rank * groups  # rank r's groups: r*groups ... (r+1)*groups - 1
    outgoing = [mine.select(torch.tensor([i - first for i in rows if first <= i < first + len(rollout)],
                                         dtype=torch.long)) for rows in assignment]
    received = []
    for source in range(size):
        box: list = [None]
        dist.scatter_object_list(box, outgoing if source == rank else None, src=source)
        received.append(box[0])
    return stack_rows(received)


def widened(rollout: Rollout, width_p: int, width_l: int, pad_token_id: int) -> Rollout:
    """Every (N, P) field left-padded to `width_p`, every other 2-D field right-padded to `width_l` (with the
    pad token for token ids, 0 elsewhere): the training passes cut all-padding columns again (passes.logprobs.trim)."""
    out = {}
    for f in dataclasses.fields(rollout):
        value = getattr(rollout, f.name)
        if isinstance(value, Tensor) and value.dim() == 2:
            left = f.name in PROMPT_FIELDS
            value = pad(value, width_p if left else width_l, left, pad_token_id if f.name in TOKEN_ID_FIELDS else 0)
        out[f.name] = value
    return Rollout(**out)


def stack_rows(parts: list[Rollout]) -> Rollout:
    """The rows of `parts`, in order, as one Rollout (every part of the same widths and fields)."""
    out = {}
    for f in dataclasses.fields(Rollout):
        values = [getattr(p, f.name) for p in parts]
        if f.name == "response_attention" and any(v is not None for v in values):  # a part without: its mask
            values = [p.response_attended for p in parts]
        if any(v is None for v in values) and any(v is not None for v in values):
            raise ValueError(f"balance_ranks: Rollout.{f.name} is set on some ranks only")
        if values[0] is None:
            out[f.name] = None
        elif isinstance(values[0], Tensor):
            out[f.name] = torch.cat(values)
        elif isinstance(values[0], list):
            out[f.name] = [item for v in values for item in v]
        else:  # a dict of (N,) tensors: the reward's parts
            out[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
    return Rollout(**out)
