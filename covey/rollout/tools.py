"""Tools for multi-turn episodes in TRL's conventions (docs/agents.md): ``Toolbox`` (functions and/or a TRL
environment, their schemas, ``ToolStats``), ``start_episode``, tool calls in the model's format
(``find_tool_calls``), running them where every failure is a tool message (``run_tool_calls``), and the ids the
tool messages append after the sampled ids, from the chat template (``tool_messages_ids``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

try:  # transformers' response parsing (response_template), from transformers 5.13
    from transformers.utils.chat_parsing import parse_response
    from transformers.utils.chat_parsing.response_templates import load_response_template
except ImportError:  # an older transformers 5: covey reads the <tool_call> tags itself
    parse_response = load_response_template = None

from covey.rewards.combine import describe_exception, run_to_end
from covey.runtime.errors import first_line

TOOL_CALL_FORMATS = ("qwen", "tags")
MAX_TOOL_CHARS = 4000       # a tool result longer than this is cut, and the cut is said in the message
MAX_CALLS_PER_TURN = 16     # calls after these in one turn are answered with an error, not run
ENVIRONMENT_RESERVED = ("reset", "get_reward", "turn_reward")
_TAGS_TEMPLATE = {"start_anchor": "<|im_start|>assistant\n", "fields": {  # a transformers response_template
    "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "text"},  # kept raw
    "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>)", "content": "text"}}}
_PROBE = {"type": "function", "function": {"name": "covey_probe", "description": "Probe.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "description": "A number."}}, "required": ["x"]}}}


class ToolError(ValueError):
    """A tool, an environment or a chat template covey cannot use; one line saying what to change."""


@dataclass
class ToolStats:
    """Counters of tool calls. ``errors`` counts every call answered with ``{"error": ...}`` (timeouts included);
    ``timeouts`` those that did not return in time; ``truncated`` results cut to ``max_chars``."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    truncated: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def merge(self, other: ToolStats) -> None:
        with self._lock:
            for key, value in other.as_dict().items():
                setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "errors": self.errors, "timeouts": self.timeouts, "truncated": self.truncated}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote. ``error`` says why its text could not be read (bad JSON, no name); such a call
    is answered with that error by ``run_tool_calls``."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict:
        """The call as an assistant message's ``tool_calls`` item."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# --------------------------------------------------------------------------- toolbox and environments


def tool_schema(function: Callable) -> dict:
    """The JSON schema transformers makes of a function; ToolError naming the function when it cannot."""
    name = getattr(function, "__name__", repr(function)[:60])
    if not callable(function):
        raise ToolError(f"a tool must be a function, not {type(function).__name__} ({name})")
    try:
        return get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException, ValueError, TypeError) as e:
        raise ToolError(f"tool {name}: {first_line(e)}; give it a type hint on every parameter and a Google-style "
                        "docstring (a description, then an Args: line per parameter)") from None


def environment_tools(environment: object) -> list[Callable]:
    """An environment's public methods in definition order (bound): its tools, as TRL's environment_factory."""
    found: dict[str, object] = {}
    for klass in reversed(type(environment).__mro__[:-1]):
        found.update(vars(klass))
    return [getattr(environment, name) for name, attr in found.items()
            if not name.startswith("_") and name not in ENVIRONMENT_RESERVED
            and (inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod)))]


class Toolbox:
    """Tools by name, their schemas (``apply_chat_template(..., tools=toolbox.schemas)``), the environment they
    belong to if any (``in_order``: its tools' names), and the counters of the calls run through it (``stats``)."""

    def __init__(self, tools: Sequence[Callable] = (), environment: object | None = None):
        own = environment_tools(environment) if environment is not None else []
        self.environment = environment
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        self.stats = ToolStats()
        for function in own + list(tools):
            schema = tool_schema(function)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ToolError(f"two tools are named {name!r}; give each tool its own name")
            self.functions[name] = function
            self.schemas.append(schema)
        self.names = list(self.functions)
        self.in_order = set(self.names[:len(own)])

    def reward(self) -> float | None:
        """The environment's ``get_reward()`` for the finished episode; None without an environment or method."""
        get_reward = getattr(self.environment, "get_reward", None)
        value = None if get_reward is None else run_to_end(get_reward())
        return None if value is None else float(value)


def start_episode(factory: Callable[[], object], row: dict, tools: Sequence[Callable] = ()) -> tuple[Toolbox, str]:
    """One environment for one episode, as TRL's ``environment_factory``: ``factory()`` with no arguments, then
    ``reset(**row)`` with every column of the dataset row. Returns its Toolbox (the environment's public
    methods, then ``tools``) and the text reset returned ('' for None), for ``append_to_last_user``."""
    kind = getattr(factory, "__name__", type(factory).__name__)
    try:
        environment = factory()
        text = run_to_end(environment.reset(**row))
    except Exception as e:  # noqa: BLE001 - reported as one line naming the environment
        hint = "; reset receives every column of the row: give it **kwargs" if isinstance(e, TypeError) else ""
        raise ToolError(f"environment {kind}: {describe_exception(e)}{hint}") from e
    return Toolbox(tools, environment=environment), "" if text is None else str(text)


def append_to_last_user(messages: list[dict], text: str) -> list[dict]:
    """A copy of the messages with ``text`` appended to the last user message's content (TRL's reset text)."""
    out = [dict(m) for m in messages]
    if not text:
        return out
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = str(message.get("content", "")) + text
            return out
    raise ToolError("the environment's reset returned text but the prompt has no user message to append it to")


# --------------------------------------------------------------------------- tool-call formats


def find_tool_calls(text: str, format: str | dict = "tags", *, prefix: str = "") -> list[ToolCall]:
    """The tool calls in one assistant turn's text, in order. ``format``: "qwen" or "tags" (both
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), or a transformers ``response_template`` dict
    (``prefix``: the prompt text before the turn, which such a template may need). A call whose text cannot be
    read is a ToolCall with ``error`` set; text without calls gives []."""
    if isinstance(format, dict):
        if load_response_template is None:
            raise ToolError("a response_template format needs transformers >= 5.13 (its response parsing)")
        template = load_response_template(format)
        try:
            items = parse_response(text, template, prefix=prefix).get("tool_calls") or []
        except Exception as e:  # noqa: BLE001 - a model's malformed call is an answer, not a crash
            return [ToolCall("", error=f"could not read the tool calls: {first_line(e)}")]
        return [_call_from_object(item.get("function", item) if isinstance(item, dict) else item)
                for item in items]
    if format not in TOOL_CALL_FORMATS:
        raise ToolError(f"unknown tool-call format {format!r}; choose one of {', '.join(TOOL_CALL_FORMATS)} "
                        "or pass a transformers response_template dict")
    if parse_response is None:
        raw = [m.strip() for m in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.DOTALL)]
    else:
        raw = parse_response(text, _TAGS_TEMPLATE, prefix="").get("tool_calls") or []
    return [_call_from_text(r) for r in raw]


