"""Synthetic compare folders with known numbers, for the report and claims tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, algo: str, seed: int, *, steps: int = 6, acc: tuple[float, float] = (0.2, 0.3),
              sec_per_step: float = 10.0, rewards: list[float] | None = None, roles: dict | None = None,
              peak_rss: float = 2000.0, grad_noise: float | None = 0.5, adv_std: float = 1.0,
              finished: bool = True, jitter: float = 0.0, entropy: float = 1.0, clipfrac: float = 0.02) -> Path:
    """One run folder <algo>-s<seed> with metrics.jsonl rows shaped like covey.training.loop writes them.

    time/step alternates sec_per_step +- jitter so pooled tests see a known spread.
    """
    run = root / f"{algo}-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    roles = roles or {"actor": 500.0, "reference": 500.0, "optimizer": 1000.0}
    rewards = rewards or [0.1 * i for i in range(steps)]
    rows = [{"step": 0, "eval/accuracy": acc[0], "eval/n": 100}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": rewards[s - 1], "accuracy": rewards[s - 1],
               "time/step": sec_per_step + (jitter if s % 2 else -jitter), "time/generate": sec_per_step * 0.6,
               "time/score": 0.1, "time/logprobs": sec_per_step * 0.1, "time/update": sec_per_step * 0.3 - 0.1,
               "kl/ref": 0.01 * s, "policy/entropy": entropy - 0.01 * s, "response/len_mean": 20.0,
               "policy/clipfrac": clipfrac, "advantages/std": adv_std, "memory/peak_rss_mb": peak_rss}
        row.update({f"memory/params_mb/{k}": v for k, v in roles.items()})
        if grad_noise is not None and s % 2 == 0:
            row["policy/grad_noise_frac"] = grad_noise + 0.01 * s
            row["policy/grad_var"] = 10 * grad_noise + 0.1 * s
        rows.append(row)
    if finished:
        rows.append({"step": steps, "eval/accuracy": acc[1], "eval/n": 100, "final": 1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"model": {"path": "tiny"}, "task": {"name": "arithmetic", "kind": "mul", "eval_size": 100},
              "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 48}, "algo": {"name": algo}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def assert_valid_png(path: Path) -> None:
    """A PNG written by matplotlib: signature, a real size, and pixels that are not all one colour."""
    import matplotlib.image
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, pixels.shape
    assert float(pixels[..., :3].std()) > 0.02, f"{path} is almost blank"
