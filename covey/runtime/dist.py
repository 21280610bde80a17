"""Multi-process training on torch.distributed: `torchrun` starts the processes, FSDP2 shards.

There is no launcher or communication layer of covey's own: `torchrun` sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; `init_distributed` reads them and opens
one process group (nccl on GPUs, gloo on CPU, which is how CI tests this path);
`fully_shard` (FSDP2) shards the policy, the critic and the reference.

What "the same global batch" takes, so that W processes compute what one process
computes on the same B prompts (the test in tests/test_distributed_torchrun.py):

1. prompts: every rank draws the same B ids from the same seeded PromptStream and keeps
   a contiguous share of B/W prompts; a prompt's G samples stay on one rank;
2. samples: with ``rollout.seeding=per_prompt`` each group is sampled from its own seed
   (run seed, draw index of the prompt in the shuffled stream), so what is drawn does not
   depend on how the batch is split (with ``global`` it does: each rank has its own RNG);
3. advantages: computed on the gathered global batch (``gather_rows``), exact also for
   batch-wide whitening (REINFORCE++) and reward-side statistics;
4. loss: one ``Normalizer`` per optimizer step from all-reduced totals, times W
   because FSDP averages gradients over ranks (docs/algorithms.md, Aggregation);
5. mini-batches: each rank shuffles its own share; with ``algo.minibatches=1`` the
   optimizer steps see exactly the global batch, with more they see other (equally
   valid) splits than a single process would.

Models are only unsharded (all-gathered) for generation with the HF engine, where ranks
run different numbers of decoding steps and so cannot take part in per-layer collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from covey import algos

# Metrics combined across ranks by sum or max; every other number is averaged.
SUMMED_METRICS = ("reward/errors", "reward/dropped", "groups/resampled", "eval/n", "throughput/tokens_per_s")
MAXED_SUFFIXES = ("_max", "max_abs", "/len_max")
MAXED_PREFIXES = ("time/", "memory/")


@dataclass(frozen=True)
class World:
    """Where this process stands: rank among `size` processes, and the device it trains on."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_distributed(use_cuda: bool = False, timeout_s: float = 1800.0) -> World:
    """World of this process; opens the process group when torchrun started several.

    `timeout_s` bounds every collective: a rank that dies makes the others raise
    instead of waiting forever.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("a CUDA device is needed (rollout.engine=vllm) but torch sees none")
    device = f"cuda:{local_rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device(device) if use_cuda else None)
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _collective_device() -> torch.device:
    """nccl reduces CUDA tensors, gloo CPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- data split


def rank_share(items: list, world: World) -> list:
    """This rank's contiguous share of a global list (prompt ids): rank r gets block r of W."""
    if len(items) % world.size:
        raise ValueError(f"{len(items)} prompts cannot be split evenly over {world.size} processes")
    per_rank = len(items) // world.size
    return items[world.rank * per_rank:(world.rank + 1) * per_rank]


def uneven_share(items: list, world: World) -> list:
    """Rank r's strided share of a list that need not divide evenly (held-out prompts)."""
    return items[world.rank::world.size]


# --------------------------------------------------------------------------- global sums