def _call_from_text(raw: str) -> ToolCall:
    try:
        return _call_from_object(json.loads(raw))
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {raw[:200]}")


def _call_from_object(obj) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='a tool call is a JSON object {"name": ..., "arguments": {...}}, not '
                                  f"{json.dumps(obj, default=str)[:200]}")
    name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"the arguments of {name} must be a JSON object, not {str(arguments)[:200]}")
    return ToolCall(name, arguments)


def tool_system_prompt(schemas: Sequence[dict]) -> str:
    """The system-prompt text that teaches the "tags" format: each tool's schema, then how to call one."""
    functions = [s.get("function", s) for s in schemas]
    if not functions:
        raise ToolError("no tools to describe")
    placeholder = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    properties = functions[0].get("parameters", {}).get("properties", {})
    example = {"name": functions[0]["name"], "arguments": {k: placeholder.get(v.get("type"), "...")
                                                           for k, v in properties.items()}}
    return "\n".join(
        ["You can call these tools:"]
        + [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}) for f in functions]
        + ["", "To call a tool, write its name and arguments as JSON between <tool_call> and </tool_call>, like this:",
           f"<tool_call>{json.dumps(example)}</tool_call>",
           "Each result comes back in a message from the tool. Once you know the answer, write it with no tool call."])


