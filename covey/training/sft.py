"""Supervised fine-tuning: the step of algo.learner=sft (covey sft) and of a warm-up before RL (sft.num_steps).

A supervised step draws sft.batch_size conversations of sft.data (a seeded stream of epochs, checkpointed
like the prompts'; under torchrun each rank takes its contiguous share), and takes one optimizer step
through the trainer's one optimizer loop (covey.training.update.optimizer_steps: micro-batches of
algo.micro_batch_size, the finite checks, the clipping, the halving on out-of-memory). The loss is
`algos.token_nll`: -log pi_theta of each assistant token (covey/tasks/sft_data.py marks them), summed and
divided by the step's trained tokens over every micro-batch and every process (the global normaliser of
covey/training/global_batch.py, token_mean), so neither the micro-batch size nor the process count changes
the gradient. Log-probs are taken at temperature 1.

The forward pass packs whole conversations (covey/passes/sequences.py): a micro-batch's rows are laid end to
end in rows of the packed width, each attending causally to itself only; a model whose layers cannot be
packed (a recurrent state) takes the padded pass.

Metrics: sft/loss (the step's mean -log-prob per trained token), sft/token_accuracy (the share of trained
tokens that are the model's most likely next token), sft/tokens, sft/sequences (docs/metrics.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor

from covey import algos
from covey.models.families import check_model_family
from covey.models.load import ModelOptions, load_tokenizer, resolve_model_path
from covey.passes.sequences import Sequences, stack, token_scores
from covey.runtime.dist import all_finite, all_reduce, rank_share, reduce_metrics
from covey.runtime.memory import record_gpu_peak
from covey.runtime.precision import model_device, shared_weight_casts
from covey.tasks.data import PromptStream
from covey.tasks.sft_data import Tokens, has_generation_tags, load_demos, render_demo
from covey.training.global_batch import global_normalizer
from covey.training.phases import SftOptions
from covey.training.plan import UpdateOptions
from covey.training.setup import Run
from covey.training.update import MetricAverager, Optimized, StepGradient, optimizer_steps


@dataclass
class Demos:
    """sft.data rendered with the policy's tokenizer."""
    rows: list[Tokens]
    pad_id: int

    def batch(self, index: list[int]) -> Sequences:
        return stack([(self.rows[i].ids, self.rows[i].trained) for i in index], self.pad_id)


def prepare_demos(sft: SftOptions | None, model: ModelOptions) -> Demos | None:
    """Before any model loads: sft.data read, checked and rendered with the policy's tokenizer (a bad row is
    one line naming its file and line); None without a supervised phase."""
    if sft is None:
        return None
    path = resolve_model_path(model.path)
    tokenizer = load_tokenizer(path)
    context = check_model_family(path).context or 2048
    rows = [render_demo(tokenizer, demo, context) for demo in load_demos(sft.data, sft.split)]
    how = ("no chat template: completions" if not getattr(tokenizer, "chat_template", None) else
           "the chat template's generation tags" if has_generation_tags(tokenizer) else
           "covey's turn-by-turn rendering")
    trained = sum(sum(r.trained) for r in rows)
    print(f"covey: sft data {sft.data}: {len(rows)} conversations, {sum(len(r.ids) for r in rows)} tokens, "
          f"{trained} trained (the assistant's, marked by {how})")
    return Demos(rows, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)


def demo_stream(demos: Demos | None, seed: int) -> PromptStream | None:
    """The seeded order of the conversations over the supervised steps (checkpointed with the run)."""
    return PromptStream(len(demos.rows), seed) if demos is not None else None


# --------------------------------------------------------------------------- the step


def sft_gradient(policy, seqs: Sequences, rows: Tensor, size: int, opts: UpdateOptions) -> StepGradient:
    """One optimizer step's supervised gradient over `rows`, in micro-batches of `size`; each micro-batch's loss
    is its share of the step's (the normaliser counts the trained tokens of every micro-batch and rank)."""
    norm = global_normalizer("token_mean", seqs.target_mask[rows], seqs.ids.shape[1])
    avg, device = MetricAverager(), model_device(policy)
    with shared_weight_casts(opts.autocast, device):
        for micro in rows.split(size):
            part = seqs.select(micro, device)
            logp, right = token_scores(policy, part, opts.autocast)
            mask = part.target_mask
            loss, metrics = algos.token_nll(logp, mask, norm)
            if not all_finite(loss):  # checked before backward: no NaN reaches a gradient
                return StepGradient(False, avg)
            loss.backward()
            count = float(mask.sum())
            metrics["sft/token_accuracy"] = float((right & mask.bool()).sum()) / max(count, 1.0)
            avg.add(metrics, count)
    return StepGradient(True, avg)


def sft_step(run: Run, demos: Demos, engine) -> dict:
    """One supervised step (module docstring); the engine gets the new weights; at the end of a warm-up the
    reference becomes the policy (algo's KL is then to the fine-tuned model)."""
    t0, plan = time.perf_counter(), run.plan
    mine = rank_share(run.sft_stream.next(plan.sft.batch_size), run.world)
    seqs = demos.batch(mine)
    opts = replace(plan.update, epochs=1, minibatches=1)
    target = Optimized(run.policy, run.optimizer, run.scheduler, run.update_state)
    metrics = optimizer_steps(target, len(seqs.ids), partial(sft_gradient, run.policy, seqs, opts=opts), opts,
                              run.shuffle_generator, run.micro_batches)
    engine.sync_weights(run.policy)
    run.step += 1
    if run.reference is not None and run.step == plan.reference.reset_at:
        run.reference.load_state_dict(run.policy.state_dict())
    totals = all_reduce(torch.tensor([float(seqs.target_mask.sum()), float(len(mine))]))
    metrics.update({"sft/tokens": float(totals[0]), "sft/sequences": float(totals[1]),
                    "optim/skipped_steps": run.update_state.skipped_steps,
                    "optim/lr": run.scheduler.get_last_lr()[0], **run.micro_batches.metrics()})
    metrics["time/step"] = time.perf_counter() - t0
    metrics["time/elapsed"] = run.clock.add(metrics["time/step"])
    return reduce_metrics(record_gpu_peak(metrics, run.world.device, "update"))
