"""Atomic, complete checkpoints and exact resume.

Layout: runs/<name>/checkpoints/step-000010/ holding
  policy/              Hugging Face folder (loads with from_pretrained)
  trainer_state.pt     optimizers, scheduler, KL controller, RNG states, data position,
                       counters, pre-training eval, log-file lengths
  critic.pt, reference.pt   when those models exist and can differ from their start
  config.yaml          the resolved config of the run

A checkpoint is written into a hidden temporary folder, every file fsynced,
then renamed into place: a folder named step-* is always complete, whatever
kill or full disk interrupts the write. The newest K are kept. Nothing
non-finite is ever written: a NaN in a model or optimizer state stops the run
with the previous checkpoint as the newest.

Resuming restores every random state (Python, NumPy, torch CPU and CUDA
generators, which HF `generate` samples from; the mini-batch shuffle
generator) and cuts metrics.jsonl / samples.jsonl back to their length at save
time, so a resumed run writes exactly the lines an uninterrupted run writes.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from covey.config import Config, as_dict
from covey.models.export import write_model_card
from covey.models.lora import load_adapter_weights
from covey.runtime.errors import first_line
from covey.runtime.signals import fault_point
from covey.tasks.data import absolute_reward_file
from covey.training.optim import state_tensors

# Keys that change only logging, speed, memory or length of the run, never its numbers (the device and
# gradient checkpointing change them by float rounding alone: a run may move between CPU and GPU). A run
# resumes with its checkpointed batch sizes whatever train.gpu_memory_gib says now; algo.update_memory_share
# is what runs before train.gpu_memory_gib recorded.
RESULT_NEUTRAL = {"train.device", "model.gradient_checkpointing", "algo.update_memory_share", "train.gpu_memory_gib",
    "train.steps", "train.resume", "train.progress", "train.save_every", "train.keep_checkpoints",
    "train.logger", "train.logger_project", "train.output_dir", "train.run_name", "train.resume_force", "model.threads",
    "train.samples_every", "rollout.eval_batch_size", "train.max_minutes", "train.dist_timeout_s",
    "rollout.vllm_gpu_memory_utilization", "rollout.vllm_sleep", "rollout.vllm_sync_bucket_mb",
    "rollout.vllm_sync_timeout_s", "train.eval_before_cache", "train.balance_ranks",
}
STATE_FILE = "trainer_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed from."""


@dataclass
class Resumed:
    """What the loop needs back from a checkpoint besides the restored objects."""
    path: Path
    eval_before: dict
    log_positions: dict


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file())


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


# --------------------------------------------------------------------------- atomic write


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        _fsync_dir(d)


def _atomic_dir_write(final: Path, write, step: int = -1) -> Path:
    """Call write(tmp_dir), fsync, rename to `final`. A failure leaves `final` untouched.

    An existing `final` is renamed aside first and removed only after the new one is
    in place, so at every instant one complete copy exists under a step-* name or aside.
    """
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    aside = final.parent / f".old-{final.name}-{os.getpid()}"
    for leftover in (tmp, aside):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        fault_point("checkpoint-rename", step)
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- state


def _first_nonfinite(named_tensors) -> str | None:
    for name, t in named_tensors:
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def _optimizer_tensors(optimizer):
    """(name, tensor) of the optimizer state, from state_dict() (also under FSDP's full-state view): torch's
    moments, an offloaded optimizer's per-parameter states, torchao's quantized moments' codes and scales."""
    return state_tensors(optimizer.state_dict())


def assert_finite_state(run) -> None:
    """Refuse to save NaN/inf: models and optimizer moments are checked."""
    checks = [("policy parameter", run.policy.state_dict().items()),
              ("policy optimizer state", _optimizer_tensors(run.optimizer))]
    if run.critic is not None:
        checks += [("critic parameter", run.critic.state_dict().items()),
                   ("critic optimizer state", _optimizer_tensors(run.critic_optimizer))]
    if _saves_reference(run):
        checks.append(("reference parameter", run.reference.state_dict().items()))
    for what, tensors in checks:
        bad = _first_nonfinite(tensors)
        if bad is not None:
            raise CheckpointError(f"refusing to save a checkpoint at step {run.step}: {what} {bad} "
                                  "is not finite (the previous checkpoint is kept)")


