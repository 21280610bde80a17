"""Bytes per trained parameter of each optim.name (weights, gradients, the optimizer state's tensors) after two steps
on zero gradients (torchao allocates and compiles at the first), and both steps' seconds (docs/results.md).

    python -m bench.optim_memory --names adamw_8bit --dtype bfloat16   # default: SmolLM2-135M, every CPU name, fp32"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import table
from covey.config import OptimConfig
from covey.models.load import load_policy
from covey.models.tiny import tiny_llama
from covey.training.optim import make_optimizer, state_bytes
from covey.training.plan_setup import optimizer_options

CPU_NAMES = "adamw,adamw_8bit,adamw_4bit,adamw_bf16"


def measure(name: str, model_path: str, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """One optim.name on a freshly loaded model, its weights in `dtype` (default fp32; adamw_bf16's bf16)."""
    dtype = dtype or (torch.bfloat16 if name == "adamw_bf16" else torch.float32)
    model = tiny_llama(512).to(dtype) if model_path == "tiny" else load_policy(model_path, dtype=dtype)[0]
    params = [p for p in model.to(device).parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    optimizer = make_optimizer(params, 1e-5, optimizer_options(OptimConfig(name=name)))
    seconds = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        (0 * sum(p.sum() for p in params)).backward()  # zero gradients, allocated as a backward allocates them
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    per = {"weights": sum(p.numel() * p.element_size() for p in params) / count,
           "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params) / count,
           "state": state_bytes(optimizer) / count}
    return {"name": name, "weights_dtype": str(dtype).removeprefix("torch."), "parameters": count,
            "bytes_per_parameter": {**per, "total": sum(per.values())},
            "first_step_s": seconds[0], "second_step_s": seconds[1]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model.path, or 'tiny' for the test model")
    parser.add_argument("--names", default=CPU_NAMES, help="comma-separated optim.name values")
    parser.add_argument("--dtype", default="", help="the weights' dtype for every name (bfloat16 | float32)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    rows = [measure(name, args.model, "cpu", dtype) for name in args.names.split(",")]
    print(table(["optim.name", "weights", "bytes/param: weights", "gradients", "optimizer state", "total",
                 "first step s", "second step s"],
                [[f"`{r['name']}`", r["weights_dtype"], *(f"{r['bytes_per_parameter'][k]:.{d}f}" for k, d in
                  (("weights", 2), ("gradients", 2), ("state", 3), ("total", 2))), f"{r['first_step_s']:.1f}",
                  f"{r['second_step_s']:.2f}"] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
