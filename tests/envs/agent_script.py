"""A small agent harness for the tests of `task.source=harness:<command>` (covey/envs/harness.py).

It reads its row from COVEY_TASK (or stdin), asks the model through the `openai` client at OPENAI_BASE_URL with
the calculator offered as a tool and the episode id as `user`, then calls its calculator on the question's
expression (the model's own call where it wrote a readable one), sends the result back as the tool's message in
a second turn, and prints its reward as the last stdout line: 1 when the final answer holds the right number,
0.5 when it holds a digit, else 0.

    python tests/envs/agent_script.py [--mode ok|fail|sleep|silent|noreward|header]   (or the row's `mode` column)

fail: exit 1 after one turn, with a last stderr line; sleep: hang after one turn (the timeout kills it); silent:
exit 0 without asking the model; noreward: print no reward line; header: the episode id in X-Episode-Id.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
import time

from openai import OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> int:
    """+, - and * of integers, nothing else (no eval)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")
    return value(ast.parse(expression, mode="eval").body)


def expression_of(question: str) -> str:
    """'What is 12 * 3?' -> '12 * 3'."""
    match = re.search(r"(\d+\s*[-+*]\s*\d+)", question)
    return match.group(1) if match else "0"


def main() -> int:
    task = json.loads(os.environ.get("COVEY_TASK") or sys.stdin.read())
    mode = task.get("mode") or (sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "ok")
    if mode == "silent":
        return 0
    episode = os.environ["COVEY_EPISODE_ID"]
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    who = {"extra_headers": {"X-Episode-Id": episode}} if mode == "header" else {"user": episode}
    messages = list(task["messages"])
    first = client.chat.completions.create(model=os.environ["COVEY_MODEL"], messages=messages, tools=[CALCULATOR],
                                           max_tokens=6, **who)
    if mode == "fail":
        print("the agent gave up", file=sys.stderr)
        return 1
    if mode == "sleep":
        time.sleep(60)
    reply = first.choices[0].message
    calls = reply.tool_calls or []
    asked = json.loads(calls[0].function.arguments).get("expression", "") if calls else ""
    try:
        result = calculator(asked)
    except (ValueError, SyntaxError):  # the model wrote no usable call: the agent checks the question itself
        result = calculator(expression_of(task["prompt"]))
    messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": str(result)}]
    second = client.chat.completions.create(model=os.environ["COVEY_MODEL"], messages=messages, tools=[CALCULATOR],
                                            max_tokens=6, **who)
    answer = second.choices[0].message.content or ""
    reward = 1.0 if str(task["answer"]) in answer else 0.5 if any(c.isdigit() for c in answer) else 0.0
    if mode != "noreward":
        print(json.dumps({"reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
