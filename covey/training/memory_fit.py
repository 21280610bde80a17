"""A run's GPU memory budget (train.gpu_memory_gib) on one GPU: the fit check before the first step, and
the batch sizes fitted to the budget.

`check_loaded_policy`: as soon as the policy is loaded (before the reference, the critic and the optimizer
state are made, and before anything of an fp32 policy is on the GPU) the least the run needs
(covey/runtime/budget.py) is checked against the budget, with the response tokens as its shortest sequence;
a run that cannot fit stops there with one line. `fit_batches`: once the prompts are known, the same check
with the longest prompt, then the prompts per generate call (the sampler's KV cache, at most
GENERATE_SHARE of what the static memory leaves: the fast engine keeps its cache between steps) and the
sequences per no-grad log-prob pass (the rest). The update's micro-batches are fitted before the first
update from the memory then in use (`size_update`). On a CPU and under torchrun (FSDP shards; every rank
keeps the configured sizes) nothing here applies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from covey.rollout.factory import sampling_precision
from covey.runtime import budget
from covey.runtime.memory import budget_left, gpu_allowed_bytes, gpu_budget, on_gpu, prompts_that_fit, rows_that_fit
from covey.runtime.precision import resolve_autocast
from covey.training.plan import Plan

GENERATE_SHARE = 0.25
"""The most of what the static memory leaves that the sampler's KV cache may take."""
LORA_HINT_RANK = 16
"""The adapter rank the fit check's advice prices (model.lora_rank=16)."""


@dataclass(frozen=True)
class GpuFit:
    """What the update's sizing reads before the first update: the budget and its bytes per position."""
    budget: int
    update_per_position: int


def one_gpu(device: str, world_size: int) -> bool:
    return on_gpu(device) and world_size == 1


def unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, a tied weight once."""
    seen, out = set(), []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bf16_held_bytes(model: nn.Module) -> int:
    """Bytes of `model` with its Linear weights in bf16 (a frozen reference under bf16 autocast,
    covey/models/offload.py); a Linear weight tied to an embedding keeps its dtype."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(t) for m in model.modules() if isinstance(m, nn.Linear) for t in (m.weight, m.bias)
              if t is not None and id(t) not in embedded}
    return sum(t.numel() * (2 if id(t) in linear and t.is_floating_point() else t.element_size())
               for t in unique_tensors(model))


def hidden_bytes(policy: nn.Module) -> int:
    """Bytes of one element of the residual stream: the input embedding's dtype."""
    return policy.get_input_embeddings().weight.element_size()


def sequence_bytes(policy: nn.Module, plan: Plan, device: str, positions: int) -> tuple[int, int]:
    """(bytes per position of the update, of the sampler's row at `positions`): the update's with
    gradient checkpointing where it is on; the sampler's keys and values in its precision."""
    element = 2 if resolve_autocast(plan.model.autocast, torch.device(device)) == "bfloat16" else 4
    hidden = hidden_bytes(policy)
    update = (budget.checkpointed_bytes_per_position(policy.config, element, hidden)
              if plan.model.gradient_checkpointing else budget.update_bytes_per_position(policy.config, element))
    sampler = 2 if samples_in_bf16(plan, device) else hidden
    return update, budget.sampler_bytes_per_row(policy.config, positions, sampler)


def samples_in_bf16(plan: Plan, device: str) -> bool:
    """The local engine samples in bf16 (a 4-bit policy samples through itself)."""
    return (plan.engine.engine != "vllm" and not plan.model.load_in_4bit
            and sampling_precision(plan.engine, 1, device) == "bfloat16")


