"""The cost of a tool turn to the fast engine: the same greedy tool episodes run by its episode loop
(a waiting row stands aside, the reply is fed into the row's cache) and turn by turn (every turn a
prefill of the episode so far; on a GPU through the CUDA-graph engine), against one turn without tools.

    python -m bench.episodes                         # SmolLM2-135M-Instruct, word problems, this device
    python -m bench.episodes --smoke                 # the tiny model, seconds: the pipeline only

Every episode calls a scripted tool after its first turn when that turn ends (not when it is cut), the
reply is the chat template's rendering of a short tool message, and the model then answers: two model
turns and one reply per episode. The arms run interleaved, `--rounds` times; the report gives each arm's
median seconds, the model's and the tools' tokens, and the extra seconds of the episodes over the single
turn. Greedy, so both episode arms produce the same tokens (tests/rollout/test_fast_episodes.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import machine, publish, sync
from bench.report import table

REPLY = "The calculator returned 1234."


class ScriptedHost:
    """One tool call after the first turn, answered by REPLY rendered with the chat template."""

    def __init__(self, reply_ids: list[int]):
        self.reply_ids, self.turn = reply_ids, 0

    def calls_in(self, text: str) -> list:
        self.turn += 1
        return [{"name": "calculator", "arguments": {"expression": "1 + 1"}}] if self.turn == 1 else []

    def reply(self, calls) -> list[dict]:
        return [{"role": "tool", "name": "calculator", "content": REPLY}]

    def append_ids(self, messages) -> list[int]:
        return list(self.reply_ids)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model path (default: covey's default model; --smoke: the tiny one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the tiny model, 2 x 2 episodes, 1 round")
    p.add_argument("--out", default="", help="write the report here as .md and .json")
    args = p.parse_args(argv)
    if args.smoke:  # again, with the smoke run's defaults
        p.set_defaults(prompts=2, group=2, rounds=1, turn_tokens=8)
        args = p.parse_args(argv)
    return args


def smoke_model() -> str:
    """The tiny random model with every id an end of a turn (its saved generation config's end-of-sequence
    ids): a random model never stops otherwise, and the tool is called after a turn that ends."""
    from transformers import AutoTokenizer, GenerationConfig

    from covey.models.tiny import build_tiny_model
    folder = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    tok = AutoTokenizer.from_pretrained(folder)
    GenerationConfig(eos_token_id=list(range(len(tok))), pad_token_id=tok.pad_token_id).save_pretrained(folder)
    return str(folder)


def build(args):
    """(episode-loop engine, turn-by-turn engine, tokenizer, prompts, reply ids) as a training run samples."""
    from covey.config import load_config
    from covey.models.load import load_policy
    from covey.rollout.agents import Agent
    from covey.rollout.local import DecodeOptions, local_engine
    from covey.rollout.precision import resolve_precision
    from covey.rollout.tools import tool_messages_ids
    from covey.tasks.data import load_task_data
    from covey.tasks.tools import calculator

    model, tok = load_policy(args.model or (smoke_model() if args.smoke else "default"), device=args.device)
    precision = resolve_precision("auto", args.device)
    engines = [local_engine("fast", model, tok, max_new_tokens=args.turn_tokens, precision=precision,
                            decode=DecodeOptions(mode)) for mode in ("plain", "auto")]
    cfg = load_config(None, ["task.name=wordproblems", f"task.train_size={max(args.prompts, 8)}"])
    agent = Agent(tok, [calculator], timeout_s=10.0)
    prompts = agent.prompts(load_task_data(cfg.task, 0).train[:args.prompts])
    history = [*prompts[0].messages, {"role": "assistant", "content": "x"},
               {"role": "tool", "name": "calculator", "content": REPLY}]
    return engines, tok, prompts, tool_messages_ids(tok, history, agent.template_tools(prompts[0].example))


def main(argv: list[str] | None = None) -> dict:
    from covey.rollout.episodes import EpisodeOptions, run_episodes

    args = parse_args(argv)
    (loop_engine, turn_engine), tok, prompts, reply_ids = build(args)
    options = EpisodeOptions(max_turns=2, max_turn_tokens=args.turn_tokens,
                             max_episode_tokens=2 * args.turn_tokens + len(reply_ids) + 1)
    n = len(prompts) * args.group

    def hosts() -> list[ScriptedHost]:
        return [ScriptedHost(reply_ids) for _ in range(n)]

    def sample(batch, g, budget):
        return turn_engine.generate(batch, g, greedy=True, max_new_tokens=budget)

    arms = {"single turn": lambda: (turn_engine.generate(prompts, args.group, greedy=True), None),
            "episodes, loop": lambda: loop_engine.decode_episodes(prompts, args.group, hosts(), options, greedy=True),
            "episodes, turn by turn": lambda: run_episodes(sample, tok, prompts, args.group, hosts(), options)}
    times, tokens = {name: [] for name in arms}, {}
    arms["single turn"]()  # warm-up: first calls allocate buffers (and capture graphs on a GPU)
    for _ in range(args.rounds):
        for name, arm in arms.items():
            sync()
            start = time.perf_counter()
            rollout, _ = arm()
            sync()
            times[name].append(time.perf_counter() - start)
            model_tokens = int(rollout.response_mask.sum())
            tokens[name] = (model_tokens, int(rollout.response_attended.sum()) - model_tokens)
    single = statistics.median(times["single turn"])
    text = "\n".join([f"{machine()}, device {args.device}", f"{args.prompts} prompts x {args.group} episodes, turns "
                      f"of up to {args.turn_tokens} tokens, greedy, medians of {args.rounds} interleaved rounds", "",
                      table(["arm", "median s", "model tokens", "tool tokens", "s over the single turn"],
                            [[name, f"{statistics.median(ts):.2f}", *tokens[name],
                              f"{statistics.median(ts) - single:+.2f}"] for name, ts in times.items()])])
    result = {"times": times, "tokens": tokens, "episodes": n}
    if args.out:
        publish(Path(args.out), text, result)
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
