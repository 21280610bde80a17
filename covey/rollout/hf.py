"""Generation with Hugging Face `generate`: the default engine, CPU or GPU.

The engine shares the policy module, so no weight sync is needed: a sample
is always drawn from the current parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch

from covey.batch import Rollout, concat_rollouts
from covey.models.attention import sampling_attention
from covey.rollout.base import Engine, Prompt, cut_to_budgets, encode_prompts


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a response (tokenizer EOS and the generation config's)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def response_mask_from_ids(response_ids: torch.Tensor, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS; rows without EOS are truncated.

    Returns (mask (N, L) float, truncated (N,) bool).
    """
    n, length = response_ids.shape
    is_eos = torch.isin(response_ids, torch.tensor(eos, dtype=response_ids.dtype))
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), length - 1))
    positions = torch.arange(length).unsqueeze(0)
    mask = (positions <= first.unsqueeze(1)).float()
    return mask, ~has_eos


def sampled_logprobs(step_logits, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N, L) log-prob of each generated token under the model's raw logits / temperature (the trainer's
    quantity; `generate`'s own scores are after top-k / top-p), at the precision the logits came in."""
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    for t, logits in enumerate(step_logits[:tokens.shape[1]]):
        logp = torch.log_softmax(logits.float().cpu() / temperature, -1)
        out[:, t] = logp.gather(1, tokens[:, t:t + 1]).squeeze(1)
    return out


class HFEngine(Engine):
    """Samples G completions per prompt with `model.generate` (left padding)."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.eos = eos_ids(model, tokenizer)

    def sync_weights(self, model) -> None:
        self.model = model

    def decode_path(self) -> str:
        return "hf engine (transformers' generate)"

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """`seeds`: `generate` draws from torch's global generator, so each seeded group is one call inside a
        forked generator seeded with its seed (the run's own stream is left untouched). `budgets`: `generate`
        samples every row to the longest budget, then each row is cut at its own (`cut_to_budgets`)."""
        if budgets is not None:
            max_new_tokens = min(max(budgets, default=1), max_new_tokens or self.max_new_tokens)
        if seeds is None:
            return cut_to_budgets(self.sample(prompts, group_size, greedy, max_new_tokens), budgets, self.tokenizer)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        parts = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                parts.append(self.sample([prompt], group_size, greedy, max_new_tokens))
        rollout = concat_rollouts(parts, self.tokenizer.pad_token_id)
        rollout.example_index = rollout.group_ids.tolist()  # the prompt's position in `prompts`
        return cut_to_budgets(rollout, budgets, self.tokenizer)

    @torch.inference_mode()
    def sample(self, prompts: list[Prompt], group_size: int, greedy: bool, max_new_tokens: int | None) -> Rollout:
        tok = self.tokenizer
        enc = encode_prompts(tok, prompts)
        sampling = {} if greedy else {
            "do_sample": True, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k or None,
        }
        was_training = self.model.training
        self.model.eval()
        with sampling_attention(self.model):
            device = next(self.model.parameters()).device
            out = self.model.generate(
                input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                max_new_tokens=max_new_tokens or self.max_new_tokens,
                num_return_sequences=group_size, do_sample=not greedy,
                pad_token_id=tok.pad_token_id, eos_token_id=self.eos, output_logits=True,
                return_dict_in_generate=True, **{k: v for k, v in sampling.items() if k != "do_sample"},
            )
        self.model.train(was_training)
        prompt_len = enc["input_ids"].shape[1]
        response_ids = out.sequences[:, prompt_len:].cpu()
        mask, truncated = response_mask_from_ids(response_ids, self.eos)
        logps = sampled_logprobs(out.logits, response_ids, self.temperature) * mask
        response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, tok.pad_token_id))
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        texts = tok.batch_decode(response_ids, skip_special_tokens=True)
        return Rollout(
            prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index],
            response_ids=response_ids, response_mask=mask, group_ids=index.clone(),
            truncated=truncated, completions=texts, example_index=index.tolist(), sample_logp=logps,
        )
