"""Generation with vLLM on the training GPUs (optional extra: `pip install covey[vllm]`).

`rollout.engine=vllm`. vLLM is imported only when this engine is built (covey/rollout/factory.py starts
it); importing this module, and everything else in covey, works without it.

One vLLM instance per training process (tensor_parallel_size=1) on the same GPU,
"colocated" (under torchrun through vLLM's ``external_launcher`` executor, so it joins
the process group torchrun opened). Each step:

1. generate: wake the KV cache, ``LLM.generate`` on token ids with
   ``SamplingParams(n=G, logprobs=0, seed=...)``: G samples per prompt and the
   log-prob of each sampled token (``logprobs_mode="processed_logprobs"``: after
   temperature / top-k / top-p, i.e. of the distribution that really sampled, which
   truncated importance sampling needs); then sleep (level 1: the KV cache is dropped,
   the weights wait in CPU memory);
2. the trainer computes log-probs and updates (the GPU is the trainer's);
3. sync_weights: wake the weights and push the policy's, gathered from the FSDP
   shards one tensor at a time (every rank takes part), in buckets of
   ``rollout.vllm_sync_bucket_mb`` through the model's ``load_weights``; the whole
   push runs under ``rollout.vllm_sync_timeout_s`` and raises `WeightSyncTimeout`
   instead of hanging. With LoRA the adapters are saved to a folder and passed as a
   fresh ``LoRARequest`` (vLLM's LoRA support); the base weights never move.

Written against vLLM's documented API (``LLM(enable_sleep_mode=True)``, ``sleep(level)``,
``wake_up(tags=...)``, ``reset_prefix_cache``, ``LoRARequest``) and the in-process model
access that TRL's colocate mode uses
(``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``). It
could not be run where it was written (no GPU): see docs/scale.md for what is verified.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch

from covey.batch import Rollout
from covey.rollout.base import Engine, Prompt, cut_to_budgets, encode_prompts
from covey.rollout.hf import eos_ids
from covey.runtime.fsdp import full_state_dict

# vLLM serves LoRA adapters of these ranks (max_lora_rank must be one of them).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class WeightSyncTimeout(RuntimeError):
    """Pushing the policy's weights to vLLM took longer than rollout.vllm_sync_timeout_s."""


SampledRollout = Rollout
"""vLLM's batches: a Rollout with the sampler's log-probs of its tokens (`sample_logp`, for truncated IS)."""


# --------------------------------------------------------------------------- pure helpers (tested on CPU)


def outputs_to_rollout(outputs, enc: dict, group_size: int, tokenizer) -> SampledRollout:
    """vLLM RequestOutputs (one per prompt, `group_size` completions each) -> SampledRollout.

    Every token vLLM returned is a response token (it stops after EOS), so the mask is 1
    over each completion's length; a completion cut by max_tokens (finish_reason 'length')
    is flagged truncated. `enc` is the tokenizer's left-padded batch of the prompts.
    """
    pad = tokenizer.pad_token_id
    samples = [c for request in outputs for c in request.outputs]
    if len(samples) != len(outputs) * group_size:
        raise RuntimeError(f"vLLM returned {len(samples)} samples for {len(outputs)} prompts x {group_size}")
    width = max(1, max(len(c.token_ids) for c in samples))
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    logp = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        tokens = list(sample.token_ids)
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, :len(tokens)] = 1.0
        logp[row, :len(tokens)] = torch.tensor(sampled_logprobs(sample, tokens))
    index = torch.arange(len(outputs)).repeat_interleave(group_size)
    return SampledRollout(
        prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index], response_ids=ids,
        response_mask=mask, group_ids=index.clone(),
        truncated=torch.tensor([s.finish_reason == "length" for s in samples]),
        completions=tokenizer.batch_decode(ids, skip_special_tokens=True), example_index=index.tolist(),
        sample_logp=logp)