def _saves_reference(run) -> bool:
    return run.reference is not None and run.plan.reference.moves


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(run, eval_before: dict, log_positions: dict) -> dict:
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
        "logs": log_positions,
        "extra": {k: v.state_dict() for k, v in run.checkpointed().items()},
    }


# --------------------------------------------------------------------------- save


def save_checkpoint(run, eval_before: dict) -> Path:
    """Write the whole training state atomically; prune to the newest K."""
    assert_finite_state(run)
    final = checkpoint_root(run.run_dir) / f"step-{run.step:06d}"
    positions = (run.logger.positions() if run.logger is not None else None) or {}

    def write(tmp: Path) -> None:
        run.policy.save_pretrained(tmp / "policy", safe_serialization=True)
        run.tokenizer.save_pretrained(tmp / "policy")
        fault_point("checkpoint-write", run.step)
        if run.critic is not None:
            torch.save(run.critic.state_dict(), tmp / "critic.pt")
        if _saves_reference(run):
            torch.save(run.reference.state_dict(), tmp / "reference.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(run.config_record, sort_keys=False))
        torch.save(trainer_state(run, eval_before, positions), tmp / STATE_FILE)

    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        _atomic_dir_write(final, write, run.step)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError of its zip writer
        previous = list_checkpoints(run.run_dir)
        free_gb = shutil.disk_usage(final.parent).free / 1e9
        raise CheckpointError(f"writing checkpoint {final} failed: {first_line(err)} ({free_gb:.1f} GB free there); "
                              f"newest complete checkpoint: {previous[-1] if previous else 'none'}") from None
    fault_point("checkpoint-prune", run.step)
    prune_checkpoints(run.run_dir, run.plan.schedule.keep_checkpoints, run.step)
    return final


def prune_checkpoints(run_dir: Path, keep: int, current_step: int) -> None:
    """Keep the newest `keep`; drop leftovers of killed writes and of an abandoned
    future (steps after `current_step`, left when an older checkpoint was resumed)."""
    root = checkpoint_root(run_dir)
    for leftover in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    found = [p for p in root.glob("step-*") if p.is_dir()]
    stale = [p for p in found if checkpoint_step(p) > current_step]
    current = sorted(p for p in found if p not in stale)
    for old in stale + current[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- resume


def _flat(data: dict) -> dict:
    return {f"{section}.{key}": value for section, fields in data.items() for key, value in fields.items()}


def settled_form(key: str, value):
    """What a run records today for a value an older run recorded unsettled (tasks.data.settle_config):
    relative data and reward paths made absolute (from the folder the resume runs in). eval.metric=auto
    is compared as any verifier: the data it was resolved from are compared key by key."""
    if not isinstance(value, str) or not value:
        return value
    if key in ("task.path", "task.eval_path") or (key in ("reward.model_path", "reward.prm_path")
                                                  and Path(value).exists()):
        return os.path.abspath(value)
    if key == "reward.functions":
        return ",".join(absolute_reward_file(item) for item in value.split(","))
    return value


def config_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ and would change results.

    A key missing from the saved config (added to covey since) counts as its default; a value recorded
    before the run settled its config (`auto`, a relative path) counts as what it settles to.
    """
    old = {**_flat(as_dict(Config())), **_flat(saved)}
    new = _flat(current)
    diffs = []
    for key in sorted(old.keys() | new.keys()):
        if key in RESULT_NEUTRAL or old.get(key) == new.get(key) or settled_form(key, old.get(key)) == new.get(key):
            continue
        if key == "eval.metric" and old.get(key) == "auto":
            continue
        before = repr(old[key]) if key in old else "absent"
        after = repr(new[key]) if key in new else "absent"
        diffs.append(f"{key} ({before} -> {after})")
    return diffs


def check_resume_request(resume: str, run_name: str) -> None:
    """train.resume=auto needs a fixed run folder (train.run_name): the default name holds the start time."""
    if resume == "auto" and not run_name:
        raise CheckpointError("train.resume=auto needs train.run_name (the run folder to continue)")


def resolve_resume(spec: str, run_dir: Path) -> Path | None:
    """train.resume `spec`: '' -> None; 'auto' -> newest complete checkpoint of this run (or None);
    a checkpoint folder -> it; a run folder -> its newest checkpoint."""
    if not spec:
        found = list_checkpoints(run_dir)
        if found:
            raise CheckpointError(f"{run_dir} already holds checkpoints (newest {found[-1].name}): "
                                  "set train.resume=auto to continue it, or another train.run_name")
        return None
    if spec == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(spec)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise CheckpointError(f"train.resume={spec}: not a complete covey checkpoint or run folder "
                          f"(no {STATE_FILE})")


def _load_policy_weights(run, path: Path) -> None:
    from safetensors.torch import load_file
    if (path / "policy" / "adapter_config.json").is_file():  # a LoRA run saves its adapters only
        load_adapter_weights(run.policy, path / "policy")
        return
    state = {}
    for shard in sorted((path / "policy").glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = run.policy.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        # saved in the model's original layout (save_pretrained converts, e.g. fused experts to one tensor per
        # expert): transformers' own loading converts back, exactly (reshapes and concatenations only)
        missing, unexpected = _load_converted(run.policy, path / "policy")
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise CheckpointError(f"{path}: policy weights do not match the model "
                              f"({len(missing)} missing, {len(unexpected)} unexpected)")
    if getattr(run.policy.config, "tie_word_embeddings", False):
        run.policy.tie_weights()


def _load_converted(policy, folder: Path) -> tuple[list[str], list[str]]:
    """Load `folder`'s weights into `policy` through `from_pretrained` (its conversions of saved layouts);
    (missing, unexpected) names as `load_state_dict` gives them."""
    loaded = type(policy).from_pretrained(str(folder), dtype=next(policy.parameters()).dtype)
    result = policy.load_state_dict(loaded.state_dict(), strict=False)
    return list(result.missing_keys), list(result.unexpected_keys)


def _load_models(run, path: Path, st: dict) -> None:
    _load_policy_weights(run, path)
    if run.critic is not None:
        if not (path / "critic.pt").is_file():
            raise CheckpointError(f"{path}: no critic.pt, but this run trains a critic")
        run.critic.load_state_dict(torch.load(path / "critic.pt", map_location="cpu"))
        run.critic_optimizer.load_state_dict(st["critic_optimizer"])
    if run.reference is not None and (path / "reference.pt").is_file():
        run.reference.load_state_dict(torch.load(path / "reference.pt", map_location="cpu"))


def load_checkpoint(run, path: Path) -> Resumed:
    """Restore everything `save_checkpoint` wrote into `run`."""
    path = Path(path)
    saved_cfg = yaml.safe_load((path / "config.yaml").read_text())
    diffs = config_differences(saved_cfg, run.config_record)
    if diffs and not run.plan.schedule.resume_force:
        raise CheckpointError(f"resume from {path}: config changed in keys that change results: "
                              f"{', '.join(diffs)} (set train.resume_force=true to override)")
    st = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")  # GPU run -> CPU resume too
    _load_models(run, path, st)
    run.optimizer.load_state_dict(st["optimizer"])
    run.scheduler.load_state_dict(st["scheduler"])
    run.kl_controller.load_state_dict(st["kl_controller"])
    run.stream.load_state_dict(st["stream"])
    for k, v in st["update_state"].items():
        setattr(run.update_state, k, v)
    run.shuffle_generator.set_state(st["shuffle_generator"])
    extra = run.checkpointed()
    for k, v in st.get("extra", {}).items():
        if k not in extra:
            raise CheckpointError(f"{path}: holds state '{k}' that this run does not have")
        extra[k].load_state_dict(v)
    set_rng_state(st["rng"])
    run.step = st["step"]
    return Resumed(path=path, eval_before=st["eval_before"], log_positions=st.get("logs", {}))


def save_final(run) -> Path:
    """The trained policy as a Hugging Face folder, with its model card (README.md): runs/<name>/final."""
    bad = _first_nonfinite(run.policy.state_dict().items())
    if bad is not None:
        raise CheckpointError(f"refusing to save the final model: policy parameter {bad} is not finite")
    final = Path(run.run_dir) / "final"

    def write(tmp: Path) -> None:
        run.policy.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)
        write_model_card(tmp, run.run_dir, run.config_record)  # after PEFT's save, which writes a README of its own
        if run.critic is not None:
            torch.save(run.critic.state_dict(), tmp / "critic.pt")

    return _atomic_dir_write(final, write)
