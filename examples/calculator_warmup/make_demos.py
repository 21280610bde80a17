"""Calculator exchanges for a supervised warm-up before GRPO with the calculator (docs/distillation.md,
"A tool warm-up instead of demonstrations").

    python examples/calculator_warmup/make_demos.py --out calculator_demos.jsonl --count 32 --seed 0
    covey train task.name=wordproblems rollout.max_new_tokens=64 train.max_minutes=15 train.seed=0 \
      rollout.tools=calculator reward.tool_use=0.2 rollout.max_turns=3 \
      sft.data=calculator_demos.jsonl sft.num_steps=16 sft.batch_size=2

Each row is one word problem solved with one calculator call, in TRL's form (`sft.data`, docs/distillation.md):
`messages` (the prompt's system and user messages, the assistant's call, the calculator's reply, the assistant's
answer ending "#### <number>") and `tools` (the calculator's schema). The prompt messages are those of the RL
phase's episodes without `rollout.tool_demo`: covey's own `Agent.prompts` builds them for the model's tokenizer
(`--model`), so a chat template that does not show `tools=` (SmolLM2's) gets the same system prompt teaching the
call format that the episodes get. The call is the problem's stored expression, written as
`rollout.tool_demo=builtin`'s worked exchanges write theirs (`<tool_call>{"name": "calculator", "arguments":
{"expression": "3 * 12 - 7"}}</tool_call>` once the SFT path puts it in the content); the reply is what covey's
episode runner gets from the real calculator (`run_tool_calls`). A reply other than the problem's answer
stops the script: the row would teach a wrong sum.

The problems are the first `--count` of the training split that `task.name=wordproblems` draws for
`train.seed=--seed` and `task.word_steps=--steps` (covey/tasks/wordproblems.py, `wordproblem_splits`): the
split keeps every sum whose seeded hash sends it to the held-out side out of training, so no problem here, nor
its sum, is in that run's held-out evaluation. Use the run's own `train.seed`: another seed hashes the sums
differently. Deterministic in its arguments.

Why an example script and not a module of covey: the exact RL prompt comes from the episodes' `Agent`
(covey/rollout, layer 3), which the task generators (covey/tasks, layer 1) may not import, and covey's CLI holds
one module per `covey` command; this script puts those public pieces together, as a user would.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from covey.models.load import load_tokenizer, resolve_model_path
from covey.rollout.agents import Agent
from covey.rollout.tools import ToolCall, run_tool_calls
from covey.tasks.base import Example
from covey.tasks.tools import calculator
from covey.tasks.wordproblems import wordproblem_splits

DEFAULT_COUNT = 200
TOOL_TIMEOUT_S = 10.0  # rollout.tool_timeout_s's default
_EACH = re.compile(r"How many (\w+) does each friend get\?$")
_HAVE = re.compile(r"How many (\w+) does (\w+) have now\?$")


class DemoError(ValueError):
    """A problem whose exchange cannot be written (the calculator's reply is not its answer)."""


def training_problems(count: int, seed: int, steps: int = 1) -> list[Example]:
    """The first `count` problems of the training split of task.name=wordproblems at train.seed=`seed`."""
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    train, _ = wordproblem_splits(count, 0, seed, steps=steps)
    return train


def spaced(expression: str) -> str:
    """The expression as the built-in worked exchanges write theirs: '3*12 - 7' -> '3 * 12 - 7', and a lone
    number's parentheses dropped, '(56) / 8' -> '56 / 8'."""
    return re.sub(r"\((\d+)\)", r"\1", re.sub(r"\s*\*\s*", " * ", expression))


def answer_text(example: Example) -> str:
    """The final turn: one sentence that answers the question, then the marked answer the verifier reads."""
    n = example.answer
    each, have = _EACH.search(example.prompt), _HAVE.search(example.prompt)
    sentence = (f"Each friend gets {n} {each.group(1)}." if each
                else f"{have.group(2)} has {n} {have.group(1)} now." if have else f"The answer is {n}.")
    return f"{sentence}\n#### {n}"


def exchange(agent: Agent, example: Example, system_prompt: str = "") -> dict:
    """One row: the episode's prompt messages, the calculator call, its real reply, the answer; and the schemas."""
    prompt = agent.prompts([example], system_prompt)[0]
    call = ToolCall("calculator", {"expression": spaced(example.meta["expression"])})
    reply = run_tool_calls(agent.toolbox, [call], TOOL_TIMEOUT_S)[0]
    if reply["content"] != example.answer:
        raise DemoError(f"calculator({call.arguments['expression']!r}) gave {reply['content']!r}, but the answer "
                        f"of {example.prompt!r} is {example.answer}")
    messages = [*prompt.messages, {"role": "assistant", "content": "", "tool_calls": [call.as_dict()]},
                reply, {"role": "assistant", "content": answer_text(example)}]
    return {"messages": messages, "tools": agent.schemas_of(example)}


def make_rows(tokenizer, count: int = DEFAULT_COUNT, seed: int = 0, steps: int = 1,
              system_prompt: str = "") -> list[dict]:
    """`count` exchanges for the model whose tokenizer is given (its chat template decides how tools are shown)."""
    agent = Agent(tokenizer, [calculator], TOOL_TIMEOUT_S)
    return [exchange(agent, ex, system_prompt) for ex in training_problems(count, seed, steps)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the .jsonl file to write (sft.data)")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="exchanges (problems) to write")
    parser.add_argument("--seed", type=int, default=0, help="the RL run's train.seed")
    parser.add_argument("--steps", type=int, default=1, help="the RL run's task.word_steps")
    parser.add_argument("--model", default="default", help="the RL run's model.path")
    parser.add_argument("--system-prompt", default="", help="the RL run's task.system_prompt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        rows = make_rows(tokenizer, args.count, args.seed, args.steps, args.system_prompt)
    except (ValueError, OSError) as e:  # covey's errors (model, tool, task) are ValueErrors with one line
        print(f"make_demos: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"make_demos: {len(rows)} calculator exchanges -> {out} (the first {len(rows)} training problems of "
          f"task.name=wordproblems at train.seed={args.seed}, task.word_steps={args.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