def sampled_logprobs(sample, tokens: list[int]) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts."""
    if sample.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams(logprobs=0) is required)")
    return [float(position[token].logprob) for position, token in zip(sample.logprobs, tokens)]


def weight_buckets(named_tensors, bucket_bytes: int):
    """Group (name, tensor) pairs into lists of about `bucket_bytes` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def run_with_timeout(fn, timeout_s: float, what: str):
    """fn() in a daemon thread; its result, its exception, or WeightSyncTimeout after `timeout_s`.

    A stuck push (a lost rank, a wedged copy) then fails the run with a message instead
    of hanging it; the daemon thread does not keep the process alive.
    """
    box: dict = {}
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def target():
        try:
            if device is not None:  # the current CUDA device is per thread
                torch.cuda.set_device(device)
            box["result"] = fn()
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    worker = threading.Thread(target=target, name=f"covey-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise WeightSyncTimeout(f"{what} did not finish within {timeout_s:.0f} s (rollout.vllm_sync_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def full_named_tensors(policy):
    """(name, whole tensor) per parameter of the policy, in module order (buffers do not train).

    Under FSDP2 `full_tensor()` all-gathers one parameter at a time (every rank must
    iterate); tied weights appear once (named_parameters deduplicates them).
    """
    for name, tensor in policy.named_parameters():
        yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def lora_rank_for_vllm(rank: int) -> int:
    """The smallest rank vLLM serves that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got model.lora_rank={rank}")


# --------------------------------------------------------------------------- the engine


class VLLMEngine(Engine):
    """Samples with a colocated vLLM instance; weights pushed from the trained policy after each update;
    per-request seeds (rollout.seeding=per_prompt) in one batched call."""

    def __init__(self, llm, policy, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, sleep: bool, bucket_mb: int, timeout_s: float, lora: bool):
        self.llm, self.policy, self.tokenizer = llm, policy, tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.sleep_mode, self.bucket_bytes, self.timeout_s, self.lora = sleep, bucket_mb * 2**20, timeout_s, lora
        self.eos = eos_ids(policy, tokenizer)
        self.weights_asleep = False   # vLLM's weights sit in CPU memory (sleep level 1)
        self.stale = False            # the policy changed since the last push
        self.lora_request, self.lora_version = None, 0
        self.lora_dir = tempfile.TemporaryDirectory(prefix="covey-lora-") if lora else None
        self._sleep()

    # ----------------------------------------------------------------- memory

    def _sleep(self) -> None:
        """Hand the GPU to the trainer: level 1 drops the KV cache and moves the weights to CPU memory.

        Not level 2 (weights discarded): they would have to be pushed again at every wake,
        and a push gathers FSDP shards, a collective that generation calls (whose number
        differs between ranks during evaluation) must not contain.
        """
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self.weights_asleep = True

    def _ensure_weights(self) -> None:
        """vLLM's weights awake and equal to the policy's (a push happens only after sync_weights)."""
        if self.weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        if self.stale:
            run_with_timeout(self._push, self.timeout_s, "weight sync to vLLM")
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.stale = False

    def sync_weights(self, model) -> None:
        """After an optimizer step: push the new weights now (every rank, FSDP gathers inside)."""
        self.policy, self.stale = model, True
        self._ensure_weights()

    def _push(self) -> None:
        if self.lora:
            self._push_adapters()
            return
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for bucket in weight_buckets(full_named_tensors(self.policy), self.bucket_bytes):
            model.load_weights(bucket)

    def _push_adapters(self) -> None:
        """LoRA: vLLM keeps its base; the adapters go through a folder and a new LoRARequest id."""
        from vllm.lora.request import LoRARequest

        state = full_state_dict(self.policy, on_every_rank=True)  # each rank feeds its own vLLM
        self.lora_version += 1
        folder = Path(self.lora_dir.name) / f"v{self.lora_version}"
        self.policy.save_pretrained(folder, state_dict=state)  # PEFT keeps the adapter tensors only
        shutil.rmtree(folder.parent / f"v{self.lora_version - 1}", ignore_errors=True)  # vLLM loaded it already
        self.lora_request = LoRARequest(f"covey-policy-{self.lora_version}", self.lora_version, str(folder))

    # ----------------------------------------------------------------- generation

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> SampledRollout:
        """`budgets`: vLLM samples every row to the longest budget, then each row is cut at its own."""
        from vllm import SamplingParams

        enc = encode_prompts(self.tokenizer, prompts)
        token_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                     for p in prompts]
        max_tokens = max_new_tokens or self.max_new_tokens
        max_tokens = min(max(budgets, default=1), max_tokens) if budgets is not None else max_tokens
        base = dict(n=group_size, max_tokens=max_tokens, logprobs=0,
                    stop_token_ids=self.eos, temperature=0.0 if greedy else self.temperature,
                    top_p=1.0 if greedy else self.top_p, top_k=-1 if greedy or self.top_k <= 0 else self.top_k)
        params = [SamplingParams(**base, seed=seed) for seed in (seeds or [None] * len(prompts))]
        self._ensure_weights()
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], sampling_params=params,
                                    use_tqdm=False, lora_request=self.lora_request)
        self._sleep()
        return cut_to_budgets(outputs_to_rollout(outputs, enc, group_size, self.tokenizer), budgets, self.tokenizer)
