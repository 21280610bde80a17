"""The policy server's HTTP side (covey/serve/server.py): one-line errors for malformed or unsupported requests,
413, the context check, the bearer token, unknown routes and methods, an engine fault answered 500 while
the server keeps serving, and concurrent requests answered correctly in fewer engine calls than requests."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from covey.models.tiny import tiny_tokenizer
from covey.serve import PolicyServer, ServerOptions
from tests.serve.support import ScriptedEngine, chat_ids, engine_rows, request

TOKEN = {"Authorization": "Bearer s3cret"}
POISON = 7  # a prompt holding this id makes the scripted engine raise
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def guarded():
    """A scripted engine behind a server with a token, a 4 KiB body limit and a 1024-token context."""
    engine = ScriptedEngine(tiny_tokenizer(), lambda prompt: [40, 41, 2], fail_on=POISON)
    server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=4, context_length=1024,
                                                token="s3cret", max_body_bytes=4096))
    server.start()
    yield server
    server.close()


@pytest.mark.parametrize("path, body, says", [
    ("/v1/chat/completions", b"{not json", "malformed JSON"),
    ("/v1/chat/completions", b"[1, 2]", "must be a JSON object, not list"),
    ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0] must be an object"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 0.5},
     "temperature 0.5 differs from the engine's 1"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0.9}, "top_p 0.9 differs from the engine's 1"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3},
     "top_logprobs=3 is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}, "'stream' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, "'presence_penalty' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "'n' must be an integer from 1 to 64"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "8"}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request"),
    ("/v1/completions", {"prompt": [1, 99999]}, "token id 99999, outside the vocabulary of 512"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs=2 is not supported"),
    ("/v1/continue", {"prompt_token_ids": "abc"}, "'prompt_token_ids' must be a non-empty list"),
    ("/v1/continue", {"prompt_token_ids": [1] * 1020, "max_tokens": 8},
     "the prompt's 1020 tokens plus max_tokens 8 exceed the model's context of 1024 tokens"),
    ("/tokenize", {}, "send {\"prompt\": text} or {\"messages\": [...]}"),
])
def test_bad_requests_are_400_with_one_line_saying_why(guarded, path, body, says):
    status, answer = request(guarded.url, "POST", path, body, TOKEN)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert says in answer["error"]["message"] and "\n" not in answer["error"]["message"]


def test_limits_token_routes_and_methods(guarded):
    url = guarded.url
    assert request(url, "POST", "/v1/completions", {"prompt": "x" * 5000}, TOKEN)[0] == 413
    assert request(url, "POST", "/v1/completions", {"prompt": "x"})[0] == 401
    assert request(url, "POST", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"})[0] == 401
    assert request(url, "GET", "/v1/models")[0] == 401
    assert request(url, "GET", "/health") == (200, {"status": "ok"})  # no token needed: it reveals nothing
    status, body = request(url, "POST", "/v1/nothing", {}, TOKEN)
    assert status == 404 and "POST /v1/chat/completions" in body["error"]["message"]
    assert request(url, "GET", "/v1/chat/completions", None, TOKEN)[0] == 405
    assert request(url, "PUT", "/v1/completions", b"{}", TOKEN)[0] == 405
    status, body = request(url, "POST", "/v1/completions", {"prompt": "x", "user": "e"}, TOKEN)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"


def test_an_engine_fault_fails_its_request_alone_and_the_server_keeps_serving(guarded):
    def send(ids):
        return request(guarded.url, "POST", "/v1/continue", {"prompt_token_ids": ids}, TOKEN)
    with ThreadPoolExecutor(6) as pool:  # one bad prompt among good ones, likely in one batch
        answers = list(pool.map(send, [[5, POISON, 9], [5, 6], [8, 9], [10, 11], [12], [13, 14]]))
    assert answers[0][0] == 500 and "scripted failure" in answers[0][1]["error"]["message"]
    assert [status for status, _ in answers[1:]] == [200] * 5
    assert all(body["choices"][0]["token_ids"] == [40, 41, 2] for _, body in answers[1:])
    assert send([3, 4])[0] == 200


def test_concurrent_requests_are_batched_and_answered_as_alone(served, policy):
    """20 clients at once (greedy and seeded samples, 3 to 6 tokens each): each answer is what the engine gives
    that request alone, and the engine ran fewer calls than there were requests (requests of different
    max_tokens share a call: each row keeps its own budget)."""
    server, tokenizer = served[0], policy[1]
    prompts = [[{"role": "user", "content": f"What is {k} plus {k + 3}?"}] for k in range(20)]
    bodies = [{"messages": p, "seed": 100 + k, "return_token_ids": True, "logprobs": True, "max_tokens": 3 + k % 4,
               **({"temperature": 0} if k % 2 else {})} for k, p in enumerate(prompts)]
    before = server.stats.engine_calls
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda b: request(server.url, "POST", "/v1/chat/completions", b), bodies))
    calls = server.stats.engine_calls - before
    assert calls < len(bodies), f"{calls} engine calls for {len(bodies)} requests"
    print(f"{len(bodies)} requests in {calls} engine calls")
    for k, (status, body) in enumerate(answers):
        assert status == 200, body
        [(ids, logprobs, _)] = engine_rows(served, chat_ids(tokenizer, prompts[k]), greedy=bool(k % 2),
                                           seeds=[100 + k], max_new_tokens=3 + k % 4)
        choice = body["choices"][0]
        assert choice["token_ids"] == ids
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=1e-4)
