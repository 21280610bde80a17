"""Demonstrations for supervised fine-tuning (sft.data): read, checked, and rendered to token ids with the
tokens the loss trains on (the assistant's).

A row is chat messages or a prompt/completion pair, in TRL's column names:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...,
                   "tool_calls": [{"type": "function", "function": {"name": ..., "arguments": {...}}}]}, ...],
     "tools": [<JSON schema of each tool>]}                       (tools optional)
    {"prompt": "text" | [messages], "completion": "text" | [assistant messages]}

Rows come from a .jsonl file (one object a line), a .json file (a list of objects) or a folder saved with
`datasets`' save_to_disk. A bad row is one line naming its file and line (`DataError`), before a model loads.

Which tokens train (`render_demo`):
- a chat template with generation tags ({% generation %} ... {% endgeneration %}): transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)`, the template's own marking;
- any other chat template: covey renders the conversation turn by turn. For each assistant message i the
  history up to it (with the generation prompt) and the history through it are rendered; each must be a
  prefix of the whole conversation's rendering (a template that renders earlier turns differently once later
  ones follow, e.g. by dropping earlier reasoning, is refused naming the row and the message), and the
  assistant's span runs from the end of the generation prompt through the end-of-turn token (the tokenizer's
  EOS) where the template writes one. The text is tokenized span by span, so the ids are those the model
  reads and writes during a rollout (its prompt tokenized, its answer sampled token by token);
- a tokenizer without a chat template (a base model): prompt/completion pairs only, the completion and the
  EOS token trained.

Tool calls: an assistant message's `tool_calls` are given to the template; a template that does not write
them (covey's tiny model's, SmolLM2's) gets them in the content as covey's episodes write them,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (docs/agents.md), so the calls train as the model
makes them in an episode. Tool results (role "tool") are rendered by the template and never trained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from covey.runtime.errors import first_line
from covey.tasks.files import DataError, json_rows

ROLES = ("system", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
PROBE_CALL = {"type": "function", "function": {"name": "covey_probe", "arguments": {"x": 1}}}


@dataclass(frozen=True)
class Demo:
    """One demonstration: its messages (tool calls normalised), the tools' schemas, and where it was read."""
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    source: str
    plain: tuple[str, str] | None = None
    """(prompt, completion) of a row given as two strings: rendered without a template when there is none."""


@dataclass(frozen=True)
class Tokens:
    """A rendered demonstration: its token ids and, per token, 1 where the loss trains on it."""
    ids: list[int]
    trained: list[int]
    source: str


# --------------------------------------------------------------------------- reading


def read_rows(path: str | Path, split: str = "") -> Iterable[tuple[str, Any]]:
    """('file:line' or 'folder row i', row) of a .jsonl / .json file or a saved HF dataset folder."""
    path = Path(path)
    if path.is_dir():
        return dataset_rows(path, split)
    if not path.is_file():
        raise DataError(f"sft.data={path}: file not found")
    return json_rows(path) if path.suffix.lower() == ".json" else jsonl_rows(path)


def jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON: {err.msg} at column {err.colno}") from None


def dataset_rows(path: Path, split: str) -> Iterable[tuple[str, Any]]:
    try:
        import datasets  # noqa: PLC0415  (optional dependency, imported on use)
    except ImportError:
        raise ImportError("sft.data as a dataset folder needs the 'datasets' package: "
                          "pip install 'covey[datasets]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({first_line(err)})") from None
    if hasattr(ds, "keys"):
        names = list(ds.keys())
        if not split and len(names) != 1:
            raise DataError(f"{path}: the dataset has splits {', '.join(names)}: choose one with sft.split")
        if (split or names[0]) not in names:
            raise DataError(f"{path}: no split {split!r} (sft.split); available: {', '.join(names)}")
        ds = ds[split or names[0]]
    elif split:
        raise DataError(f"{path}: sft.split={split} requested but the dataset has no splits")
    return ((f"{path} row {i}", row) for i, row in enumerate(ds))


def load_demos(path: str | Path, split: str = "") -> list[Demo]:
    """Every row of sft.data as a Demo; the first bad row is a DataError naming its place."""
    demos = [row_to_demo(row, where) for where, row in read_rows(path, split)]
    if not demos:
        raise DataError(f"sft.data={path}: no rows")
    return demos


def row_to_demo(row: Any, where: str) -> Demo:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    tools = row.get("tools")
    if isinstance(tools, str):  # datasets often store the schemas as a JSON string
        tools = json.loads(tools) if tools.strip() else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: field 'tools' must be a list of JSON schemas")
    tools = tuple(tools) if tools else None
    if "messages" in row:
        messages = check_messages(row["messages"], where, "messages")
        return Demo(messages, tools, where)
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = ({"role": "user", "content": prompt}, {"role": "assistant", "content": completion})
            return Demo(messages, tools, where, plain=(prompt, completion))
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        tail = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        return Demo(check_messages(list(head) + list(tail), where, "prompt + completion"), tools, where)
    keys = ", ".join(map(str, row)) or "nothing"
    raise DataError(f"{where}: a row needs 'messages', or 'prompt' and 'completion' (the row has: {keys})")


