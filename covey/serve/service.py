"""The routes' work, apart from HTTP: a request body (and its episode id) in, a response object out.

`PolicyService` renders or reads the prompt ids, checks them against the model's context and the episode,
hands one job per request to the engine's thread (covey/serve/batcher.py), and writes the samples back in
OpenAI's schema, recording each call of an episode. Errors are `RequestError`s with their status
(400, 404, 503) or an `EngineFault` (500).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import TimeoutError as FutureTimeout

from covey.rollout.base import Engine
from covey.rollout.episodes import turn_seed
from covey.runtime.errors import first_line
from covey.serve.batcher import Batcher, Job, Sample
from covey.serve.episodes import Call, Choice, Episodes, check_extends, text_prompt_ids
from covey.serve.options import EngineFault, RequestError, ServerOptions
from covey.serve.requests import (
    Sampling,
    chat_request,
    completion_request,
    continue_request,
    message_of,
    tools_of,
)
from covey.serve.responses import Answer, answer_of, chat_choice, completion_choice, envelope
from covey.serve.texts import Texts


class PolicyService:
    """The engine behind the routes: one engine thread, the server's tokenizer copy, the episode traces."""

    def __init__(self, engine: Engine, options: ServerOptions):
        self.options = options
        self.texts = Texts(engine.tokenizer)
        self.vocab_size = options.vocab_size or self.texts.vocab_size
        self.batcher = Batcher(engine, options.batch_window_s, options.max_batch_rows)
        self.episodes = Episodes(options.max_episodes)
        self.seeds = random.SystemRandom()
        self.episode_seeds: dict[str, int] = {}  # an episode's seed: its calls that send none derive theirs
        self.created = int(time.time())

    def close(self) -> None:
        self.batcher.close()

    # ----------------------------------------------------------------------- routes

    def chat(self, body: dict, episode: str | None) -> dict:
        """POST /v1/chat/completions."""
        request = chat_request(body, self.options)
        text = self.texts.render(request.messages, request.tools)
        ids = text_prompt_ids(self.episodes.last(episode), text, self.texts, episode)
        seed, answers = self.sample(ids, request.sampling, episode)
        choices = [chat_choice(i, a, self.texts, request) for i, a in enumerate(answers)]
        self.record(episode, Call("chat", ids, text, seed, self.choices_of(answers, choices), request.messages))
        return envelope("chat.completion", self.options.model_name, ids, choices, answers, request.sampling)

    def completion(self, body: dict, episode: str | None, route: str = "completions") -> dict:
        """POST /v1/completions (a text or token ids) and POST /v1/continue (`route` "continue": token ids)."""
        read = continue_request if route == "continue" else completion_request
        request = read(body, self.options, self.vocab_size)
        previous, text = self.episodes.last(episode), None
        if isinstance(request.prompt, str):
            text = request.prompt
            ids = text_prompt_ids(previous, text, self.texts, episode)
        else:
            ids = request.prompt
            check_extends(previous, ids, episode, self.texts)
        seed, answers = self.sample(ids, request.sampling, episode)
        choices = [completion_choice(i, a, self.texts, request.sampling, ids) for i, a in enumerate(answers)]
        self.record(episode, Call(route, ids, text, seed, self.choices_of(answers, choices)))
        return envelope("text_completion", self.options.model_name, ids, choices, answers, request.sampling)

    def tokenize(self, body: dict) -> dict:
        """POST /tokenize (vLLM's): {"prompt": text} or {"messages": [...], "tools"?} -> the ids the engine
        would be given (a chat with its next assistant turn's header, as /v1/chat/completions renders it)."""
        if isinstance(body.get("prompt"), str):
            ids = self.texts.encode(body["prompt"])
        elif isinstance(body.get("messages"), list) and body["messages"]:
            messages = [message_of(m, i) for i, m in enumerate(body["messages"])]
            ids = self.texts.encode(self.texts.render(messages, tools_of(body)))
        else:
            raise RequestError("send {\"prompt\": text} or {\"messages\": [...]}")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.options.context_length}

    def models(self) -> dict:
        """GET /v1/models."""
        return {"object": "list", "data": [{"id": self.options.model_name, "object": "model",
                                            "created": self.created, "owned_by": "covey",
                                            "max_model_len": self.options.context_length}]}

    def episode(self, episode: str, take: bool = False) -> dict:
        """GET /v1/episodes/<id> (DELETE: take it); 404 for an episode not (or no longer) recorded."""
        calls = self.episodes.take(episode) if take else self.episodes.trace(episode)
        if calls is None:
            raise RequestError(f"no episode {episode!r} (not seen, already taken, or dropped as the oldest)", 404)
        return {"id": episode, "calls": calls}

    # ----------------------------------------------------------------------- the engine

    def seed_of(self, sampling: Sampling, episode: str | None) -> int:
        """The request's own seed; else, in an episode given a seed (`PolicyServer.seed_episode`), call k's
        `turn_seed(episode seed, k)`; else one drawn at random (recorded in the trace)."""
        if sampling.seed is not None:
            return sampling.seed
        base = self.episode_seeds.get(episode) if episode is not None else None
        return self.seeds.randrange(2**31) if base is None else turn_seed(base, self.episodes.count(episode))

    def sample(self, ids: list[int], sampling: Sampling, episode: str | None = None) -> tuple[int, list[Answer]]:
        """The request's seed and its n answers: context checked, one job on the engine's thread."""
        context, max_tokens = self.options.context_length, sampling.max_tokens or self.options.max_new_tokens
        if not ids:
            raise RequestError("the prompt has no tokens")
        if len(ids) + max_tokens > context:
            raise RequestError(f"the prompt's {len(ids)} tokens plus max_tokens {max_tokens} exceed the model's "
                               f"context of {context} tokens")
        seed = self.seed_of(sampling, episode)
        future = self.batcher.submit(Job(ids, sampling.n, max_tokens, sampling.greedy, seed))
        try:
            samples: list[Sample] = future.result(self.options.generate_timeout_s)
        except FutureTimeout:
            raise RequestError(f"the engine did not answer within {self.options.generate_timeout_s:g} s", 503) from None
        except Exception as e:  # noqa: BLE001 - the engine's fault on this request: 500, the server goes on
            raise EngineFault(f"the engine failed on this request: {type(e).__name__}: {first_line(e)}") from e
        if sampling.logprobs and any(s.logprobs is None for s in samples):
            raise EngineFault("the engine returned no log-probs (its decode path does not compute them)")
        return seed, [answer_of(self.texts, s, sampling.stop) for s in samples]

    @staticmethod
    def choices_of(answers: list[Answer], choices: list[dict]) -> list[Choice]:
        return [Choice(a.ids, a.logprobs, c["finish_reason"]) for a, c in zip(answers, choices)]

    def record(self, episode: str | None, call: Call) -> None:
        if episode is not None:
            self.episodes.record(episode, call)
