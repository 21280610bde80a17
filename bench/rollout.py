"""Long rollouts (docs/results.md): covey's engine in calls that wait for their longest row (`batch`), through slots
refilled as rows end (`slots`: per-slot buffers; `paged`: KV blocks, as many rows as they hold), with n-gram
speculation (`spec`), against transformers' continuous batching (`cb`, per-request budgets, its paged cache) and HF
`generate` (`hf`), arms interleaved `--rounds` times. Workloads: `tail`,
word-problem prompts whose rows stop at budgets drawn long-tailed (mean/max about 0.2, end-of-sequence ignored);
`reason`, word problems asked to reason step by step, ending where the model ends them.

    python -m bench.rollout --rows 256 --slots 64 --rounds 2 --out runs/rollout   # memory-bound: 64 rows fit
    python -m bench.rollout --rows 64 --slots 64 --workload reason --arms batch,slots,paged,spec,cb"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch

from bench.harness import interleaved, machine, out_prefix, publish, say, table
from bench.workloads import SHAPES, build_model

REASON = " Reason step by step, one short sentence per step, then write 'Answer: <number>'."


@dataclass
class Rows:
    """A workload's rows: each one's rendered prompt (G consecutive rows share one), its token budget, and whether
    end-of-sequence ends rows."""
    prompts: list[str]
    budgets: list[int]
    eos: bool
    group: int


def rows_of(tok, workload: str, rows: int, max_new: int, group: int) -> Rows:
    from covey.config import load_config
    from covey.tasks.data import format_prompts, load_task_data
    cfg = load_config(None, ["task.name=wordproblems", "task.word_steps=2", f"task.train_size={rows}"])
    examples = load_task_data(cfg.task, 0).train[:rows // group]
    texts = format_prompts(tok, [replace(e, prompt=e.prompt + (REASON if workload == "reason" else ""))
                                 for e in examples])
    texts = [t for t in texts for _ in range(group)]
    if workload == "reason":
        return Rows(texts, [max_new] * len(texts), True, group)
    g = torch.Generator().manual_seed(0)  # log-normal lengths, sigma 1: mean/max about 0.2 once capped
    lengths = (torch.randn(len(texts), generator=g) + torch.log(torch.tensor(max_new * 0.13))).exp()
    return Rows(texts, lengths.clamp(8, max_new).round().long().tolist(), False, group)


def fast_arm(model, tok, rows: Rows, slots: int, speculate: int, calls: int, paged: bool = False) -> dict:
    """Calls of `calls` rows; `slots` > 0: through that many slots (useful row-steps: busy slots over slots x steps,
    KV per token: the buffers over the mean tokens they hold) or KV blocks (`paged`: useful, tokens in flight over
    each row's block positions; KV per token, blocks in use over them); 0: each call's rows wait for its longest."""
    from covey.rollout.fast import FastEngine
    prompts, budgets, g = rows.prompts, rows.budgets, rows.group
    engine = FastEngine(model, tok, max_new_tokens=max(budgets), slots=slots, speculate=speculate,
                        ignore_eos=not rows.eos, paged=paged)
    tokens = busy = room = kv = drafted = accepted = preempted = widest = 0
    per_token = []
    for start in range(0, len(prompts), calls):
        out = engine.generate(prompts[start:start + calls:g], g, budgets=budgets[start:start + calls])
        lengths, st = out.response_mask.sum(1), engine.slot_stats
        tokens += int(lengths.sum())
        if paged:
            busy, room, preempted = busy + st.token_columns, room + st.row_block_columns, preempted + st.preempted
        elif slots or speculate:
            busy, room = busy + st.row_steps, room + min(slots or len(lengths), len(lengths)) * st.steps
        else:
            busy, room = busy + int(lengths.sum()), room + len(lengths) * int(lengths.max())
        if slots or speculate:
            kv, per_token, widest = max(kv, st.cache_bytes), [*per_token, st.kv_bytes_per_token], st.widest
            drafted, accepted = drafted + st.drafted, accepted + st.accepted
        else:
            kv = max(kv, engine.cache_bytes)
    return {"tokens": tokens, "useful": busy / room, "kv_mib": kv / 2**20, "preempted": preempted,
            "widest": widest or None, "kv_per_token": statistics.mean(per_token) if per_token else None,
            "accepted": accepted / drafted if drafted else None}


def cb_arm(model, tok, prompts, budgets, eos: bool) -> dict:
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=max(budgets),
                              eos_token_id=tok.eos_token_id if eos else len(tok) + 7, pad_token_id=tok.pad_token_id)
    done = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(tok(p, add_special_tokens=False)["input_ids"], max_new_tokens=b)
               for p, b in zip(prompts, budgets)]
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
    return {"tokens": sum(done.values()), "useful": None, "kv_mib": None, "kv_per_token": None}


def hf_arm(model, tok, prompts, budgets, eos: bool, calls: int) -> dict:
    tokens = row_steps = 0
    for start in range(0, len(prompts), calls):
        chunk, limit = prompts[start:start + calls], budgets[start:start + calls]
        enc = tok(chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, max_new_tokens=max(limit), pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id if eos else len(tok) + 7)[:, enc["input_ids"].shape[1]:]
        ended = (out == tok.eos_token_id).int().cumsum(1) == 0 if eos else torch.ones_like(out, dtype=torch.bool)
        lengths = torch.minimum(ended.sum(1) + int(eos), torch.tensor(limit))
        tokens, row_steps = tokens + int(lengths.sum()), row_steps + len(chunk) * out.shape[1]
    return {"tokens": tokens, "useful": tokens / row_steps, "kv_mib": None, "kv_per_token": None}


def report(args, by_arm: dict, names: list[str], budgets: list[int]) -> str:
    """The run's table: tokens/s (median over rounds) and its ratio to the first arm, the first round's rest."""
    rate = {n: statistics.median(r["tokens"] / r["seconds"] for r in by_arm[n]) for n in names}
    cell = lambda value, fmt: "-" if value is None else format(value, fmt)  # noqa: E731
    rows = [[n, f"{rate[n]:.0f}", f"{rate[n] / rate[names[0]]:.2f}", cell(by_arm[n][0]["useful"], ".0%"),
             cell(by_arm[n][0]["kv_per_token"], ".0f"), cell(by_arm[n][0]["kv_mib"], ".0f"),
             cell(by_arm[n][0].get("accepted"), ".0%"), cell(by_arm[n][0].get("widest"), "d")] for n in names]
    return "\n".join([f"{args.workload}: {args.rows} rows ({args.group} per prompt), KV budget {args.slots} rows x "
                      f"{args.max_new} tokens, "
                      f"{sum(budgets) / len(budgets):.0f} mean budget; median of {args.rounds} round(s); {machine()}",
                      "", table(["arm", "tokens/s", f"/ {names[0]}", "useful row-steps", "KV bytes / token in flight",
                                 "KV MiB", "drafts accepted", "most rows at once"], rows)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("tail", "reason"), default="tail")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--slots", type=int, default=64, help="rows the KV budget holds at full length")
    p.add_argument("--group", type=int, default=8, help="rows per prompt (G); --rows and --slots its multiples")
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--arms", default="batch,slots,paged,spec,cb", help="from batch, slots, paged, spec, cb, hf")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct, bf16)")
    p.add_argument("--shape", default="", choices=("", *SHAPES), help="random weights, --model's tokenizer")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.rows % args.group or args.slots % args.group:
        p.error("--rows and --slots must be multiples of --group")
    from covey.models.default import prepare_default_model
    from covey.models.load import load_policy
    folder, scratch = args.model or prepare_default_model(), tempfile.TemporaryDirectory(prefix="bench-rollout-")
    if args.shape:  # e.g. 1.5b: Qwen2.5-1.5B's shape in bf16, end-of-sequence past the vocabulary (never sampled)
        build_model(args.shape, scratch.name, folder, "gpu")
    model, tok = load_policy(scratch.name if args.shape else folder, dtype=torch.bfloat16,
                             device="cuda" if torch.cuda.is_available() else "cpu")
    model.eval()
    rows = rows_of(tok, args.workload, args.rows, args.max_new, args.group)
    prompts, budgets, eos, s = rows.prompts, rows.budgets, rows.eos, args.slots
    runs = {"batch": lambda: fast_arm(model, tok, rows, 0, 0, s),
            "slots": lambda: fast_arm(model, tok, rows, s, 0, len(prompts)),
            "paged": lambda: fast_arm(model, tok, rows, s, 0, len(prompts), paged=True),
            "spec": lambda: fast_arm(model, tok, rows, s, 4, len(prompts)),
            "cb": lambda: cb_arm(model, tok, prompts, budgets, eos),
            "hf": lambda: hf_arm(model, tok, prompts, budgets, eos, s)}

    def run_one(name: str, tag: str) -> dict:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = runs[name]()
        out["seconds"] = time.perf_counter() - t0
        say(f"{name}{tag}: {out['tokens']} tokens in {out['seconds']:.1f} s")
        return out

    names = args.arms.split(",")
    by_arm = interleaved(names, args.rounds, run_one)
    text = report(args, by_arm, names, budgets)
    publish(out_prefix(args.out, "rollout"), text, {"arms": by_arm, "budgets": budgets})


if __name__ == "__main__":
    main()
