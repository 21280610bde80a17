"""The server's text side: its own copy of the engine's tokenizer, called by the request threads under one lock
(a fast tokenizer is not safe to call from several threads at once; the engine's thread keeps the original).

Text is tokenized as covey's engines tokenize a chat-formatted prompt: no special tokens added (the chat
template wrote them). Ids are decoded with `clean_up_tokenization_spaces` off, so the text of a token
sequence is the concatenation of its tokens' texts.
"""

from __future__ import annotations

import copy
import threading

from covey.rollout.tools import (
    ToolCall,
    ToolError,
    add_tool_system_prompt,
    chat_template_supports_tools,
    find_tool_calls,
    tool_call_format,
)
from covey.runtime.errors import first_line
from covey.serve.options import RequestError


class Texts:
    """Rendering (the chat template, with tools), encoding and decoding for the request threads."""

    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self.lock = threading.Lock()
        self.vocab_size = len(self.tokenizer)
        self.has_template = getattr(self.tokenizer, "chat_template", None) is not None
        self.shows_tools = chat_template_supports_tools(self.tokenizer)
        try:
            self.call_format: str | dict | None = tool_call_format(self.tokenizer)
        except ToolError:  # a template whose calls covey does not read: the text is returned as content
            self.call_format = None

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat template's text of `messages` and the next assistant turn's header. `tools`: shown by the
        template where it renders them, else by covey's tool system prompt (the <tool_call>{json} format)."""
        if not self.has_template:
            raise RequestError("the tokenizer has no chat template: send the text to POST /v1/completions")
        if tools and not self.shows_tools:
            messages, tools = add_tool_system_prompt(messages, tools), None
        with self.lock:
            try:
                return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template's refusal (roles out of order, ...) is the client's
                raise RequestError(f"the chat template cannot render these messages: {first_line(e)}") from None

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], special: bool = False) -> str:
        """The text of `ids`; `special`: with the special tokens (end of turn, ...) written out."""
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=not special, clean_up_tokenization_spaces=False)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text, special tokens written out."""
        with self.lock:
            return self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                               clean_up_tokenization_spaces=False)

    def tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the calls or None, the calls) where the model wrote readable tool calls in its
        format; (text, []) otherwise (no calls, or one that does not read: the text is the answer)."""
        if self.call_format is None:
            return text, []
        calls = find_tool_calls(text, self.call_format)
        if not calls or any(c.error for c in calls):
            return text, []
        head = text.split("<tool_call>", 1)[0].strip()
        return head or None, calls
