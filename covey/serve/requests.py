"""Request bodies read into typed requests, or refused in one line (`RequestError`, 400).

The server follows OpenAI's schema for what it supports and refuses, by name, what it does not do
(streaming, penalties, logit biases, top log-probs, several prompts in one request) rather than ignore
it; vLLM's `return_token_ids` and `return_tokens_as_token_ids` extensions are read. Keys it does not
know (`model`, `metadata`, `store`, ...) are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from covey.serve.options import RequestError, ServerOptions

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOPS = 8
NEUTRAL = {  # a parameter the engine does not take, and the values that mean "not used"
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "min_tokens": (None, 0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0), "prediction": (None,),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
}


@dataclass(frozen=True)
class Sampling:
    """What one request asks of the engine and of the response."""

    n: int = 1
    max_tokens: int | None = None
    """None: the server's max_new_tokens."""
    greedy: bool = False
    seed: int | None = None
    """None: the server draws one (recorded in the episode trace)."""
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    token_ids: bool = False
    """vLLM's return_token_ids: prompt_token_ids on the response, token_ids on each choice."""
    tokens_as_ids: bool = False
    """vLLM's return_tokens_as_token_ids: each log-prob's token written "token_id:<id>"."""


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    parse_tools: bool
    """tool_choice is not "none": the model's tool calls become the message's tool_calls."""
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling


# --------------------------------------------------------------------------- values


def integer(body: dict, key: str, low: int, high: int | None = None, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise RequestError(f"'{key}' must be an integer {bound}, not {json.dumps(value)[:80]}")
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, not {json.dumps(value)[:80]}")
    return value


def number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{key}' must be a number, not {json.dumps(value)[:80]}")
    return float(value)


def token_ids(value, key: str, vocab_size: int) -> list[int]:
    """A non-empty list of token ids below `vocab_size`."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise RequestError(f"'{key}' must be a non-empty list of token ids (integers)")
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"'{key}' holds token id {bad}, outside the vocabulary of {vocab_size}")
    return list(value)


# --------------------------------------------------------------------------- sampling


def greedy_of(body: dict, options: ServerOptions) -> bool:
    """temperature 0 is greedy; omitted or the engine's own samples; anything else is refused."""
    temperature = number(body, "temperature")
    top_p = number(body, "top_p")
    if top_p is not None and not math.isclose(top_p, options.top_p, abs_tol=1e-6):
        raise RequestError(f"top_p {top_p:g} differs from the engine's {options.top_p:g}: omit it or send "
                           f"{options.top_p:g}")
    if temperature is None or math.isclose(temperature, options.temperature, abs_tol=1e-6):
        return False
    if temperature == 0:
        return True
    raise RequestError(f"temperature {temperature:g} differs from the engine's {options.temperature:g}: one engine "
                       f"samples at one temperature; omit it, send {options.temperature:g}, or 0 for greedy")


def stops_of(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


def refuse_unsupported(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("'stream' is not supported: send stream=false (the whole answer comes at once)")
    for key, neutral in NEUTRAL.items():
        if key in body and body[key] not in neutral:
            raise RequestError(f"'{key}' is not supported: the engine samples from softmax(logits / temperature) "
                               "as it was built; omit it")


def sampling_of(body: dict, options: ServerOptions, logprobs: bool) -> Sampling:
    """The sampling settings of a request body (the route has read its own `logprobs` key)."""
    refuse_unsupported(body)
    max_tokens = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
    return Sampling(n=integer(body, "n", 1, options.max_n, 1), max_tokens=max_tokens,
                    greedy=greedy_of(body, options), seed=integer(body, "seed", -(2**63), 2**63 - 1),
                    stop=stops_of(body), logprobs=logprobs, token_ids=flag(body, "return_token_ids"),
                    tokens_as_ids=flag(body, "return_tokens_as_token_ids"))


# --------------------------------------------------------------------------- messages


def text_content(content, where: str) -> str:
    """A message's content as text: a string, None (''), or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") not in ("text", None) or not isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"{where}: only text content parts are supported")
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}: 'content' must be a string, null or a list of text parts")


def tool_call_of(call, where: str) -> dict:
    """An assistant message's tool call as chat templates read it: arguments as an object where they parse."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where}: a tool call is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"arguments\": ...}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {**out, "id": call["id"]} if isinstance(call.get("id"), str) else out


def message_of(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{where} must be an object with a role in {', '.join(sorted(ROLES))}")
    out = {k: v for k, v in message.items() if k in ("name", "tool_call_id") and isinstance(v, str)}
    out["role"] = "system" if message["role"] == "developer" else message["role"]
    out["content"] = text_content(message.get("content"), where)
    calls = message.get("tool_calls")
    if calls:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(f"{where}: 'tool_calls' is a list, on an assistant message")
        out["tool_calls"] = [tool_call_of(c, where) for c in calls]
    return out


def tools_of(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return tools


def chat_request(body: dict, options: ServerOptions) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of chat messages")
    top = integer(body, "top_logprobs", 0, 20, 0)
    if top:
        raise RequestError(f"top_logprobs={top} is not supported: the engine returns the log-prob of the sampled "
                           "token only; send 0 or omit it")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {json.dumps(choice)[:80]} is not supported: the model decides (\"auto\"), "
                           "or \"none\"")
    return ChatRequest([message_of(m, i) for i, m in enumerate(messages)], tools_of(body), choice != "none",
                       sampling_of(body, options, flag(body, "logprobs")))


def completion_request(body: dict, options: ServerOptions, vocab_size: int) -> CompletionRequest:
    """POST /v1/completions: one prompt, a text or its token ids. `logprobs` is OpenAI's integer: 0 returns
    the sampled tokens' log-probs; more (top alternatives) is refused."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("one prompt per request (send several requests: the server batches them)")
    if not isinstance(prompt, (str, list)) or not prompt:
        raise RequestError("'prompt' must be a non-empty text or list of token ids")
    top = integer(body, "logprobs", 0, 20)
    if top:
        raise RequestError(f"logprobs={top} is not supported: the engine returns the log-prob of the sampled "
                           "token only; send logprobs=0 for it")
    prompt = prompt if isinstance(prompt, str) else token_ids(prompt, "prompt", vocab_size)
    return CompletionRequest(prompt, sampling_of(body, options, top is not None))


def continue_request(body: dict, options: ServerOptions, vocab_size: int) -> CompletionRequest:
    """POST /v1/continue: the exact ids so far ({"prompt_token_ids": [...]}); always ids and log-probs back."""
    ids = token_ids(body.get("prompt_token_ids"), "prompt_token_ids", vocab_size)
    sampling = sampling_of({k: v for k, v in body.items() if k != "return_token_ids"}, options, True)
    return CompletionRequest(ids, replace(sampling, token_ids=True))


def episode_of(header: str | None, body: dict) -> str | None:
    """The episode a call belongs to: the X-Episode-Id header, else the body's `user`; None: none."""
    value = header if header else body.get("user")
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 256 or not value.isprintable():
        raise RequestError("an episode id (X-Episode-Id or 'user') is printable text of at most 256 characters")
    return value
