"""Token faithfulness and episodes (covey/serve/episodes.py), on an engine that answers with scripted ids: ids
whose text encodes to other ids come back as sampled, a continuation starts from the exact ids, a chat turn
of an episode keeps the earlier turns' sampled ids, tool calls are read in the model's format, the trace
holds every call, and a chat template that re-renders earlier turns is refused."""

import pytest
from openai import BadRequestError, OpenAI

from covey.serve import PolicyServer, ServerOptions
from tests.serve.support import ScriptedEngine, request

QWEN_LIKE = (  # renders `tools=` and an assistant's tool_calls as <tool_call>{json}</tool_call>
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FORGETFUL = (  # renders an earlier assistant turn differently once a later message follows
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
    "[answered]{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture
def serve(tiny_tokenizer):
    """serve(answer_ids, template=None) -> (server, engine, openai client); every server closed after the test."""
    servers = []

    def start(answer: list[int], template: str | None = None):
        if template is not None:
            tiny_tokenizer.chat_template = template
        engine = ScriptedEngine(tiny_tokenizer, lambda prompt: list(answer))
        server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=128, context_length=1024))
        servers.append(server)
        return server, engine, OpenAI(base_url=server.start() + "/v1", api_key="unused", max_retries=0)
    yield start
    for server in servers:
        server.close()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def split_the(tokenizer) -> list[int]:
    """"Th" then "e": ids whose text, "The", encodes to one other id."""
    ids = encode(tokenizer, "Th") + encode(tokenizer, "e")
    assert encode(tokenizer, tokenizer.decode(ids)) != ids
    return ids


def test_ids_come_back_as_sampled_and_a_continuation_starts_from_them(serve, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    sampled = split_the(tiny_tokenizer) + [eos]
    server, engine, client = serve(sampled)
    messages = [{"role": "user", "content": "Say the."}]
    first = client.chat.completions.create(model="m", messages=messages, logprobs=True, user="ep-1",
                                           extra_body={"return_token_ids": True}).model_dump()
    choice = first["choices"][0]
    assert (choice["token_ids"], choice["message"]["content"], choice["finish_reason"]) == (sampled, "The", "stop")
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.125, -0.25, -0.375]
    turn = encode(tiny_tokenizer, "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    ids = first["prompt_token_ids"] + sampled + turn
    status, body = request(server.url, "POST", "/v1/continue", {"prompt_token_ids": ids, "max_tokens": 4},
                           {"X-Episode-Id": "ep-1"})
    assert status == 200 and engine.calls[-1] == [ids]
    assert (body["prompt_token_ids"], body["choices"][0]["token_ids"]) == (ids, sampled)
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.125, -0.25, -0.375]
    trace = server.take_episode("ep-1")
    assert [c["route"] for c in trace] == ["chat", "continue"]
    assert [c["prompt_ids"] for c in trace] == [first["prompt_token_ids"], ids]
    assert all(c["choices"] == [{"completion_ids": sampled, "logprobs": [-0.125, -0.25, -0.375],
                                 "finish_reason": "stop"}] for c in trace)


def test_a_chat_turn_of_an_episode_keeps_the_sampled_ids_of_the_earlier_turns(serve, tiny_tokenizer):
    sampled = split_the(tiny_tokenizer) + [tiny_tokenizer.eos_token_id]
    server, engine, client = serve(sampled)
    messages = [{"role": "user", "content": "Say the."}]
    first = client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Episode-Id": "ep-2"},
                                           extra_body={"return_token_ids": True}).model_dump()
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Episode-Id": "ep-2"},
                                            extra_body={"return_token_ids": True}).model_dump()
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rest = encode(tiny_tokenizer, "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + sampled + rest == engine.calls[-1][0]
    assert second["prompt_token_ids"] != encode(tiny_tokenizer, text)  # what re-tokenizing would have given
    status, body = request(server.url, "GET", "/v1/episodes/ep-2")
    assert status == 200 and [c["prompt_ids"] for c in body["calls"]] == [first["prompt_token_ids"],
                                                                          second["prompt_token_ids"]]
    assert request(server.url, "DELETE", "/v1/episodes/ep-2")[1] == body
    assert request(server.url, "GET", "/v1/episodes/ep-2")[0] == 404
    with pytest.raises(KeyError):
        server.take_episode("ep-2")


def test_a_template_that_rerenders_earlier_turns_is_refused_naming_the_episode_and_position(serve, tiny_tokenizer):
    sampled = encode(tiny_tokenizer, "The answer") + [tiny_tokenizer.eos_token_id]
    server, engine, client = serve(sampled, FORGETFUL)
    messages = [{"role": "user", "content": "Go."}]
    first = client.chat.completions.create(model="m", messages=messages, user="ep-3",
                                           extra_body={"return_token_ids": True}).model_dump()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "More."}]
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=messages, user="ep-3")
    message = refused.value.body["message"]
    assert "episode 'ep-3'" in message and f"first differ at token {len(first['prompt_token_ids'])}" in message
    assert "POST /v1/continue" in message and len(engine.calls) == 1
    assert len(server.episode("ep-3")) == 1  # the refused call is not recorded
    # a prompt of ids that does not extend the episode is refused in the same words
    status, body = request(server.url, "POST", "/v1/continue", {"prompt_token_ids": [5, 6, 7]},
                           {"X-Episode-Id": "ep-3"})
    assert status == 400 and "first differ at token 0" in body["error"]["message"]


def test_tool_calls_in_the_models_format_over_two_turns(serve, tiny_tokenizer):
    """A template that renders tools and tool calls: the call's text becomes `tool_calls` (content null), and the
    next turn, with the call rendered back by the template and the tool's reply, extends the episode."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    sampled = encode(tiny_tokenizer, call) + [tiny_tokenizer.eos_token_id]
    server, engine, client = serve(sampled, QWEN_LIKE)
    messages = [{"role": "user", "content": "Add 2 and 40."}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, user="ep-4")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("add", '{"a": 2, "b": 40}')
    assert '{"type": "function", "function": {"name": "add"' in tiny_tokenizer.decode(engine.calls[0][0])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": "42"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS, user="ep-4")
    first_call, second_call = server.take_episode("ep-4")
    assert second_call["prompt_ids"][:len(first_call["prompt_ids"]) + len(sampled)] == \
        first_call["prompt_ids"] + sampled
    assert tiny_tokenizer.decode(second_call["prompt_ids"]).endswith(
        "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_tools_keeps_the_calls_text_as_content(serve, tiny_tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    server, engine, client = serve(encode(tiny_tokenizer, call) + [tiny_tokenizer.eos_token_id])
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS)
    message = reply.choices[0].message
    assert message.content == call and message.tool_calls[0].function.name == "add"
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2?"}])
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
