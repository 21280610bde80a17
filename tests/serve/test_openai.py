"""The policy server (covey/serve/) on the tiny model's fast engine, through the real `openai` client: chat with
tools, log-probs and token ids, completions by text and by ids; the ids and log-probs returned are the
engine's own (its greedy tokens, its seeded samples), not an encoding of the returned text."""

import pytest

from tests.serve.conftest import MAX_NEW
from tests.serve.support import chat_ids, engine_rows

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def test_chat_returns_the_engines_greedy_ids_and_their_logprobs(served, client, policy):
    tokenizer = policy[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6,
                                           logprobs=True, extra_body={"return_token_ids": True})
    data = reply.model_dump()
    prompt_ids = chat_ids(tokenizer, messages)
    assert data["prompt_token_ids"] == prompt_ids
    [(ids, logprobs, cut)] = engine_rows(served, prompt_ids, greedy=True, max_new_tokens=6)
    choice = data["choices"][0]
    assert choice["token_ids"] == ids
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=1e-5)
    assert [t["token"] for t in choice["logprobs"]["content"]] == [tokenizer.decode([i]) for i in ids]
    assert all(t["top_logprobs"] == [] and t["bytes"] == list(t["token"].encode()) for t in
               choice["logprobs"]["content"])
    assert choice["finish_reason"] == ("length" if cut else "stop")
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["message"]["role"] == "assistant"
    assert (reply.object, reply.model, reply.id[:9]) == ("chat.completion", "covey-policy", "chatcmpl-")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(ids))


def test_sampled_ids_are_the_engines_seeded_samples_not_a_reencoding(served, client, policy):
    tokenizer = policy[1]
    messages = [{"role": "user", "content": "What is 17 plus 4?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, n=4, seed=11, logprobs=True,
                                           extra_body={"return_token_ids": True})
    rows = engine_rows(served, chat_ids(tokenizer, messages), 4, seeds=[11], max_new_tokens=MAX_NEW)
    choices = reply.model_dump()["choices"]
    assert [c["token_ids"] for c in choices] == [ids for ids, _, _ in rows]
    for choice, (_, logprobs, _) in zip(choices, rows):
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=1e-5)
    # the random model's samples do not survive decode-then-encode: the ids above are not the text's tokens
    assert any(tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids for ids, _, _ in rows)


def test_completions_by_text_and_by_token_ids(served, client, policy):
    tokenizer = policy[1]
    prompt = "What is 7 times 6? Answer with a number."
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    by_text = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=5, logprobs=0,
                                        extra_body={"return_token_ids": True}).model_dump()
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=5,
                                       extra_body={"return_token_ids": True}).model_dump()
    [(expected, logprobs, _)] = engine_rows(served, ids, greedy=True, max_new_tokens=5)
    for reply in (by_text, by_ids):
        choice = reply["choices"][0]
        assert (reply["prompt_token_ids"], choice["prompt_token_ids"], choice["token_ids"]) == (ids, ids, expected)
        assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert by_text["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-5)
    assert by_ids["choices"][0]["logprobs"] is None  # not asked for
    assert by_text["object"] == "text_completion"


def test_chat_with_tools_shows_them_through_covey_tool_prompt(served, client, policy):
    """The tiny chat template renders no `tools=`: the tools are shown by covey's tool system prompt (the
    <tool_call>{json} format), as covey's own episodes show them (covey/rollout/agents.py)."""
    messages = [{"role": "user", "content": "Add 2 and 40."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=4, extra_body={"return_token_ids": True})
    shown = policy[1].decode(reply.model_dump()["prompt_token_ids"])
    assert shown.startswith("<|im_start|>system\nYou can call these tools:") and '"name": "add"' in shown
    assert shown.endswith("Add 2 and 40.<|im_end|>\n<|im_start|>assistant\n")


def test_models_tokenize_and_health(served, client, policy):
    from tests.serve.support import request
    server = served[0]
    assert [m.id for m in client.models.list().data] == ["covey-policy"]
    messages = [{"role": "user", "content": "Hi"}]
    status, body = request(server.url, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == chat_ids(policy[1], messages) and body["count"] == len(body["tokens"])
    status, body = request(server.url, "POST", "/tokenize", {"prompt": "What is"})
    assert (status, body["tokens"], body["max_model_len"]) == (200, policy[1]("What is")["input_ids"], 1024)
    assert request(server.url, "GET", "/health") == (200, {"status": "ok"})
