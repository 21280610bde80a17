"""Held-out accuracy: greedy (and optionally pass@k with sampling)."""

from __future__ import annotations

import torch

from covey.rewards.rules import extract_answer, math_equal
from covey.tasks.base import Example


def correct_flags(completions: list[str], answers: list[str]) -> list[bool]:
    return [bool(math_equal(extract_answer(c), a)) for c, a in zip(completions, answers)]


@torch.inference_mode()
def evaluate(engine, prompts: list[str], examples: list[Example], *, batch_size: int,
             max_new_tokens: int, pass_k: int = 0) -> dict:
    """{'eval/accuracy': greedy accuracy, 'eval/pass@k': ...} on the held-out set."""
    answers = [ex.answer for ex in examples]
    hits: list[bool] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        out = engine.generate(batch, 1, greedy=True, max_new_tokens=max_new_tokens)
        hits += correct_flags(out.completions, answers[start:start + batch_size])
    result = {"eval/accuracy": sum(hits) / max(len(hits), 1), "eval/n": len(hits)}
    if pass_k > 0:
        solved = []
        per_call = max(batch_size // pass_k, 1)
        for start in range(0, len(prompts), per_call):
            out = engine.generate(prompts[start:start + per_call], pass_k, max_new_tokens=max_new_tokens)
            flags = correct_flags(out.completions, [answers[start + i] for i in out.example_index])
            for j in range(len(out.example_index) // pass_k):
                solved.append(any(flags[j * pass_k:(j + 1) * pass_k]))
        result[f"eval/pass@{pass_k}"] = sum(solved) / max(len(solved), 1)
    return result
