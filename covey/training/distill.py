"""On-policy distillation: the teacher of algo.learner=distill and its update phase.

The student (the policy) samples and is scored as for RL (covey/training/rollout_phase.py); the teacher, any
local model with the student's tokenizer (checked before any model loads: the vocabulary, and the ids of a few
texts), scores the student's samples in a no-grad pass, the reference pass's (passes.logprobs.batched_logprobs
under the same halving on out-of-memory), in bf16 where the device computes bf16 natively (autocast=auto) and
float32 elsewhere. Then, by algo.distill.loss:

- reverse_kl (Lu and Thinking Machines Lab 2025, "On-Policy Distillation"; Agarwal et al. 2023,
  arXiv:2306.13649): each sampled token's advantage is log pi_teacher(y_t) - log pi_student(y_t)
  (`algos.reverse_kl_advantages`, pi_student = pi_old, the policy that sampled), given to algo.policy_loss
  with its clipping, aggregation and token devices, as the advantage learner gives its advantages
  (covey/training/rl.py); algo.distill.reward_weight adds the estimator's reward advantages times the weight;
- jsd (GKD, Agarwal et al. 2023): GKD's generalized JSD of the two models' next-token distributions at every
  trained token of the student's samples (`algos.jsd_loss`, algo.distill.beta, top_k, at the sampling
  temperature), normalised over the step's trained tokens; both models run on the same packed layout of whole
  sequences (covey/training/sft.py).

Logged each step: distill/teacher_kl, the mean over the trained tokens of log pi_student - log pi_teacher at
the sampled tokens before the update (reverse_kl), or of the exact KL(pi_student || pi_teacher) over the
vocabulary during it (jsd).
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import Tensor

from covey import algos
from covey.batch import Rollout
from covey.config import ConfigError
from covey.config.schema_algo import DistillOptions
from covey.models.families import check_model_family
from covey.models.load import ModelOptions, load_policy, load_tokenizer, resolve_model_path
from covey.passes.logprobs import batched_logprobs
from covey.passes.sequences import Sequences, layout, layout_logits, packs_all, stack
from covey.runtime.dist import World, all_finite
from covey.runtime.fsdp import shard_model
from covey.runtime.memory import halving_on_oom, record_gpu_peak
from covey.runtime.precision import model_device, resolve_autocast, shared_weight_casts
from covey.training.global_batch import global_normalizer
from covey.training.plan import Plan, UpdateOptions
from covey.training.rl import add_advantages, add_logprobs, update
from covey.training.setup import Run
from covey.training.signal_watch import signal_metrics
from covey.training.token_weights import correct_sampler_mismatch, observe_entropy, select_tokens
from covey.training.update import MetricAverager, Optimized, StepGradient, optimizer_steps

PROBE_TEXTS = ("What is 12 * 7? Answer with a number.", " The answer is 84.\n\n#### 84", "Ünïcödé, 数学, emoji 🙂")


def tokenizer_mismatch(policy, teacher) -> str | None:
    """Where two tokenizers differ (their size, a token's id, the ids of a probe text, a chat rendering, the
    end-of-sequence id), or None when they agree."""
    if len(policy) != len(teacher):
        return f"{len(teacher)} tokens against the policy's {len(policy)}"
    mine, theirs = policy.get_vocab(), teacher.get_vocab()
    differing = next((t for t, i in sorted(mine.items(), key=lambda kv: kv[1]) if theirs.get(t) != i), None)
    if differing is not None:
        return f"token {differing!r} has id {theirs.get(differing)} against the policy's {mine[differing]}"
    texts = list(PROBE_TEXTS)
    if getattr(policy, "chat_template", None) and getattr(teacher, "chat_template", None):
        chat = [{"role": "user", "content": PROBE_TEXTS[0]}]
        texts += [policy.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    for text in texts:
        if policy(text, add_special_tokens=False)["input_ids"] != teacher(text, add_special_tokens=False)["input_ids"]:
            return f"{text[:40]!r} encodes to other ids"
    if policy.eos_token_id != teacher.eos_token_id:
        return f"its end-of-sequence id is {teacher.eos_token_id} against the policy's {policy.eos_token_id}"
    return None


def vocabulary_rows(path: str) -> int | None:
    """The output layer's rows of the model folder at `path` (config.json's vocab_size), None when unknown."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    return getattr(config, "vocab_size", None)


def check_teacher(distill: DistillOptions | None, model: ModelOptions) -> None:
    """Before any model loads: the teacher is there, of a family covey serves, with the policy's tokenizer (and,
    for loss=jsd, an output layer as wide as the policy's); else one line naming both."""
    if distill is None:
        return
    policy_path, teacher_path = resolve_model_path(model.path), resolve_model_path(distill.teacher)
    check_model_family(teacher_path)
    problem = tokenizer_mismatch(load_tokenizer(policy_path), load_tokenizer(teacher_path))
    if problem is None and distill.loss == "jsd":
        rows = vocabulary_rows(teacher_path), vocabulary_rows(policy_path)
        if rows[0] != rows[1]:
            problem = f"its output layer has {rows[0]} rows against the policy's {rows[1]} (loss=jsd compares them)"
    if problem is not None:
        raise ConfigError(f"algo.distill.teacher={distill.teacher}: its tokenizer is not the policy's "
                          f"(model.path={model.path}): {problem}")