def check_messages(value: Any, where: str, key: str) -> tuple[dict, ...]:
    """Chat messages with known roles and string contents, tool calls normalised, at least one assistant's."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: {key} message {i} needs a role among {', '.join(ROLES)}, got {str(m)[:80]}")
        calls = [normal_call(c, where, i) for c in (m.get("tool_calls") or [])]
        content = m.get("content")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: {key} message {i} ({m['role']}): content must be a string, "
                            f"got {type(content).__name__}")
        if calls and m["role"] != "assistant":
            raise DataError(f"{where}: {key} message {i}: only an assistant message makes tool calls")
        message = {**{k: v for k, v in m.items() if v is not None}, "content": content}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: {key} holds no assistant message: nothing to train on")
    if out[0]["role"] == "assistant":
        raise DataError(f"{where}: {key} starts with an assistant message: a demonstration answers something")
    return tuple(out)


def normal_call(call: Any, where: str, index: int) -> dict:
    """{"type": "function", "function": {"name", "arguments": dict}} from that form or {"name", "arguments"}."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise DataError(f"{where}: message {index}: a tool call needs a function name and JSON-object arguments, "
                        f"got {str(call)[:80]}")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# --------------------------------------------------------------------------- rendering


def has_generation_tags(tokenizer) -> bool:
    return bool(GENERATION_TAG.search(getattr(tokenizer, "chat_template", None) or ""))


def render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def writes_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's `tool_calls` into its text."""
    try:
        text = render(tokenizer, [{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}], None, False)
    except Exception:  # noqa: BLE001 - a template that refuses tool calls does not write them
        return False
    return "covey_probe" in text


def calls_in_content(messages: tuple[dict, ...]) -> list[dict]:
    """The messages with each assistant's tool calls written into its content, covey's tags format."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        written = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in calls)
        out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": m["content"] + written})
    return out


def render_demo(tokenizer, demo: Demo, max_tokens: int) -> Tokens:
    """A demonstration's token ids and trained-token marks (module docstring); a DataError naming the row for a
    conversation the template cannot mark, one without a trained token, or one longer than `max_tokens`."""
    if not getattr(tokenizer, "chat_template", None):
        if demo.plain is None:
            raise DataError(f"{demo.source}: chat messages need a chat template, and the model's tokenizer has "
                            "none: give prompt/completion strings, or a model with a chat template")
        ids, trained = plain_tokens(tokenizer, *demo.plain)
    else:
        messages = demo.messages if writes_tool_calls(tokenizer) else tuple(calls_in_content(demo.messages))
        if has_generation_tags(tokenizer):
            out = tokenizer.apply_chat_template(list(messages), tools=list(demo.tools) if demo.tools else None,
                                                tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, trained = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, trained = turn_tokens(tokenizer, messages, demo)
    if not any(trained):
        raise DataError(f"{demo.source}: no token to train on: the chat template marks no assistant token")
    if len(ids) > max_tokens:
        raise DataError(f"{demo.source}: the conversation is {len(ids)} tokens, more than the model's context "
                        f"of {max_tokens}")
    return Tokens(ids, [int(bool(t)) for t in trained], demo.source)


def plain_tokens(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return head + tail, [0] * len(head) + [1] * len(tail)


def turn_tokens(tokenizer, messages: tuple[dict, ...], demo: Demo) -> tuple[list[int], list[int]]:
    """Ids and marks of `messages` (the demo's, as the template gets them) rendered turn by turn (module
    docstring), tokenized span by span."""
    full = render(tokenizer, messages, demo.tools, False)
    end = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], demo.tools, True)
        turn = render(tokenizer, messages[:i + 1], demo.tools, False)
        if not (turn.startswith(head) and full.startswith(turn)):
            raise DataError(f"{demo.source}: the chat template renders the conversation before message {i} "
                            "differently once later messages follow (it does not only append), so the assistant's "
                            "tokens cannot be marked turn by turn: use a template with generation tags")
        stop = turn.rfind(end, len(head)) if end else -1
        spans.append((len(head), stop + len(end) if stop >= 0 else len(turn)))
    ids, trained, at = [], [], 0
    for start, stop in spans:
        for text, mark in ((full[at:start], 0), (full[start:stop], 1)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            trained += [mark] * len(piece)
        at = stop
    rest = tokenizer(full[at:], add_special_tokens=False)["input_ids"] if full[at:] else []
    return ids + rest, trained + [0] * len(rest)
