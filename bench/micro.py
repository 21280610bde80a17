"""Ablations of covey's optimisations on the real model, in CPU seconds of one thread.

    nice -n 10 .venv/bin/python bench/micro.py

CPU time of a single-threaded process is what a measurement on a shared machine can
trust (wall time there depends on the other jobs); each figure is the best of --repeats.
Rows: generation of 4 prompts x 8 samples x 64 tokens (HF `generate` vs covey's fast
engine, fp32 and bf16 autocast), the training forward+backward of one micro-batch of 8
samples of one prompt (padded vs packed, fp32 and bf16), and one AdamW step (for-loop vs
fused). The rollouts are sampled once, with a fixed seed, by the fast engine.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from covey.passes import logprobs as forward
from covey.tasks.data import format_prompts
from covey.models.load import load_policy
from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.tasks.arithmetic import arithmetic_splits


def cpu_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bfloat16" else contextlib.nullcontext()


def generation_rows(model, tok, prompts, repeats: int) -> list[tuple[str, float]]:
    rows = []
    for name, engine in (("hf generate", HFEngine(model, tok, max_new_tokens=64)),
                         ("fast engine", FastEngine(model, tok, max_new_tokens=64))):
        for precision in ("none", "bfloat16"):
            def run():
                torch.manual_seed(1)
                with autocast(precision):
                    engine.generate(prompts, 8)
            rows.append((f"generate 4x8x64, {name}, autocast={precision}", cpu_seconds(run, repeats)))
    return rows


def train_rows(model, part, repeats: int) -> list[tuple[str, float]]:
    rows = []
    model.train()
    original = forward.packs
    for layout in ("padded", "packed"):
        forward.packs = original if layout == "packed" else (lambda m: False)
        for precision in ("none", "bfloat16"):
            def run():
                logp, _, width = forward.policy_logprobs(model, part, 1.0, with_entropy=True, precision=precision)
                (logp * part.response_mask[:, :width]).sum().backward()
                model.zero_grad(set_to_none=True)
            rows.append((f"train fwd+bwd 8 samples, {layout}, autocast={precision}", cpu_seconds(run, repeats)))
    forward.packs = original
    return rows


def adamw_rows(model, repeats: int) -> list[tuple[str, float]]:
    rows = []
    for fused in (False, True):
        params = [p for p in model.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # allocates the moments
        rows.append((f"AdamW step 135M, fused={fused}", cpu_seconds(optimizer.step, repeats)))
        del optimizer
    model.zero_grad(set_to_none=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_policy("default")
    train, _ = arithmetic_splits(40, 8, 0, kind="mul", digits_a=2, digits_b=1)
    prompts = format_prompts(tok, train)
    torch.manual_seed(0)
    group = FastEngine(model, tok, max_new_tokens=64).generate(prompts[:1], 8)
    group = group.select(torch.arange(len(group)))  # normal tensors: the engine returns inference tensors
    print(f"micro-batch response lengths: {group.response_mask.sum(1).long().tolist()}")
    rows = generation_rows(model, tok, prompts[8:12], args.repeats)
    rows += train_rows(model, group, args.repeats)
    rows += adamw_rows(model, args.repeats)
    print("| measurement | CPU s (1 thread) |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
