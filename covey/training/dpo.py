"""Iterative DPO: the update phase of algo.learner=dpo.

DPO (Rafailov et al. 2023, arXiv:2305.18290) applied online and repeated, the cheaper
alternative that PPO is reported to beat (Xu et al. 2024, arXiv:2404.10719): the model answers
each prompt n times, a reward picks the best and the worst answer, DPO trains on these
pairs, and the loop repeats with the improved model. In covey one training step is one
iteration: the loop samples B prompts x G answers and scores them exactly as for GRPO
(`covey.training.rollout_phase.collect_rollout`), then this module

1. pairs the highest- with the lowest-scored answer of every group whose scores differ
   (`algos.best_worst_pairs`; groups where all answers tie carry no preference);
2. computes the frozen reference's log-probs of the 2P paired answers (one no-grad pass);
3. takes algo.epochs x algo.minibatches optimizer steps of the DPO loss
   (`algos.dpo_loss`, beta = algo.dpo.beta) on the pairs, through the trainer's one optimizer
   loop (`covey.training.update.optimizer_steps`: the finite check, the step, and the halving of
   the micro-batch on out-of-memory, as for the policy).

Choices, on purpose:
- the reference stays the initial model (online DPO); algo.ref_refresh_every=K makes it
  the policy of K steps ago, the "reference = previous iteration" form;
- there is no critic, no advantage and no importance ratio, so policy/clipfrac and
  policy/approx_kl are not reported; rollout.advantages is set to the preference label
  (+1 chosen, -1 rejected, 0 unpaired) so sample logs show which answers were paired;
- kl/ref is the k3 estimate on the paired answers' tokens during the update.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from covey import algos
from covey.batch import Rollout
from covey.passes.logprobs import batched_logprobs, policy_logprobs
from covey.runtime.dist import all_finite
from covey.runtime.memory import MicroBatchSizes, halving_on_oom, record_gpu_peak
from covey.runtime.precision import model_device
from covey.training.plan import UpdateOptions
from covey.training.setup import Run
from covey.training.update import MetricAverager, Optimized, StepGradient, optimizer_steps


def label_pairs(rollout: Rollout, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    """rollout.advantages = preference label on every response token (+1 / -1 / 0)."""
    label = torch.zeros(len(rollout))
    label[chosen], label[rejected] = 1.0, -1.0
    rollout.advantages = label[:, None] * rollout.response_mask
    rollout.returns = torch.zeros_like(rollout.response_mask)


def micro_dpo_loss(policy, pairs: Rollout, ref_seq: torch.Tensor, micro: torch.Tensor, num_pairs: int,
                   ref_token_logp: torch.Tensor, opts: UpdateOptions) -> tuple[torch.Tensor, dict]:
    """DPO loss of the pairs `micro` (one forward over their chosen and rejected rows)."""
    total = len(ref_seq) // 2
    rows = torch.cat([micro, micro + total])
    part = pairs.select(rows)
    logp, entropy, width = policy_logprobs(policy, part, opts.temperature, with_entropy=True,
                                           precision=opts.autocast)
    mask = part.response_mask[:, :width]
    seq = algos.sequence_logprob(logp, mask)
    k = len(micro)
    loss, metrics = algos.dpo_loss(seq[:k], seq[k:], ref_seq[micro], ref_seq[micro + total],
                                   opts.dpo_beta, num_pairs=num_pairs)
    # Reported, not trained: the k3 estimate to the reference and the entropy, masked first (algos).
    norm = algos.make_normalizer("token_mean", mask)
    _, kl = algos.kl_loss(logp.detach(), ref_token_logp[rows][:, :width], mask, norm, 0.0, "k3")
    _, entropy = algos.entropy_loss(entropy.detach(), mask, norm, 0.0)
    return loss, {**metrics, **kl, **entropy}


def dpo_gradient(policy, pairs: Rollout, ref_seq: torch.Tensor, ref_token_logp: torch.Tensor,
                 batch: torch.Tensor, size: int, opts: UpdateOptions) -> StepGradient:
    """One optimizer step's DPO gradient over the pairs `batch`, size // 2 pairs (2 rows each) per micro-batch."""
    avg = MetricAverager()
    for micro in batch.split(max(size // 2, 1)):
        loss, metrics = micro_dpo_loss(policy, pairs, ref_seq, micro, len(batch), ref_token_logp, opts)
        if not all_finite(loss):  # checked before backward: no NaN reaches a gradient
            return StepGradient(False, avg)
        loss.backward()
        avg.add(metrics, float(len(micro)))
    return StepGradient(True, avg)


def dpo_update(target: Optimized, reference, rollout: Rollout, opts: UpdateOptions, generator: torch.Generator,
               sizes: MicroBatchSizes | None = None) -> dict:
    """Pair, score under the reference, and take the DPO optimizer steps of `target` (the policy, its optimizer
    and schedule) for one iteration (covey.training.update.optimizer_steps). Out of memory, the reference pass and
    an optimizer step are redone at half their batch (`sizes`, kept for the run; reported as memory/*)."""
    policy, state = target.model, target.state
    chosen, rejected = algos.best_worst_pairs(rollout.scores, rollout.group_ids)
    label_pairs(rollout, chosen, rejected)
    num_pairs = len(chosen)
    out = {"dpo/pairs": float(num_pairs), "time/logprobs": 0.0, "time/update": 0.0}
    if num_pairs == 0:  # every group tied: nothing to prefer, no update; NaN is logged as null
        return {**out, **{k: float("nan") for k in ("policy/entropy", "kl/ref", "optim/grad_norm")}}
    t0, sizes = time.perf_counter(), sizes or MicroBatchSizes(opts.micro_batch_size)
    pairs = rollout.select(torch.cat([chosen, rejected]))
    ref_token_logp = halving_on_oom("logprobs", sizes, lambda size: batched_logprobs(
        reference, pairs, opts.temperature, size, opts.autocast), model_device(reference))
    ref_seq = algos.sequence_logprob(ref_token_logp, pairs.response_mask)
    out["time/logprobs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out.update(optimizer_steps(target, num_pairs,
                               partial(dpo_gradient, policy, pairs, ref_seq, ref_token_logp, opts=opts),
                               opts, generator, sizes))
    out.update(sizes.metrics())
    out["optim/skipped_steps"] = state.skipped_steps
    out["time/update"] = time.perf_counter() - t0
    return out


def learn_from_pairs(run: Run, rollout: Rollout) -> dict:
    """Iterative DPO (covey.training.dpo): best-vs-worst pairs of each group, DPO steps against the reference."""
    target = Optimized(run.policy, run.optimizer, run.scheduler, run.update_state)
    metrics = dpo_update(target, run.reference, rollout, run.plan.update, run.shuffle_generator, run.micro_batches)
    return record_gpu_peak({**metrics, "optim/lr": run.scheduler.get_last_lr()[0]}, run.world.device, "update")
