"""The cost of a tool turn to the fast engine (docs/results.md): the same greedy tool episodes by its episode loop (the
reply fed into a waiting row's cache) and turn by turn (each turn a prefill of the episode so far), against one turn;
each episode that ends its first turn calls a scripted tool, then answers. The arms run interleaved `--rounds` times.

    python -m bench.episodes --rounds 3 --out runs/episodes   # SmolLM2-135M-Instruct, 8 x 8 episodes"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.harness import interleaved, machine, publish, sync, table

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


def arms(model_path: str, device: str, prompts_n: int, group: int, turn_tokens: int) -> dict:
    from covey.config import load_config
    from covey.models.load import load_policy
    from covey.rollout.agents import Agent
    from covey.rollout.episodes import EpisodeOptions, run_episodes
    from covey.rollout.local import DecodeOptions, local_engine
    from covey.rollout.precision import resolve_precision
    from covey.rollout.tools import tool_messages_ids
    from covey.tasks.data import load_task_data
    from covey.tasks.tools import calculator

    model, tok = load_policy(model_path, device=device)
    loop, turns = (local_engine("fast", model, tok, max_new_tokens=turn_tokens, decode=DecodeOptions(mode),
                                precision=resolve_precision("auto", device)) for mode in ("plain", "auto"))
    agent = Agent(tok, [calculator], timeout_s=10.0)
    cfg = load_config(None, ["task.name=wordproblems", f"task.train_size={max(prompts_n, 8)}"])
    prompts = agent.prompts(load_task_data(cfg.task, 0).train[:prompts_n])
    history = [*prompts[0].messages, {"role": "assistant", "content": "x"},
               {"role": "tool", "name": "calculator", "content": REPLY}]
    reply = tool_messages_ids(tok, history, agent.template_tools(prompts[0].example))
    options = EpisodeOptions(max_turns=2, max_turn_tokens=turn_tokens,
                             max_episode_tokens=2 * turn_tokens + len(reply) + 1)

    def hosts() -> list[ScriptedHost]:
        return [ScriptedHost(reply) for _ in range(len(prompts) * group)]

    def sample(batch, g, budget):
        return turns.generate(batch, g, greedy=True, max_new_tokens=budget)

    return {"single turn": lambda: turns.generate(prompts, group, greedy=True),
            "episodes, loop": lambda: loop.decode_episodes(prompts, group, hosts(), options, greedy=True)[0],
            "episodes, turn by turn": lambda: run_episodes(sample, tok, prompts, group, hosts(), options)[0]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="model path (default: covey's default model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 x 2 episodes of turns of 8 tokens, 1 round")
    p.add_argument("--out", default="", help="write the report here as .md and .json")
    args = p.parse_args(argv)
    prompts, group, turn_tokens, rounds = (2, 2, 8, 1) if args.smoke else (8, 8, 64, args.rounds)
    calls, tokens = arms(args.model, args.device, prompts, group, turn_tokens), {}
    calls["single turn"]()  # warm-up: first calls allocate buffers (and capture graphs on a GPU)

    def timed(name: str, tag: str) -> float:
        sync()
        start = time.perf_counter()
        rollout = calls[name]()
        sync()
        seconds, model_tokens = time.perf_counter() - start, int(rollout.response_mask.sum())
        tokens[name] = (model_tokens, int(rollout.response_attended.sum()) - model_tokens)
        return seconds

    times = interleaved(list(calls), rounds, timed)
    single = statistics.median(times["single turn"])
    text = "\n".join([f"{machine()}, device {args.device}", f"{prompts} prompts x {group} episodes, turns of up to "
                      f"{turn_tokens} tokens, greedy, medians of {rounds} interleaved rounds", "",
                      table(["arm", "median s", "model tokens", "tool tokens", "s over the single turn"],
                            [[name, f"{statistics.median(ts):.2f}", *tokens[name],
                              f"{statistics.median(ts) - single:+.2f}"] for name, ts in times.items()])])
    result = {"times": times, "tokens": tokens, "episodes": prompts * group}
    if args.out:
        publish(Path(args.out), text, result)
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
