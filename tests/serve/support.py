"""What the policy-server tests share: an engine that answers with scripted ids (to test what the server does
with the ids it is given), and a plain HTTP client that returns the status and the JSON body."""

from __future__ import annotations

import http.client
import json
from typing import Callable
from urllib.parse import urlsplit

import torch

from covey.batch import Rollout
from covey.rollout.base import Engine, encode_prompts


class ScriptedEngine(Engine):
    """Answers every prompt with `answer(prompt_ids)` (cut at max_new_tokens), token k's log-prob -(k+1)/8,
    and records the prompts of each call. A prompt holding `fail_on` raises, for the server's fault tests."""

    def __init__(self, tokenizer, answer: Callable[[list[int]], list[int]], fail_on: int | None = None):
        self.tokenizer, self.answer, self.fail_on = tokenizer, answer, fail_on
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, group_size, *, greedy=False, max_new_tokens=None, seeds=None,
                 budgets=None) -> Rollout:
        self.calls.append([list(p) for p in prompts])
        if self.fail_on is not None and any(self.fail_on in p for p in prompts):
            raise RuntimeError("scripted failure")
        limits = budgets or [max_new_tokens] * (len(prompts) * group_size)
        rows = [self.answer(list(p))[:limits[i * group_size + g]] for i, p in enumerate(prompts)
                for g in range(group_size)]
        width, eos = max(len(r) for r in rows), self.tokenizer.eos_token_id
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        mask, logp = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1.0
            logp[i, :len(row)] = -torch.arange(1, len(row) + 1) / 8
        enc = encode_prompts(self.tokenizer, prompts)
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        return Rollout(prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index],
                       response_ids=ids, response_mask=mask, group_ids=index, truncated=torch.tensor(
                           [eos not in r for r in rows]), completions=self.tokenizer.batch_decode(ids),
                       example_index=index.tolist(), sample_logp=logp)

    def sync_weights(self, model) -> None:
        pass


def request(url: str, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, parsed JSON body) of one request; `body` a dict (sent as JSON) or bytes (sent as they are)."""
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def engine_rows(served, ids, group_size=1, **kwargs) -> list[tuple[list[int], list[float], bool]]:
    """engine.generate on the server's engine thread (the engine is only ever called there): per row, its ids,
    log-probs and whether it was cut."""
    server, engine = served
    out = server.between_batches(lambda: engine.generate([ids], group_size, **kwargs))
    lengths = out.response_mask.sum(1).long().tolist()
    return [(out.response_ids[r, :n].tolist(), out.sample_logp[r, :n].tolist(), bool(out.truncated[r]))
            for r, n in enumerate(lengths)]
