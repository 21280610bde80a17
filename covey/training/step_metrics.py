"""What a step reports about its samples and its memory, and the sample rows it logs.

Metric names are fixed and documented in docs/metrics.md.
"""

from __future__ import annotations

import torch

from covey.batch import Rollout
from covey.models.load import param_memory_mb
from covey.runtime.metrics import current_rss_mb, peak_rss_mb


def rollout_metrics(rollout: Rollout) -> dict:
    """Rewards (total and per function), response lengths and truncation over the step's samples.

    Lengths count the model's tokens (`response_mask`): in a multi-turn episode the environment's
    tokens between the model's turns are not counted (covey/batch.py)."""
    lengths = rollout.response_mask.sum(1)
    return {
        "reward/mean": float(rollout.scores.mean()),
        "reward/std": float(rollout.scores.std(unbiased=False)),
        **{f"reward/{k}": float(v.nanmean()) for k, v in rollout.reward_parts.items()  # None-free mean
           if not bool(v.isnan().all())},
        "response/len_mean": float(lengths.mean()),
        "response/len_max": float(lengths.max()),
        "response/truncated_frac": float(rollout.truncated.float().mean()),
    }


def memory_metrics(run) -> dict:
    """Resident memory of the process and the parameter / optimizer-state memory of each model."""
    out = {"memory/peak_rss_mb": peak_rss_mb(), "memory/rss_mb": current_rss_mb(),
           "memory/params_mb/actor": param_memory_mb(run.policy)}
    if run.reference is not None:
        out["memory/params_mb/reference"] = param_memory_mb(run.reference)
    if run.critic is not None:
        out["memory/params_mb/critic"] = param_memory_mb(run.critic)
    opt_bytes = sum(t.numel() * t.element_size() for opt in (run.optimizer, run.critic_optimizer) if opt
                    for state in opt.state.values() for t in state.values() if torch.is_tensor(t))
    out["memory/params_mb/optimizer"] = opt_bytes / 2**20
    return out


def sample_rows(rollout: Rollout, examples, limit: int = 8, tokenizer=None) -> list[dict]:
    """The first `limit` samples of the step as samples.jsonl rows: the dataset's prompt, and with `tokenizer`
    the prompt the model saw (`model_prompt`: its ids decoded, chat template, tools and demonstration included)."""
    rows = []
    for i in range(min(limit, len(rollout))):
        ex = examples[rollout.example_index[i]]
        seen = ({"model_prompt": tokenizer.decode(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist())}
                if tokenizer is not None else {})
        rows.append({"prompt": ex.prompt, **seen, "answer": ex.answer, "completion": rollout.completions[i],
                     "reward": float(rollout.scores[i]), "advantage": float(rollout.advantages[i][0]),
                     **({"messages": rollout.messages[i]} if rollout.messages is not None else {})})
    return rows