def load_teacher(plan: Plan, world: World) -> torch.nn.Module | None:
    """The frozen teacher on the training device (None without one): bf16 weights where the passes run under bf16
    autocast, float32 elsewhere; under torchrun sharded like the policy."""
    if plan.distill is None:
        return None
    bf16 = resolve_autocast(plan.model.autocast, world.device) == "bfloat16"
    teacher, _ = load_policy(plan.distill.teacher, dtype=torch.bfloat16 if bf16 else torch.float32)
    teacher.requires_grad_(False)
    teacher.eval()
    print(f"covey: teacher {plan.distill.teacher}: {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M "
          f"parameters in {'bfloat16' if bf16 else 'float32'}")
    return shard_model(teacher, world.device)


def add_teacher_logprobs(run: Run, rollout: Rollout) -> tuple[Tensor, dict]:
    """The teacher's log-probs of the sampled tokens (N, L), 0 outside response_mask: the reference's pass."""
    t0, u = time.perf_counter(), run.plan.update
    logp = halving_on_oom("logprobs", run.micro_batches, lambda mb: batched_logprobs(
        run.teacher, rollout, u.temperature, mb, u.autocast), run.world.device)
    return logp, record_gpu_peak({"time/teacher": time.perf_counter() - t0}, run.world.device, "teacher")


def learn_from_teacher(run: Run, rollout: Rollout) -> dict:
    """algo.learner=distill (module docstring): the teacher's pass, then its loss's update."""
    if run.plan.distill.loss == "jsd":
        return jsd_update(run, rollout)
    metrics = add_logprobs(run, rollout)  # pi_old: the student's log-probs; pi_ref where a KL term needs it
    teacher_logp, timing = add_teacher_logprobs(run, rollout)
    advantages, kl = algos.reverse_kl_advantages(rollout.old_logp, teacher_logp, rollout.response_mask)
    metrics.update({**timing, **kl})
    weight = run.plan.distill.reward_weight
    if weight:  # the estimator's advantages of the rewards, beside the teacher's
        metrics.update(add_advantages(run, rollout))
        advantages = advantages + weight * rollout.advantages
    rollout.advantages, rollout.returns = advantages, torch.zeros_like(advantages)
    metrics.update(correct_sampler_mismatch(run, rollout))
    metrics.update(select_tokens(run, rollout))
    metrics.update(signal_metrics(rollout))
    metrics.update(observe_entropy(run, rollout))
    metrics.update(update(run, rollout))
    return metrics


# --------------------------------------------------------------------------- GKD's loss


def rollout_sequences(rollout: Rollout, pad_id: int) -> Sequences:
    """Each row's prompt (its real tokens) and attended response as one sequence, the response's trained tokens
    marked."""
    rows = []
    for i in range(len(rollout)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        length = int(rollout.response_attended[i].sum())
        response = rollout.response_ids[i, :length].tolist()
        rows.append((prompt + response, [0] * len(prompt) + rollout.response_mask[i, :length].int().tolist()))
    return stack(rows, pad_id)


def jsd_gradient(models: tuple, seqs: Sequences, rows: Tensor, size: int, opts: UpdateOptions,
                 distill: DistillOptions) -> StepGradient:
    """One optimizer step's GKD gradient over `rows` ((student, teacher) = `models`), in micro-batches of `size`."""
    policy, teacher = models
    norm = global_normalizer("token_mean", seqs.target_mask[rows], seqs.ids.shape[1])
    avg, device = MetricAverager(), model_device(policy)
    with shared_weight_casts(opts.autocast, device):
        for micro in rows.split(size):
            part = seqs.select(micro, device)
            lay = layout(policy, part, opts.autocast, packs_all(policy, teacher))
            student = layout_logits(policy, lay, opts.autocast)
            with torch.no_grad():
                taught = layout_logits(teacher, lay, opts.autocast)
            mask = lay.laid(part.target_mask)
            loss, metrics = algos.jsd_loss(student, taught, mask, norm, distill.beta, opts.temperature,
                                           distill.top_k)
            if not all_finite(loss):  # checked before backward: no NaN reaches a gradient
                return StepGradient(False, avg)
            loss.backward()
            with torch.no_grad():  # the exact reverse KL over the vocabulary, reported
                kl = algos.generalized_jsd(student.detach(), taught, 1.0, opts.temperature)
                count = float(mask.sum())
                metrics["distill/teacher_kl"] = float((kl * mask).sum()) / max(count, 1.0)
            avg.add(metrics, count)
    return StepGradient(True, avg)


def jsd_update(run: Run, rollout: Rollout) -> dict:
    """algo.epochs x algo.minibatches optimizer steps of GKD's loss on the student's samples."""
    t0, opts = time.perf_counter(), run.plan.update
    seqs = rollout_sequences(rollout, run.tokenizer.pad_token_id)
    rollout.advantages = rollout.returns = torch.zeros_like(rollout.response_mask)  # none: sample logs show 0
    target = Optimized(run.policy, run.optimizer, run.scheduler, run.update_state)
    gradient = partial(jsd_gradient, (run.policy, run.teacher), seqs, opts=opts, distill=run.plan.distill)
    metrics = optimizer_steps(target, len(seqs.ids), gradient, opts, run.shuffle_generator, run.micro_batches)
    metrics.update({**run.micro_batches.metrics(), "optim/lr": run.scheduler.get_last_lr()[0],
                    "optim/skipped_steps": run.update_state.skipped_steps, "time/update": time.perf_counter() - t0})
    return record_gpu_peak(metrics, run.world.device, "update")