def add_tool_system_prompt(messages: list[dict], schemas: Sequence[dict]) -> list[dict]:
    """A copy of the messages with ``tool_system_prompt`` after the system message's text, or as a new one."""
    prompt = tool_system_prompt(schemas)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content', '')}\n\n{prompt}".lstrip()
        return out
    return [{"role": "system", "content": prompt}] + out


def _render(tokenizer, messages: list[dict], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def chat_template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders a ``tools=`` list (it shows the tools to the model)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    messages = [{"role": "user", "content": "Hi"}]
    try:
        rendered = _render(tokenizer, messages, [_PROBE], True)
        return rendered != _render(tokenizer, messages, None, True) and "covey_probe" in rendered
    except Exception:  # noqa: BLE001 - a template that refuses tools does not support them
        return False


def tool_call_format(tokenizer) -> str | dict:
    """The format a model writes its calls in: the tokenizer's own ``response_template`` when it parses tool
    calls; "qwen" when the chat template writes ``<tool_call>{json}</tool_call>``; "tags" when it has no tools.
    ToolError for a template whose tool calls covey does not read."""
    own = getattr(tokenizer, "response_template", None)
    if isinstance(own, dict) and "tool_calls" in own.get("fields", {}):
        return own
    if not chat_template_supports_tools(tokenizer):
        return "tags"
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "covey_probe", "arguments": {"x": 1}}}]}
    rendered = _render(tokenizer, [{"role": "user", "content": "Hi"}, call], [_PROBE], False)
    if re.search(r"<tool_call>\s*\{", rendered) and "covey_probe" in rendered:
        return "qwen"
    raise ToolError("the chat template writes tool calls in a format covey does not read; set the tokenizer's "
                    "response_template (transformers' response parsing) to one that parses tool_calls")


# --------------------------------------------------------------------------- running calls


def run_tool_calls(toolbox: Toolbox, calls: Sequence[ToolCall], timeout_s: float, *,
                   max_chars: int = MAX_TOOL_CHARS, max_calls: int = MAX_CALLS_PER_TURN,
                   stats: ToolStats | None = None) -> list[dict]:
    """One tool message ``{"role": "tool", "name": ..., "content": ...}`` per call, in order. Each call runs in a
    daemon thread with ``timeout_s`` seconds from its start (one still running then is left behind); plain
    functions concurrently, an environment's methods one after another in the order written (they share its
    state). Every failure is ``{"error": ...}`` content, never an exception; a result over ``max_chars`` is cut
    and says so. Counts go to ``stats`` (default: the toolbox's own)."""
    if not timeout_s or timeout_s <= 0:
        raise ToolError(f"the tool timeout must be a positive number of seconds, not {timeout_s!r}")
    slots: list[dict] = [{} for _ in calls]
    concurrent, in_order = [], []
    for i, call in enumerate(calls):
        problem = (_call_problem(toolbox, call) if i < max_calls
                   else f"more than {max_calls} tool calls in one turn; this one was not run")
        if problem:
            slots[i]["error"] = problem
        elif call.name in toolbox.in_order:
            in_order.append(i)
        else:
            concurrent.append((_start(toolbox, call, slots[i]), time.monotonic() + timeout_s))
    busy = None
    for i in in_order:
        if busy:
            slots[i]["error"] = f"not run: the environment is still running {busy}, which did not return in time"
            continue
        worker = _start(toolbox, calls[i], slots[i])
        worker.join(timeout_s)
        busy = calls[i].name if worker.is_alive() else None
    for worker, deadline in concurrent:
        worker.join(max(0.0, deadline - time.monotonic()))
    batch = ToolStats(calls=len(calls))
    messages = [_tool_message(call, dict(slot), timeout_s, max_chars, batch) for call, slot in zip(calls, slots)]
    (stats if stats is not None else toolbox.stats).merge(batch)
    return messages