def all_reduce(tensor: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
    """Reduced copy of `tensor` over all ranks (the tensor itself when not distributed)."""
    if world_size() == 1:
        return tensor
    work = tensor.detach().to(_collective_device(), copy=True)
    dist.all_reduce(work, op=op)
    return work.to(tensor.device)


def global_normalizer(mode: str, step_mask: Tensor, max_len: int) -> algos.Normalizer:
    """The optimizer step's normaliser over every rank's sequences (all-reduced totals).

    Multiplied by the number of processes inside `aggregate`, because FSDP averages
    the gradients of the ranks: the average of W scaled shares is the global loss.
    """
    size = world_size()
    if size == 1:
        return algos.make_normalizer(mode, step_mask, max_len=max_len)
    tokens, seqs = (float(v) for v in all_reduce(algos.step_totals(step_mask)))
    return algos.Normalizer.from_totals(mode, tokens, seqs, max_len, num_processes=size)


def gather_rows(tensors: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Concatenate per-sequence tensors of all ranks in rank order; (n, L) ones right-padded with 0.

    A name that is None on this rank must be None on every rank.
    """
    if world_size() == 1:
        return dict(tensors)
    local = {k: (v.detach().cpu() if v is not None else None) for k, v in tensors.items()}
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, local)
    out = {}
    for name, value in local.items():
        if value is None:
            out[name] = None
            continue
        parts = [part[name] for part in everyone]
        if value.dim() == 2:
            width = max(p.shape[1] for p in parts)
            parts = [nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
        out[name] = torch.cat(parts)
    return out


def reduce_metrics(metrics: dict) -> dict:
    """Combine each rank's step metrics: counts summed, maxima and timings maxed, the rest averaged."""
    size = world_size()
    if size == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    everyone: list = [None] * size
    dist.all_gather_object(everyone, {k: float(metrics[k]) for k in keys})
    out = dict(metrics)
    for key in keys:
        values = [part[key] for part in everyone if key in part]
        if key in SUMMED_METRICS:
            out[key] = sum(values)
        elif key.endswith(MAXED_SUFFIXES) or key.startswith(MAXED_PREFIXES):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def reduce_eval(result: dict) -> dict:
    """Held-out results evaluated on strided shares: rates weighted by each rank's eval/n."""
    if world_size() == 1:
        return result
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, result)
    total = sum(part["eval/n"] for part in everyone)
    out = dict(result)
    for key, value in result.items():
        if key == "eval/n":
            out[key] = total
        elif key.startswith("eval/") and isinstance(value, (int, float)):
            out[key] = sum(part[key] * part["eval/n"] for part in everyone) / max(total, 1)
    return out


# --------------------------------------------------------------------------- FSDP2


def block_classes(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks, from Hugging Face's `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_model(model: nn.Module | None, device: str) -> nn.Module | None:
    """Move to the training device; under torchrun, `fully_shard` each block and the root.

    Blocks are sharded one by one so only one block is all-gathered at a time; the
    root group holds the rest (embeddings, tied output layer, norms, value head).
    None, or a view without parameters of its own (the LoRA reference), is returned as is.
    """
    if model is None or next(model.parameters(), None) is None:
        return model
    model.to(device)
    if world_size() == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    blocks = block_classes(model)
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(fsdp_root(model))
    return model


def fsdp_root(model: nn.Module) -> nn.Module:
    """The module every forward enters: a PEFT wrapper's base model (its `generate` calls that, not the wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """Whole parameters on every rank for the duration (no collectives inside); re-entrant.

    HF generation runs as many forward passes as its longest sample needs, which
    differs between ranks; sharded layers would all-gather in each and deadlock.
    """
    modules, root = _fsdp_modules(model), fsdp_root(model)
    depth = getattr(model, "_covey_unsharded", 0)
    if not modules or depth:  # nothing sharded, or an enclosing block already holds whole parameters
        model._covey_unsharded = depth + 1
        try:
            yield model
        finally:
            model._covey_unsharded = depth
        return
    with torch.inference_mode(False):  # FSDP's buffers must not become inference tensors
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
    model._covey_unsharded = 1
    try:
        yield model
    finally:
        model._covey_unsharded = 0
        with torch.inference_mode(False):
            for module in modules:  # fully_shard's default: blocks reshard after forward, the root not
                module.set_reshard_after_forward(module is not root, recurse=False)
                module.reshard()


def _full_options(strict: bool = True, cpu_offload: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def full_state_dict(model: nn.Module, on_every_rank: bool = False) -> dict[str, Tensor]:
    """Complete CPU state dict on rank 0 (empty on the others, unless `on_every_rank`); a collective under FSDP."""
    if not _fsdp_modules(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    state = get_model_state_dict(model, options=_full_options(cpu_offload=not on_every_rank))
    return {k: v.cpu() for k, v in state.items()} if on_every_rank else state


class FullStateModel:
    """A sharded model seen through whole tensors, for checkpoint code written for one process.

    state_dict / save_pretrained use the full state gathered on rank 0; load_state_dict
    takes a full state (read by every rank) and keeps each rank's shard of it.
    """

    def __init__(self, model: nn.Module, full: dict | None):
        self.model, self.full = model, full

    def __getattr__(self, name):
        return getattr(self.model, name)

    def state_dict(self) -> dict:
        """The full state when gathered; when loading, the model's own (its keys are what loaders match)."""
        return self.full if self.full is not None else self.model.state_dict()

    def save_pretrained(self, folder, **kwargs):
        """HF folder; a tied weight (lm_head = embeddings) is stored once, as save_pretrained does."""
        own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
        state = {k: v for k, v in self.full.items() if k in own}
        return self.model.save_pretrained(folder, state_dict=state, **kwargs)

    def load_state_dict(self, state: dict, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        return set_model_state_dict(self.model, state, options=_full_options(strict))


class FullStateOptimizer:
    """An optimizer over sharded parameters seen through full, name-keyed states (see FullStateModel)."""

    def __init__(self, model: nn.Module, optimizer, full: dict | None):
        self.model, self.optimizer, self.full = model, optimizer, full
        self.state = (full or {}).get("state", {})
        self.param_groups = (full or {}).get("param_groups", [])

    def state_dict(self) -> dict:
        return self.full

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optimizer, self.keyed_by_name(state), options=_full_options())

    def keyed_by_name(self, state: dict) -> dict:
        """A one-process checkpoint keys parameters by position: rename them by parameter name."""
        if all(isinstance(k, str) for k in state["state"]):
            return state
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
        return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


@contextlib.contextmanager
def whole_tensors(run, gather: bool):
    """Within the block, `run`'s models and optimizers show whole tensors (a no-op without FSDP).

    gather=True (saving): every rank joins the all-gathers, rank 0 holds the full CPU states.
    gather=False (resuming): full states read from disk are loaded into each rank's shards.
    """
    names = [n for n in ("policy", "critic", "reference")
             if getattr(run, n) is not None and _fsdp_modules(getattr(run, n))]
    if not names:
        yield run
        return
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    saved = {n: getattr(run, n) for n in (*names, "optimizer", "critic_optimizer")}
    for name in names:
        setattr(run, name, FullStateModel(saved[name], full_state_dict(saved[name]) if gather else None))
    for opt_name, model_name in (("optimizer", "policy"), ("critic_optimizer", "critic")):
        if saved.get(opt_name) is not None and model_name in names:
            model, opt = saved[model_name], saved[opt_name]
            full = get_optimizer_state_dict(model, opt, options=_full_options()) if gather else None
            setattr(run, opt_name, FullStateOptimizer(model, opt, full))
    try:
        yield run
    finally:
        for name, value in saved.items():
            setattr(run, name, value)


def save_on_main(run, write):
    """`write(run)` on rank 0 from whole tensors (its result; None elsewhere); every rank joins the gathers."""
    with whole_tensors(run, gather=True):
        path = write(run) if is_main_process() else None
    barrier()
    return path


class SilentLogger:
    """Stands in for MetricsLogger on ranks other than 0: every method does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def quiet_unless_main(world: World) -> None:
    """Rank 0 alone prints: the others' stdout goes to /dev/null (stderr, with errors, stays)."""
    if not world.is_main:
        sys.stdout = open(os.devnull, "w")


def broadcast_object(value):
    """Rank 0's value on every rank (e.g. a run name made from the clock)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_finite(loss: Tensor) -> bool:
    """True when the loss is finite on every rank: all skip the update together, or none does."""
    return on_all_ranks(bool(torch.isfinite(loss.detach()).all()))


def on_all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank: a code path with collectives is taken by all or by none."""
    if world_size() == 1:
        return flag
    return bool(all_reduce(torch.tensor([float(flag)]), dist.ReduceOp.MIN)[0] > 0)


def plain_norm(norm: Tensor) -> Tensor:
    """clip_grad_norm_ returns a replicated DTensor under FSDP2: the plain tensor of its value."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# --------------------------------------------------------------------------- sampling


def draw_share(stream, count: int, world: World) -> tuple[list[int], list[int]]:
    """This rank's prompt ids among the next `count` of the stream, and their absolute draw indices.

    Every rank draws the same global batch (same seeded stream); the draw index (position in
    the endless shuffled stream) names a prompt draw uniquely across steps and resampling rounds.
    """
    first = stream.epoch * stream.size + stream.position
    ids = stream.next(count)
    return rank_share(ids, world), rank_share(list(range(first, first + count)), world)


def prompt_seed(run_seed: int, draw: int) -> int:
    return (run_seed * 1_000_003 + draw) % (2**63 - 1)


def sample_groups(engine, prompts: list[str], group_size: int, seeds: list[int] | None):
    """G samples per prompt; with seeds, each group from its own seed (per_prompt seeding).

    The HF engine draws from torch's global generator, so each seeded group is one
    generate call inside a forked RNG (the run's own stream is left untouched); an engine
    that takes per-request seeds (vLLM) does the whole batch in one call.
    """
    if seeds is None:
        return engine.generate(prompts, group_size)
    if getattr(engine, "takes_seeds", False):
        return engine.generate(prompts, group_size, seeds=seeds)
    from covey.batch import concat_rollouts

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    whole = engine.whole_parameters() if hasattr(engine, "whole_parameters") else contextlib.nullcontext()
    parts = []
    with whole:  # under FSDP: gathered once for all the groups
        for prompt, seed in zip(prompts, seeds):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                parts.append(engine.generate([prompt], group_size))
    rollout = concat_rollouts(parts, engine.tokenizer.pad_token_id)
    rollout.example_index = rollout.group_ids.tolist()  # position of the prompt in `prompts`
    return rollout


class GatheredGeneration:
    """An engine that reads the (FSDP-sharded) policy itself, run on whole parameters.

    Generation runs a different number of forward passes on each rank; with sharded
    layers each would all-gather and the ranks would deadlock. Without FSDP this is a
    plain pass-through.
    """

    def __init__(self, engine, policy: nn.Module):
        self.engine, self.policy = engine, policy

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def whole_parameters(self):
        return unsharded(self.policy)

    def generate(self, *args, **kwargs):
        with unsharded(self.policy):
            return self.engine.generate(*args, **kwargs)


# --------------------------------------------------------------------------- global views of a batch


def global_advantages(name: str, inp: algos.AdvantageInput, opts: algos.AdvantageOptions):
    """`algos.compute_advantages` on the batch of all ranks; returns this rank's rows.

    Group-relative estimators would be exact per rank (groups are whole), but batch-wide
    whitening (REINFORCE++, normalize=batch|global_token) needs every rank's sequences.
    """
    if world_size() == 1:
        return algos.compute_advantages(name, inp, opts)
    rows = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)
            if getattr(inp, f.name) is None or isinstance(getattr(inp, f.name), Tensor)}
    if rows.get("step_scores") is not None and rows.get("step_mask") is None:
        rows["step_mask"] = torch.ones_like(rows["step_scores"], dtype=torch.bool)  # padded steps become 0
    rows["rank"] = torch.full((len(inp.scores),), dist.get_rank())
    every = gather_rows(rows)
    ranks = every.pop("rank")
    every["group_ids"] = every["group_ids"] + ranks * (int(every["group_ids"].max()) + 1)  # one rank's group
    adv, ret, metrics = algos.compute_advantages(name, dataclasses.replace(inp, **every), opts)
    start = int((ranks < dist.get_rank()).sum())
    mine, width = slice(start, start + len(inp.scores)), inp.response_mask.shape[1]
    return adv[mine, :width], ret[mine, :width], metrics


def global_batch_view(rollout) -> SimpleNamespace:
    """What rollout metrics read (scores, reward parts, masks, truncation), gathered from all ranks."""
    fields = {"scores": rollout.scores, "response_mask": rollout.response_mask, "truncated": rollout.truncated,
              **{f"part/{k}": v for k, v in rollout.reward_parts.items()}}
    every = gather_rows(fields)
    parts = {k.removeprefix("part/"): v for k, v in every.items() if k.startswith("part/")}
    return SimpleNamespace(scores=every["scores"], response_mask=every["response_mask"],
                           truncated=every["truncated"], reward_parts=parts)


def decorrelate_ranks(world: World, seed: int, step: int) -> None:
    """seeding=global under torchrun: each rank continues its own torch stream (seed, step, rank).

    Every rank starts from the same seed (the models must initialise identically); left
    so, all ranks would drive their different prompts with the same random numbers.
    """
    if world.distributed:
        torch.manual_seed(prompt_seed(seed, (step + 1) * 1_000_003 + world.rank))
