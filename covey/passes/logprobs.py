"""Forward passes over a Rollout: chosen-token log-probs, entropy, critic values.

Position ids are derived from the attention mask so a left-padded prompt sees
the same positions as during generation. Only the last L+1 positions are
projected to the vocabulary (`logits_to_keep`): prompt logits are never built.
Each micro-batch is trimmed to its own longest prompt and response first.

Every pass attends over `Rollout.response_attended`: in a multi-turn episode the
environment's tokens between the model's turns are attended and counted in the
positions, and log-probs, entropy and values come out at every response position;
the losses keep the model's tokens (`response_mask`). The no-grad passes
(`batched_logprobs`, `batched_values`) return 0 outside `response_mask`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from covey import algos
from covey.algos.logits import DEFAULT_CHUNK
from covey.batch import Rollout
from covey.models.attention import attention_implementation, fastest_attention, half_precision
from covey.models.critic import response_values
from covey.models.families import Family, family_of
from covey.models.hf_compat import position_ids, with_cache
from covey.models.kernels import FusedHead, fused_head
from covey.models.load import checkpoints_activations
from covey.passes.packing import layer_masks, pack, row_capacity, unpack
from covey.passes.prompt_cache import EncodedPrompts, PromptView, run_prompts
from covey.runtime import dist
from covey.runtime.precision import autocast_context, model_device, resolve_autocast

BF16_WIDTH_MULTIPLE = 16  # packed widths under bf16 autocast: few distinct shapes (covey/passes/packing.py)
GPU_BLOCK_BYTES = 64 * 2**20  # float32 bytes of one block of logits on a GPU (covey/algos/logits.py)


def logit_chunk(logits: Tensor) -> int:
    """Positions per block of the log-softmax over the vocabulary: algos' default on a CPU (a block
    stays in cache), 64 MiB of float32 on a GPU, where a block of 32 positions is too small to
    keep it busy (10 kernels per block: 5000 launches for a 16k-token pass at 32)."""
    if logits.device.type != "cuda":
        return DEFAULT_CHUNK
    return max(DEFAULT_CHUNK, GPU_BLOCK_BYTES // (4 * logits.shape[-1]))


def first_prompt_column(prompt_mask: Tensor) -> int:
    """The first column of left-padded prompts that is not padding in every row."""
    keep = prompt_mask.bool().any(dim=0)
    return int(keep.int().argmax()) if keep.any() else prompt_mask.shape[1]


def trim(part: Rollout) -> tuple[Tensor, Tensor, int]:
    """(input_ids, attention_mask, L') with all-padding prompt/response columns removed.

    The mask is over the attended tokens (`Rollout.response_attended`: an episode's environment
    tokens too); L' ends at the last attended column of any row (at least 1).
    """
    first = first_prompt_column(part.prompt_mask)
    attended = part.response_attended
    columns = attended.bool().any(dim=0).nonzero()
    resp_len = int(columns.max()) + 1 if len(columns) else 1
    ids = torch.cat([part.prompt_ids[:, first:], part.response_ids[:, :resp_len]], dim=1)
    mask = torch.cat([part.prompt_mask[:, first:], attended[:, :resp_len].to(part.prompt_mask.dtype)], dim=1)
    return ids, mask, resp_len


def prefixes(mask: Tensor) -> bool:
    """Every row of an (n, L) mask is 1 up to some column and 0 after it: no hole for the packed pass,
    which feeds a response's first `sum` tokens at consecutive positions."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def on_device(part: Rollout, device: torch.device) -> Rollout:
    """The micro-batch's tensors on the training device; the Rollout itself when that is the CPU."""
    if torch.device(device).type == "cpu":
        return part
    moved = {f.name: getattr(part, f.name).to(device) for f in dataclasses.fields(part)
             if isinstance(getattr(part, f.name), Tensor)}
    return dataclasses.replace(part, **moved)


def policy_logprobs(model, part: Rollout, temperature: float, *, with_entropy: bool = False,
                    precision: str = "none", prompts: tuple[EncodedPrompts, Tensor] | None = None,
                    ) -> tuple[Tensor, Tensor | None, int]:
    """Log-probs (n, L') of the sampled response tokens, optional entropy (n, L'), and L'.

    `prompts`: (the encoded prompts of the whole step, the index of each row's prompt among
    them), from `encode_prompts`; the packed pass then reads their cache instead of encoding them.
    """
    ids, mask, resp_len = trim(part)
    device = model_device(model)
    ids, mask = ids.to(device), mask.to(device)
    # Under FSDP every rank must run the same number of forward passes (each all-gathers).
    if dist.on_all_ranks(packs(model) and resp_len > 1 and prefixes(mask[:, -resp_len:])):
        width = ids.shape[1] - resp_len
        view = prompts[0].view(prompts[1].to(device), width) if prompts is not None else None
        shared = shared_prompts(ids[:, :width], mask[:, :width]) if view is None else None
        return packed_logprobs(model, ids, mask, resp_len, shared, PassSettings(temperature, with_entropy, precision),
                               view)
    head, targets = fused_head(model), ids[:, -resp_len:]
    # a recurrent layer's state runs through left padding (transformers' chunked Gated DeltaNet is not exact
    # there): such models read each row from its first real token, padding after the response instead
    shift = leading_padding(mask) if family_of(model.config).recurrent else None
    if shift is not None:
        ids, mask = align_left(ids, shift), align_left(mask, shift)
    keep = kept_positions(resp_len, ids.shape[1], shift, ids.device)
    with autocast_context(precision, ids.device):
        if head is not None:  # hidden states, then log-probs a block at a time: no (n, L', V) logits
            hidden = head.decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                  use_cache=False).last_hidden_state[:, keep]
            logp, entropy = head_logprobs(head, rows_of(hidden, resp_len, shift), targets, temperature, with_entropy)
            return logp, entropy, resp_len
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=keep,
                    use_cache=False)
    # bf16 logits are read block by block in float32 (covey/algos/logits.py): no full float copy
    logits = rows_of(out.logits, resp_len, shift)
    logp, entropy = algos.logprobs_and_entropy(logits, targets, temperature, logit_chunk(logits),
                                               with_entropy=with_entropy)
    return logp, entropy, resp_len


