"""Test helpers shared across the test packages: tiny-model run settings, a deterministic varied
reward, and a hand-made grouped Rollout."""

import torch

from covey.batch import Rollout


def tiny_overrides(model_dir: str, out_dir, **extra) -> list[str]:
    """key=value overrides for a fast CLI run on the tiny model."""
    base = {
        "model.path": model_dir, "train.output_dir": str(out_dir), "train.run_name": "t",
        "train.steps": 2, "task.train_size": 16, "task.eval_size": 4,
        "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
        "rollout.eval_max_new_tokens": 8, "train.progress": "false", "algo.micro_batch_size": 4,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def resumed_step_two(run) -> tuple[list[dict], dict]:
    """An episode source's exact resume: `run(folder, steps, *extra)` trains a run and returns its metrics
    rows. Two steps in one go, and one step then a resume to two, must give the same second step; returns
    the whole run's rows and its step 2. Timings and memory aside, and sampler/*: the sampler's log-probs
    round with the rows an engine call holds, which depends on when the episodes asked (1e-9); the tokens,
    rewards, losses and updates are exact."""
    def steady(row: dict) -> dict:
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/", "sampler/"))}

    whole = run("whole", 2)
    run("parts", 1)
    resumed = run("parts", 2, "train.resume=auto")
    step2 = [r for r in whole if r["step"] == 2 and "final" not in r][0]
    assert steady([r for r in resumed if r["step"] == 2 and "final" not in r][0]) == steady(step2)
    return whole, step2


def varied_reward(prompts, completions, **_):
    """A deterministic reward that differs between samples, so every step updates the policy."""
    return [(sum(map(ord, c)) % 7) / 6 for c in completions]


def grouped_rollout(tokenizer, groups: int = 2, group_size: int = 3, width: int = 7, seed: int = 0) -> Rollout:
    """Left-padded prompts repeated G times, right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    prompt_lens = [5, 3][:groups] + [4] * max(0, groups - 2)
    prompts, masks = [], []
    for n in prompt_lens:
        ids = torch.randint(3, vocab, (n,), generator=g)
        prompts.append(torch.cat([torch.full((5 - n,), pad), ids]))
        masks.append(torch.cat([torch.zeros(5 - n, dtype=torch.long), torch.ones(n, dtype=torch.long)]))
    index = torch.arange(groups).repeat_interleave(group_size)
    n = len(index)
    response = torch.randint(3, vocab, (n, width), generator=g)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    lengths[0] = width
    resp_mask = (torch.arange(width)[None] < lengths[:, None]).float()
    response = torch.where(resp_mask.bool(), response, torch.full_like(response, pad))
    return Rollout(prompt_ids=torch.stack(prompts)[index], prompt_mask=torch.stack(masks)[index],
                   response_ids=response, response_mask=resp_mask, group_ids=index,
                   truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n, example_index=index.tolist())
