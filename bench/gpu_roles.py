"""The child processes of bench/gpu_bench.py: `device` (copy bandwidth, bf16 matmul peak), `build` (a random
Qwen2 model folder), `covey` and `trl` (GRPO steps timed by phase), `decode` (rollout.decode modes timed
on one model), each writing one JSON result.

    python bench/gpu_roles.py ROLE --result FILE [--workload gpu|smoke] [--size S] [--model DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Qwen2.5-0.5B and Qwen2.5-1.5B (their config.json), and a tiny shape for --smoke on a CPU
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}
WORKLOADS = {
    "gpu": dict(prompts=8, group_size=8, new_tokens=256, beta=0.04, lr=1e-6, temperature=1.0, micro_batch=8,
                seed=0, steps=4),
    "smoke": dict(prompts=2, group_size=4, new_tokens=12, beta=0.04, lr=1e-6, temperature=1.0, micro_batch=4,
                  seed=0, steps=3),
}
ROLES = ("device", "build", "covey", "trl", "decode")


def say(text: str) -> None:
    print(f"bench: {text}", flush=True)


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of fn() (CUDA events on a GPU)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def role_device(args) -> dict:
    """A device-to-device copy of >= 1 GiB (bytes read + written per second) and the best of a few large
    bf16 matmuls (2 m n k FLOPs each)."""
    gpu = torch.cuda.is_available()
    nbytes = 2 * 2**30 if gpu else 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device_name())
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), 10)
    del src, dst
    shapes = ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 4096)) if gpu else ((256, 256, 256),)
    best, best_shape = 0.0, None
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device_name())
        b = torch.randn(k, n, dtype=torch.bfloat16, device=device_name())
        rate = 2 * m * n * k / best_seconds(lambda: a @ b, 10) / 1e12
        if rate > best:
            best, best_shape = rate, (m, n, k)
        del a, b
    name = torch.cuda.get_device_name() if gpu else "cpu"
    return {"name": name, "copy_bytes_per_s": 2 * nbytes / copy_s, "copy_bytes": nbytes, "matmul_tflops": best,
            "matmul_shape": f"(m, n, k) = {best_shape}", "torch": torch.__version__}


def tokenizer_dir(args) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    from covey.models.default import prepare_default_model
    return Path(prepare_default_model())


def role_build(args) -> dict:
    """A random Qwen2 of the size's dimensions with SmolLM2's tokenizer, saved in bf16."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(args))
    config = Qwen2Config(**SHAPES[args.size], vocab_size=len(tok), tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device_name()):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(args.model)
    tok.save_pretrained(args.model)
    shape = model_shape(config, len(tok))
    w = WORKLOADS[args.workload]
    from covey.config import load_config
    from covey.tasks.data import format_prompts, load_task_data
    data = load_task_data(load_config("grpo", []).task, w["seed"])
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in format_prompts(tok, data.train[:200])]
    shape["prompt_tokens_mean"] = statistics.mean(lengths)
    return shape


def model_shape(config, vocab: int) -> dict:
    d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = d // h
    per_layer = d * h * head_dim + 2 * d * kv * head_dim + h * head_dim * d + 3 * d * config.intermediate_size
    matmul_params = config.num_hidden_layers * per_layer + vocab * d  # the output projection included
    params = matmul_params + config.num_hidden_layers * (2 * d + (h + 2 * kv) * head_dim) + d  # norms, biases
    describe = (f"Qwen2 hidden {d}, {config.num_hidden_layers} layers, {h} query / {kv} key-value heads of {head_dim}, "
                f"MLP {config.intermediate_size}, vocabulary {vocab} (tied): {params / 1e6:.0f}M parameters, "
                f"{matmul_params / 1e6:.0f}M in matrix products")
    return {"hidden": d, "layers": config.num_hidden_layers, "heads": h, "kv_heads": kv, "head_dim": head_dim,
            "intermediate": config.intermediate_size, "vocab": vocab, "params": params,
            "matmul_params": matmul_params, "describe": describe}


def update_flops(shape: dict, w: dict, prompt_tokens: float) -> float:
    """Model FLOPs of one update: 6 x matmul parameters x tokens, plus attention (QK^T and PV, forward and
    backward: 3 x 4 x heads x head_dim per query-key pair), counting each distinct prompt once (the
    work the update needs; recomputation gets no credit)."""
    n, length, p = w["prompts"] * w["group_size"], w["new_tokens"], prompt_tokens
    tokens = n * length + w["prompts"] * p
    pairs = n * (length * p + length * (length + 1) / 2) + w["prompts"] * p * (p + 1) / 2
    per_pair = 3 * 4 * shape["heads"] * shape["head_dim"] * shape["layers"]
    return 6 * shape["matmul_params"] * tokens + per_pair * pairs


def peak_gpu_bytes() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def write(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--result", required=True)
    parser.add_argument("--workload", default="gpu", choices=tuple(WORKLOADS))
    parser.add_argument("--size", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--tokenizer", default="")
    parser.add_argument("--decode-modes", default="")
    parser.add_argument("--keys", default="", help="covey: extra key=value settings, space-separated")
    parser.add_argument("--profile", action="store_true", help="covey: one more step under torch.profiler")
    parser.add_argument("--trl-gc", action="store_true", help="trl: gradient checkpointing on (TRL's default)")
    args = parser.parse_args()
    if args.role == "device":
        write(args.result, role_device(args))
    elif args.role == "build":
        write(args.result, role_build(args))
    elif args.role == "covey":
        from gpu_covey import role_covey
        write(args.result, role_covey(args))
    elif args.role == "decode":
        from gpu_covey import role_decode
        write(args.result, role_decode(args))
    else:
        from gpu_trl import role_trl
        write(args.result, role_trl(args))


if __name__ == "__main__":
    main()