def leading_padding(mask: Tensor) -> Tensor:
    """(n,) the padding columns before each row's first attended token."""
    return mask.long().cumsum(1).eq(0).sum(1)


def align_left(t: Tensor, shift: Tensor) -> Tensor:
    """Each row of (n, W) moved `shift` columns to the left, the freed columns at the end zero."""
    width = t.shape[1]
    source = torch.arange(width, device=t.device)[None, :] + shift[:, None]
    moved = t.gather(1, source.clamp(max=width - 1))
    return torch.where(source < width, moved, torch.zeros_like(moved))


def kept_positions(resp_len: int, width: int, shift: Tensor | None, device) -> Tensor:
    """The positions whose outputs score the last `resp_len` tokens of every row (each row's shifted by its
    `shift` when rows are aligned left): one contiguous range, as `logits_to_keep` indices."""
    first = width - resp_len - 1 - (int(shift.max()) if shift is not None else 0)
    last = width - 1 - (int(shift.min()) if shift is not None else 0)  # exclusive
    return torch.arange(first, last, device=device)


def rows_of(kept: Tensor, resp_len: int, shift: Tensor | None) -> Tensor:
    """(n, L', ...) each row's own `resp_len` outputs out of the kept range of `kept_positions`."""
    if shift is None:
        return kept[:, :resp_len]
    offset = (shift.max() - shift)[:, None] + torch.arange(resp_len, device=shift.device)[None, :]
    index = offset.view(*offset.shape, *([1] * (kept.dim() - 2))).expand(-1, -1, *kept.shape[2:])
    return kept.gather(1, index)


def head_logprobs(head: FusedHead, hidden: Tensor, tokens: Tensor, temperature: float, with_entropy: bool):
    """Log-probs (and entropy) of `tokens` from the hidden states before them and the output layer, in
    blocks of as many positions as `logit_chunk` gives a logits tensor of the vocabulary's width."""
    chunk = logit_chunk(torch.empty(0, head.weight.shape[0], device=hidden.device))
    return algos.linear_logprobs_and_entropy(hidden, head.weight, head.bias, tokens, temperature, chunk,
                                             with_entropy=with_entropy)


def shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first row of each distinct prompt (U,), prompt of each row (n,))."""
    rows, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True)
    first = torch.full((len(rows),), len(inverse), dtype=torch.long, device=inverse.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
    return first, inverse


def packs(model) -> bool:
    """The packed pass needs an attention that takes a 4-D mask (SDPA or eager, not flash-attention),
    a prompt KV cache that survives under grad (gradient checkpointing drops it), and layers that a
    mask keeps apart (not a recurrent state: covey/models/families.py); else the padded pass runs."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
            and not checkpoints_activations(model) and family_of(config).packs)


def training_pass(family: Family) -> str:
    """The start-up phrase for the training passes a model of `family` takes (when its attention kernel
    takes a 4-D mask and no gradient checkpointing drops the prompt cache)."""
    if not family.packs:
        return "padded (a recurrent layer state would run from one packed response into the next)"
    if family.sliding:
        return f"packed, one mask per layer kind (window {family.window} in sliding layers)"
    return "packed"


def pass_settings(model, precision: str, device) -> tuple[str, bool, str]:
    """(resolved autocast precision, whether the pass computes in bf16/fp16, attention implementation)."""
    precision = resolve_autocast(precision, device)
    low = precision == "bfloat16" or half_precision(model)
    return precision, low, fastest_attention(model, low, device)


@dataclasses.dataclass(frozen=True)
class PassSettings:
    """How a log-prob pass scores: the sampling temperature, whether it also takes each token's entropy, and
    its autocast precision."""
    temperature: float
    with_entropy: bool
    precision: str


def packed_logprobs(model, ids: Tensor, mask: Tensor, resp_len: int, shared: tuple[Tensor, Tensor] | None,
                    settings: PassSettings, view: PromptView | None = None):
    """`policy_logprobs` with each distinct prompt encoded once and the responses packed without padding.

    Pass 1 runs the U distinct prompts (`shared`: the first row of each, the prompt of each row)
    and keeps their KV cache, unless `view` brings it from a pass over the whole step's prompts
    (covey/passes/prompt_cache.py); the cache is indexed out to the packed rows (gradients flow back
    through the indexing into the prompt pass) and pass 2 runs the packed responses on top of
    it (covey/passes/packing.py). Equal to the padded pass up to float rounding
    (tests/passes/test_logprobs.py); 0 after a response's end.
    """
    width, n = ids.shape[1] - resp_len, ids.shape[0]
    responses = ids[:, width:]
    temperature, with_entropy = settings.temperature, settings.with_entropy
    precision, low, implementation = pass_settings(model, settings.precision, ids.device)
    inverse = view.inverse if view is not None else shared[1]
    prompt_mask = view.prompt_mask if view is not None else mask[shared[0], :width]
    packing = pack(responses, mask[:, width:].sum(1), mask[:, :width].sum(1), inverse, prompt_mask,
                   width_multiple=BF16_WIDTH_MULTIPLE if low else 1,
                   min_capacity=row_capacity(implementation))
    attention = layer_masks(packing, prompt_mask, family_of(model.config))
    if implementation == "eager":  # eager adds the mask to the scores
        attention = {kind: additive(mask) for kind, mask in attention.items()} if isinstance(attention, dict) \
            else additive(attention)
    with autocast_context(precision, ids.device), attention_implementation(model, implementation):
        if view is None:
            cache, last = run_prompts(model, ids[shared[0], :width], prompt_mask)
        else:
            cache, last = view.cache, view.head
        cache.batch_select_indices(packing.prompt_of_bin)  # resp_len > 1: at least one token is fed to pass 2
        fused = fused_head(model)
        inputs = dict(input_ids=packing.input_ids, attention_mask=attention, position_ids=packing.position_ids,
                      **with_cache(cache), use_cache=True)
        if fused is not None:  # the packed rows' hidden states: their logits are made a block at a time
            rest_logp, rest_entropy = head_logprobs(fused, fused.decoder(**inputs).last_hidden_state,
                                                    packing.targets, temperature, with_entropy)
        else:
            rest = model(**inputs).logits
    if fused is None:
        rest_logp, rest_entropy = algos.logprobs_and_entropy(rest, packing.targets, temperature, logit_chunk(rest),
                                                             with_entropy=with_entropy)
    head = last[inverse]  # (n, 1, V): scores response token 0
    head_logp, head_entropy = algos.logprobs_and_entropy(head, responses[:, :1], temperature, logit_chunk(head),
                                                         with_entropy=with_entropy)
    logp = torch.cat([head_logp, unpack(rest_logp, packing, n, resp_len - 1)], dim=1)
    entropy = None
    if with_entropy:
        entropy = torch.cat([head_entropy, unpack(rest_entropy, packing, n, resp_len - 1)], dim=1)
    return logp, entropy, resp_len


