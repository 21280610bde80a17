"""An in-process chat harness for the verifiers tests (verifiers 0.4's `vf.Harness`): each segment is one chat call
through the rollout's interception endpoint (verifiers' built-in harnesses run programs that `uv` provisions from
the network; this one runs in the test's process, which verifiers allows: the interception is the contract).

`ChatHarness` sends the task's prompt (or, resumed, the conversation so far) and ends; `CalculatorHarness` offers
a calculator tool, runs it on the model's call (or on the question's expression when the model wrote none: the
tiny test model writes none) and sends its result back as the tool's message in a second call.
"""

from __future__ import annotations

import json
import re

import verifiers.v1 as vf
from openai import AsyncOpenAI

MAX_TOKENS = 6
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a + b, a - b or a * b.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> int | None:
    match = re.fullmatch(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*", expression or "")
    if not match:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def wire(harness: vf.Harness, data: vf.TaskData) -> list[dict]:
    """The segment's prompt as chat messages (the system prompt first)."""
    system, prompt = harness.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    return [*messages, *(m.model_dump(mode="json", exclude_none=True) for m in prompt or [])]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await self.converse(client, ctx.model, wire(self, data))
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def converse(self, client: AsyncOpenAI, model: str, messages: list[dict]) -> None:
        await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS)


class CalculatorHarness(ChatHarness):
    async def converse(self, client: AsyncOpenAI, model: str, messages: list[dict]) -> None:
        first = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                     max_tokens=MAX_TOKENS)
        reply = first.choices[0].message
        calls = reply.tool_calls or []
        asked = json.loads(calls[0].function.arguments).get("expression", "") if calls else ""
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        result = calculate(asked)
        if result is None:  # no usable call: the harness checks the question itself
            found = re.search(r"\d+\s*[-+*]\s*\d+", question)
            result = calculate(found.group(0) if found else "")
        call_id = calls[0].id if calls else "call_0"
        assistant = {"role": "assistant", "content": reply.content or "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": json.dumps(
                {"expression": asked})}}]}
        await client.chat.completions.create(
            model=model, tools=[CALCULATOR], max_tokens=MAX_TOKENS,
            messages=[*messages, assistant, {"role": "tool", "tool_call_id": call_id, "content": str(result)}])