def _start(toolbox: Toolbox, call: ToolCall, slot: dict) -> threading.Thread:
    worker = threading.Thread(target=_call_into, args=(toolbox.functions[call.name], call.arguments, slot),
                              name=f"covey-tool-{call.name}", daemon=True)
    worker.start()
    return worker


def _call_problem(toolbox: Toolbox, call: ToolCall) -> str | None:
    """Why a call cannot be run (unreadable, unknown tool, arguments that do not fit), or None."""
    if call.error:
        return call.error
    function = toolbox.functions.get(call.name)
    if function is None:
        return f"unknown tool {call.name!r}; the tools are: {', '.join(toolbox.names) or 'none'}"
    try:
        inspect.signature(function).bind(**call.arguments)
    except TypeError as e:
        return f"bad arguments for {call.name}: {e}"
    except ValueError:  # a callable without a signature: let the call itself say
        pass
    return None


def _call_into(function: Callable, arguments: dict, slot: dict) -> None:
    """Run one call in its own thread (an ``async def`` tool on an event loop of its own); fill its slot."""
    try:
        out = function(**arguments)
        slot["value"] = asyncio.run(out) if inspect.iscoroutine(out) else out
    except BaseException as e:  # noqa: BLE001 - SystemExit included: reported as the tool's error
        slot["raised"] = e


def _tool_message(call: ToolCall, slot: dict, timeout_s: float, max_chars: int, stats: ToolStats) -> dict:
    name = call.name
    if "value" in slot:
        content = _as_text(slot["value"])
        if len(content) > max_chars:
            stats.truncated += 1
            content = (content[:max_chars] + f"\n[truncated: the tool returned {len(content)} characters; "
                       f"the first {max_chars} are shown]")
        return {"role": "tool", "name": name, "content": content}
    stats.errors += 1
    if "raised" in slot:
        error = f"{name} {describe_exception(slot['raised'])}"
    elif "error" in slot:
        error = slot["error"]
    else:
        stats.timeouts += 1
        error = f"{name} did not return within {timeout_s:g} s"
    return {"role": "tool", "name": name, "content": json.dumps({"error": error[:1000]})}


def _as_text(value) -> str:
    """Text as it is; dicts, lists and numbers as JSON; anything else as str()."""
    if isinstance(value, (dict, list, tuple, int, float)):
        return json.dumps(value, default=str, ensure_ascii=False)
    return value if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------- rendering


def tool_messages_ids(tokenizer, messages: list[dict], tools_schemas: Sequence[dict] | None = None, *,
                      end_of_turn: str | None = None) -> list[int]:
    """The ids to append after a turn's sampled ids: the messages after the last assistant message (tool
    messages, an environment's text) and the next assistant turn's generation prompt, as the chat template
    renders them. Computed as the rendering of ``messages`` (with the generation prompt) minus the rendering of
    the history up to the last assistant message, plus whatever the template writes after that message's
    ``end_of_turn`` (default the tokenizer's EOS, the last id sampled): e.g. the newline after ``<|im_end|>``.
    Only this span is tokenized; the model's own tokens are never decoded and encoded again."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ToolError("tool_messages_ids needs the assistant turn the tool messages answer")
    end = end_of_turn if end_of_turn is not None else tokenizer.eos_token
    if not end:
        raise ToolError("the tokenizer has no EOS token; pass end_of_turn, the text the sampled turn ends with")
    before = _render(tokenizer, messages[:last], tools_schemas, False) if last else ""
    history = _render(tokenizer, messages[:last + 1], tools_schemas, False)
    after = _render(tokenizer, messages, tools_schemas, True)
    if not history.startswith(before) or not after.startswith(history):
        raise ToolError("the chat template renders earlier turns differently once later messages follow, so the "
                        "sampled tokens cannot be kept as they are; use a template that only appends")
    cut = history.rfind(end, len(before))
    if cut < 0:
        raise ToolError(f"the chat template does not end the assistant turn with {end!r}; pass end_of_turn")
    span = history[cut + len(end):] + after[len(history):]
    return tokenizer(span, add_special_tokens=False)["input_ids"]
