"""Samples into OpenAI's response objects: chat completions (with tool calls in the model's format) and text
completions, each token's log-prob, and vLLM's token ids.

The ids returned are the ids sampled (`Sample.ids`, up to and including the end-of-sequence token), never an
encoding of the returned text; the text is their decoding. A stop string cuts a completion after the token
that completes it (the ids keep that token, as vLLM's do; the text ends before the stop string).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from covey.serve.batcher import Sample
from covey.serve.requests import ChatRequest, Sampling
from covey.serve.texts import Texts


@dataclass
class Answer:
    """One choice: the ids returned, their log-probs, its text (stop string removed), why it ended."""

    ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str


def answer_of(texts: Texts, sample: Sample, stops: tuple[str, ...]) -> Answer:
    """The sample as returned: cut at the first stop string (the shortest prefix of ids whose text holds one)."""
    finish = "length" if sample.truncated else "stop"
    text = texts.decode(sample.ids)
    if not any(s in text for s in stops):
        return Answer(sample.ids, sample.logprobs, text, finish)
    low, high = 1, len(sample.ids)
    while low < high:
        middle = (low + high) // 2
        if any(s in texts.decode(sample.ids[:middle]) for s in stops):
            high = middle
        else:
            low = middle + 1
    text = texts.decode(sample.ids[:low])
    text = text[:min(text.find(s) for s in stops if s in text)]
    logprobs = None if sample.logprobs is None else sample.logprobs[:low]
    return Answer(sample.ids[:low], logprobs, text, "stop")


def chat_logprobs(texts: Texts, answer: Answer, as_ids: bool) -> dict:
    """OpenAI's chat `logprobs`: one entry per id returned (top alternatives are not kept: [])."""
    pieces = texts.pieces(answer.ids)
    content = [{"token": f"token_id:{i}" if as_ids else piece, "logprob": logprob,
                "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
               for i, piece, logprob in zip(answer.ids, pieces, answer.logprobs or [])]
    return {"content": content, "refusal": None}


def completion_logprobs(texts: Texts, answer: Answer, as_ids: bool) -> dict:
    """OpenAI's completions `logprobs` (tokens, token_logprobs, text_offset; top_logprobs null)."""
    pieces = texts.pieces(answer.ids)
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tokens = [f"token_id:{i}" for i in answer.ids] if as_ids else pieces
    return {"tokens": tokens, "token_logprobs": list(answer.logprobs or []), "top_logprobs": None,
            "text_offset": offsets}


def chat_choice(index: int, answer: Answer, texts: Texts, request: ChatRequest) -> dict:
    """One chat choice: the assistant message, with `tool_calls` where the request offered tools and the model
    wrote readable calls in its format (finish_reason "tool_calls" then, unless it ran out of tokens)."""
    message: dict = {"role": "assistant", "content": answer.text}
    finish = answer.finish_reason
    if request.tools and request.parse_tools:
        content, calls = texts.tool_calls(answer.text)
        if calls:
            message["content"] = content if texts.shows_tools else answer.text  # a template without tools
            # renders the content alone: the calls' text stays in it, so the next turn repeats the episode
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]
            finish = "tool_calls" if finish != "length" else finish
    choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if request.sampling.logprobs:
        choice["logprobs"] = chat_logprobs(texts, answer, request.sampling.tokens_as_ids)
    if request.sampling.token_ids:
        choice["token_ids"] = list(answer.ids)
    return choice


def completion_choice(index: int, answer: Answer, texts: Texts, sampling: Sampling, prompt_ids: list[int]) -> dict:
    choice = {"index": index, "text": answer.text, "finish_reason": answer.finish_reason, "logprobs": None}
    if sampling.logprobs:
        choice["logprobs"] = completion_logprobs(texts, answer, sampling.tokens_as_ids)
    if sampling.token_ids:
        choice["token_ids"] = list(answer.ids)
        choice["prompt_token_ids"] = list(prompt_ids)
    return choice


def envelope(kind: str, model: str, prompt_ids: list[int], choices: list[dict], answers: list[Answer],
             sampling: Sampling) -> dict:
    """The response around its choices: id, object, created, model, usage (and prompt_token_ids if asked)."""
    completion_tokens = sum(len(a.ids) for a in answers)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    out = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model,
           "choices": choices, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                         "total_tokens": len(prompt_ids) + completion_tokens}}
    if sampling.token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out
