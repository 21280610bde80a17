"""The policy server's throughput (docs/environments.md): `--requests` concurrent chat requests from the `openai`
client against the same prompts through the engine directly, in one call; arms interleaved `--rounds` times.

    python -m bench.serve --requests 64 --max-tokens 64 --rounds 2 --out runs/serve"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.harness import interleaved, machine, out_prefix, publish, say, table


def report(args, by_arm: dict) -> str:
    rate = {n: statistics.median(r["tokens"] / r["seconds"] for r in runs) for n, runs in by_arm.items()}
    return "\n".join([f"{args.requests} concurrent chat requests, {args.max_tokens} tokens at most; median of "
                      f"{args.rounds} round(s); {machine()}", "",
                      table(["arm", "tokens/s", "/ direct"], [[n, f"{rate[n]:.0f}", f"{rate[n] / rate['direct']:.2f}"]
                                                            for n in rate])])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct, bf16)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from openai import OpenAI

    from covey.models.default import prepare_default_model
    from covey.models.load import load_policy
    from covey.rollout.fast import FastEngine
    from covey.serve import PolicyServer, ServerOptions, context_length
    model, tok = load_policy(args.model or prepare_default_model(), dtype=torch.bfloat16)
    model.eval()
    engine = FastEngine(model, tok, max_new_tokens=args.max_tokens)
    questions = [f"What is {i} + {2 * i + 3}? Explain briefly." for i in range(args.requests)]
    server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=args.max_tokens,
                                                context_length=context_length(model)))
    client = OpenAI(base_url=server.start() + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(q: str) -> int:
        reply = client.chat.completions.create(model="covey-policy", messages=[{"role": "user", "content": q}],
                                               max_tokens=args.max_tokens)
        return reply.usage.completion_tokens

    def direct() -> int:
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                   for q in questions]
        return int(engine.generate(prompts, 1).response_mask.sum())

    def run_one(name: str, tag: str) -> dict:
        t0 = time.perf_counter()
        if name == "server":
            with ThreadPoolExecutor(args.requests) as pool:
                tokens = sum(pool.map(ask, questions))
        else:
            tokens = direct()
        out = {"tokens": tokens, "seconds": time.perf_counter() - t0}
        say(f"{name}{tag}: {tokens} tokens in {out['seconds']:.1f} s")
        return out

    try:
        by_arm = interleaved(["direct", "server"], args.rounds, run_one)
    finally:
        server.close()
    text = report(args, by_arm)
    publish(out_prefix(args.out, "serve"), text, {"arms": by_arm})


if __name__ == "__main__":
    main()
