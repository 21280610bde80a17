"""Atomic, complete checkpoints and exact resume.

Layout: runs/<name>/checkpoints/step-000010/ holding
  policy/              Hugging Face folder (loads with from_pretrained)
  trainer_state.pt     optimizers, scheduler, KL controller, RNG states, data position, counters
  critic.pt, reference.pt   when those models exist and can differ from their start
  config.yaml          the resolved config of the run

A checkpoint is written into a hidden temporary folder, every file fsynced,
then renamed into place: a folder named step-* is always complete, whatever
kill or full disk interrupts the write. The newest K are kept.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import yaml

from covey.config import as_dict, from_dict

# Keys that change only logging, speed or length of the run, never its numbers.
RESULT_NEUTRAL = {
    "train.steps", "train.resume", "train.progress", "train.save_every", "train.keep_checkpoints",
    "train.logger", "train.output_dir", "train.run_name", "train.resume_force", "model.threads",
    "train.samples_every", "rollout.eval_batch_size",
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed from."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_dir_write(final: Path, write) -> Path:
    """Call write(tmp_dir), fsync, rename to `final`. A failure leaves `final` untouched."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _assert_finite(model: torch.nn.Module, what: str) -> None:
    for name, p in model.state_dict().items():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise CheckpointError(f"refusing to save a checkpoint: {what} parameter {name} is not finite")


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def trainer_state(run, eval_before: dict) -> dict:
    return {
        "step": run.step,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "critic_optimizer": run.critic_optimizer.state_dict() if run.critic_optimizer else None,
        "kl_controller": run.kl_controller.state_dict(),
        "stream": run.stream.state_dict(),
        "update_state": vars(run.update_state).copy(),
        "shuffle_generator": run.shuffle_generator.get_state(),
        "rng": rng_state(),
        "eval_before": eval_before,
        "extra": {k: v.state_dict() for k, v in getattr(run, "extra_state", {}).items()},
    }


def save_checkpoint(run, eval_before: dict) -> Path:
    """Write the whole training state atomically; prune to the newest K."""
    _assert_finite(run.policy, "policy")
    if run.critic is not None:
        _assert_finite(run.critic, "critic")
    final = checkpoint_root(run.run_dir) / f"step-{run.step:06d}"

    def write(tmp: Path) -> None:
        run.policy.save_pretrained(tmp / "policy", safe_serialization=True)
        run.tokenizer.save_pretrained(tmp / "policy")
        torch.save(trainer_state(run, eval_before), tmp / "trainer_state.pt")
        if run.critic is not None:
            torch.save(run.critic.state_dict(), tmp / "critic.pt")
        if run.reference is not None and (run.cfg.algo.ref_refresh_every or run.cfg.algo.ref_ema):
            torch.save(run.reference.state_dict(), tmp / "reference.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(as_dict(run.cfg), sort_keys=False))

    final.parent.mkdir(parents=True, exist_ok=True)
    _atomic_dir_write(final, write)
    for old in list_checkpoints(run.run_dir)[:-max(run.cfg.train.keep_checkpoints, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def config_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ and would change results."""
    a, b = as_dict(from_dict(saved)), as_dict(from_dict(current))
    diffs = []
    for section, fields in a.items():
        for key, value in fields.items():
            dotted = f"{section}.{key}"
            if dotted not in RESULT_NEUTRAL and b[section][key] != value:
                diffs.append(f"{dotted} ({value!r} -> {b[section][key]!r})")
    return diffs


def resolve_resume(cfg, run_dir: Path) -> Path | None:
    """'' -> None; 'auto' -> newest complete checkpoint of this run (or None); else the given path."""
    spec = cfg.train.resume
    if not spec:
        return None
    if spec == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(spec)
    if not (path / "trainer_state.pt").is_file():
        raise CheckpointError(f"resume={spec}: not a complete covey checkpoint (no trainer_state.pt)")
    return path


def load_checkpoint(run, path: Path) -> dict:
    """Restore everything `save_checkpoint` wrote into `run`; returns the pre-training eval."""
    saved_cfg = yaml.safe_load((path / "config.yaml").read_text())
    diffs = config_differences(saved_cfg, as_dict(run.cfg))
    if diffs and not run.cfg.train.resume_force:
        raise CheckpointError(f"resume from {path}: config changed in keys that change results: "
                              f"{', '.join(diffs)} (set train.resume_force=true to override)")
    from safetensors.torch import load_file
    shards = sorted((path / "policy").glob("*.safetensors"))
    state = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    missing, unexpected = run.policy.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise CheckpointError(f"{path}: policy weights do not match the model ({len(missing)} missing)")
    if getattr(run.policy.config, "tie_word_embeddings", False):
        run.policy.tie_weights()
    st = torch.load(path / "trainer_state.pt", weights_only=False)
    if run.critic is not None:
        run.critic.load_state_dict(torch.load(path / "critic.pt"))
        run.critic_optimizer.load_state_dict(st["critic_optimizer"])
    if (path / "reference.pt").is_file() and run.reference is not None:
        run.reference.load_state_dict(torch.load(path / "reference.pt"))
    run.optimizer.load_state_dict(st["optimizer"])
    run.scheduler.load_state_dict(st["scheduler"])
    run.kl_controller.load_state_dict(st["kl_controller"])
    run.stream.load_state_dict(st["stream"])
    for k, v in st["update_state"].items():
        setattr(run.update_state, k, v)
    run.shuffle_generator.set_state(st["shuffle_generator"])
    for k, v in st.get("extra", {}).items():
        getattr(run, "extra_state", {})[k].load_state_dict(v)
    set_rng_state(st["rng"])
    run.step = st["step"]
    return st["eval_before"]


def save_final(run) -> Path:
    """The trained policy as a Hugging Face folder: runs/<name>/final."""
    _assert_finite(run.policy, "policy")
    final = Path(run.run_dir) / "final"

    def write(tmp: Path) -> None:
        run.policy.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)
        if run.critic is not None:
            torch.save(run.critic.state_dict(), tmp / "critic.pt")

    return _atomic_dir_write(final, write)