def additive(mask: Tensor) -> Tensor:
    """A boolean attention mask as eager attention takes it: 0 where a query may attend, -inf elsewhere."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))


def critic_values(critic, part: Rollout, precision: str = "none") -> tuple[Tensor, int]:
    """Critic values aligned with response tokens: V for token t is read at the position before it."""
    ids, mask, resp_len = trim(part)
    device = model_device(critic)
    ids, mask = ids.to(device), mask.to(device)
    with autocast_context(precision, ids.device):
        values = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    return response_values(values, ids.shape[1] - resp_len, resp_len).float(), resp_len


def pad_to(t: Tensor, width: int) -> Tensor:
    """Right-pad (n, L') with zeros to (n, width)."""
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def encode_prompts(model, rollout: Rollout, rows: Tensor, precision: str = "none"
                   ) -> tuple[EncodedPrompts, Tensor] | None:
    """The distinct prompts of `rows` of the rollout in one pass, and the index of each rollout
    row's prompt among them (-1 outside `rows`); None where the packed pass is not used: the
    prompts are then encoded with each micro-batch (and under FSDP, where the deferred backward
    of `EncodedPrompts` would add a second gradient reduction per step)."""
    if not packs(model) or dist.world_size() > 1 or len(rows) == 0:
        return None
    device = model_device(model)
    ids, mask = rollout.prompt_ids[rows], rollout.prompt_mask[rows]
    first_column = first_prompt_column(mask)  # as `trim` cuts each micro-batch: views take its last columns
    ids, mask = ids[:, first_column:].to(device), mask[:, first_column:].to(device)
    first, inverse = shared_prompts(ids, mask)
    precision, _, implementation = pass_settings(model, precision, device)
    encoded = EncodedPrompts(model, ids[first], mask[first], autocast_context(precision, device),
                             attention_implementation(model, implementation))
    of_row = torch.full((len(rollout),), -1, dtype=torch.long)
    of_row[rows] = inverse.cpu()
    return encoded, of_row


def batched_logprobs(model, rollout: Rollout, temperature: float, micro_batch_size: int,
                     precision: str = "none") -> Tensor:
    """No-grad log-probs for the whole rollout (old policy or reference), (N, L), 0 outside
    `response_mask`; its prompts encoded once."""
    return batched_logprobs_and_entropy(model, rollout, temperature, micro_batch_size, precision)[0]


@torch.no_grad()  # not inference_mode: FSDP2 would allocate its gather buffers as inference tensors
def batched_logprobs_and_entropy(model, rollout: Rollout, temperature: float, micro_batch_size: int,
                                 precision: str = "none", with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """`batched_logprobs`, and with `with_entropy` each token's entropy (N, L) (0 outside `response_mask`)."""
    width = rollout.response_ids.shape[1]
    rows = torch.arange(len(rollout))
    encoded = encode_prompts(model, rollout, rows, precision)
    chunks, entropies = [], []
    for index in rows.split(micro_batch_size):
        prompts = (encoded[0], encoded[1][index]) if encoded is not None else None
        logp, entropy, _ = policy_logprobs(model, rollout.select(index), temperature, with_entropy=with_entropy,
                                           precision=precision, prompts=prompts)
        chunks.append(pad_to(logp.cpu(), width))  # the Rollout lives on the CPU
        if with_entropy:
            entropies.append(pad_to(entropy.float().cpu(), width))
    mask = rollout.response_mask
    return torch.cat(chunks) * mask, (torch.cat(entropies) * mask if with_entropy else None)


@torch.no_grad()
def batched_values(critic, rollout: Rollout, micro_batch_size: int, precision: str = "none") -> Tensor:
    """No-grad critic values for the whole rollout, (N, L), 0 outside `response_mask`."""
    width = rollout.response_ids.shape[1]
    chunks = []
    for index in torch.arange(len(rollout)).split(micro_batch_size):
        values, _ = critic_values(critic, rollout.select(index), precision)
        chunks.append(pad_to(values.cpu(), width))
    return torch.cat(chunks) * rollout.response_mask