def run_shape(policy: nn.Module, plan: Plan, device: str, positions: int) -> budget.RunShape:
    """The least the run holds on the GPU, read off the loaded `policy` (before its reference and critic
    exist) and the plan, for sequences of `positions` tokens. The critic is priced as a copy of the base
    model, all of it trained."""
    m, engine = plan.model, plan.engine
    tensors = unique_tensors(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    weights, count = nbytes(tensors), sum(t.numel() for t in tensors)
    base = (weights - nbytes(trained), count - sum(p.numel() for p in trained)) if m.lora_rank else (weights, count)
    critic = base if plan.needs_critic else (0, 0)
    reference = 0
    if plan.needs_reference and not m.lora_rank:
        held_in_bf16 = (resolve_autocast(m.autocast, torch.device(device)) == "bfloat16"
                        and not plan.reference.moves)
        reference = bf16_held_bytes(policy) if held_in_bf16 else weights
    copies = samples_in_bf16(plan, device) and hidden_bytes(policy) != 2
    update, row = sequence_bytes(policy, plan, device, positions)
    no_grad = budget.no_grad_bytes_per_position(policy.config)
    return budget.RunShape(
        weights=weights + critic[0], trained=sum(p.numel() for p in trained) + critic[1],
        trained_bytes=nbytes(trained) + critic[0], reference=reference,
        sampling_copy=2 * sum(t.numel() for t in tensors if t.is_floating_point()) if copies else 0,
        engine=int(engine.vllm_gpu_memory_utilization * gpu_allowed_bytes(device)) if engine.engine == "vllm" else 0,
        optimizer=plan.optimizer.name, offload=plan.optimizer.offload, activations=max(update, no_grad) * positions,
        kv_cache=budget.row_bucket(plan.sampling.group_size) * row if engine.engine != "vllm" else 0)


def alternatives(shape: budget.RunShape, policy: nn.Module, plan: Plan, device: str, prompt: int,
                 response: int) -> dict[str, budget.RunShape]:
    """The settings the fit check prices when the run does not fit: LoRA, an 8-bit optimizer, gradient
    checkpointing, half the response tokens."""
    out, m = {}, plan.model
    if not m.lora_rank:
        trained = [p for p in policy.parameters() if p.requires_grad]
        critic = (shape.trained - sum(p.numel() for p in trained), shape.trained_bytes - nbytes(trained))
        out[f"model.lora_rank={LORA_HINT_RANK}"] = budget.with_lora(
            shape, budget.lora_parameters(policy.config, LORA_HINT_RANK), hidden_bytes(policy), *critic)
    if shape.optimizer not in budget.OPTIMIZER_BYTES and not shape.offload:
        out["optim.name=adamw_8bit"] = dataclasses.replace(shape, optimizer="adamw_8bit")
    if not m.gradient_checkpointing:
        ckpt = dataclasses.replace(plan, model=dataclasses.replace(m, gradient_checkpointing=True))
        update, _ = sequence_bytes(policy, ckpt, device, prompt + response)
        activations = max(update, budget.no_grad_bytes_per_position(policy.config)) * (prompt + response)
        out["model.gradient_checkpointing=true"] = dataclasses.replace(shape, activations=activations)
    if response > 1:
        shorter = run_shape(policy, plan, device, prompt + response // 2)
        out[f"rollout.max_new_tokens={response // 2}"] = shorter
    return out


def response_tokens(plan: Plan) -> int:
    """The longest response: one answer, or a whole episode with its tools' tokens."""
    return plan.episodes.max_episode_tokens if plan.episodes is not None else plan.sampling.max_new_tokens


def check_fit(policy: nn.Module, plan: Plan, device: str, prompt: int) -> tuple[int, budget.RunShape]:
    """(the budget in bytes, the run's shape); DoesNotFit (one line) when the least the run needs, with
    prompts of `prompt` tokens, does not fit train.gpu_memory_gib."""
    allowed = gpu_budget(plan.gpu_memory_gib, device)
    response = response_tokens(plan)
    shape = run_shape(policy, plan, device, prompt + response)
    if budget.least_bytes(shape) > allowed:  # the alternatives are priced only for the line that refuses
        budget.check_fit(shape, allowed, alternatives(shape, policy, plan, device, prompt, response))
    return allowed, shape


def check_loaded_policy(policy: nn.Module, plan: Plan, device: str, world_size: int) -> None:
    """The fit check as soon as the policy is loaded, its prompts counted as one token (a lower bound)."""
    if one_gpu(device, world_size):
        check_fit(policy, plan, device, 1)


def fit_batches(run, longest_prompt: int) -> None:
    """On one GPU, before the first step: the fit check with the longest prompt, then the prompts per
    generate call and the sequences per no-grad log-prob pass fitted to what the static memory leaves of
    the budget, printed; `run.gpu_fit` keeps what the update's sizing reads."""
    if not one_gpu(run.world.device, run.world.size):
        return
    plan, device, sizes = run.plan, run.world.device, run.micro_batches
    allowed, shape = check_fit(run.policy, plan, device, longest_prompt)
    positions = longest_prompt + response_tokens(plan)
    static = sum(budget.static_parts(shape).values())
    left = min(allowed - static, budget_left(allowed, trained_pairs(run), device))
    update, row = sequence_bytes(run.policy, plan, device, positions)
    s, kv = plan.sampling, 0
    if plan.engine.engine != "vllm":
        sizes.sizes["generate"] = prompts_that_fit(row, s.group_size, GENERATE_SHARE * left, s.prompts_per_step)
        kv = budget.row_bucket(sizes.sizes["generate"] * s.group_size) * row
    no_grad = budget.no_grad_bytes_per_position(run.policy.config) * positions
    sizes.sizes["logprobs"] = rows_that_fit(no_grad, left - kv, 1, s.prompts_per_step * s.group_size)
    run.gpu_fit = GpuFit(allowed, update)
    parts = ", ".join(f"{name} {budget.gib(size)}" for name, size in budget.static_parts(shape).items())
    print(f"covey: GPU memory budget {budget.gib(allowed)} GiB (train.gpu_memory_gib="
          f"{plan.gpu_memory_gib:g}): {budget.gib(static)} GiB held ({parts}); {sizes.sizes['generate']} prompts per "
          f"generate call ({budget.gib(kv)} GiB of KV cache), log-prob passes of {sizes.sizes['logprobs']} sequences; "
          "the update's micro-batches are fitted at the first update")


def trained_pairs(run) -> list:
    """(model, optimizer) of the policy and of the critic where there is one."""
    return [(m, o) for m, o in ((run.policy, run.optimizer), (run.critic, run.critic_optimizer)) if m is not None]
