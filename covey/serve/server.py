"""`PolicyServer`: the policy over HTTP, OpenAI-compatible and token-faithful (standard library only).

    POST /v1/chat/completions   OpenAI's chat completions (+ tools, logprobs, vLLM's return_token_ids)
    POST /v1/completions        one prompt, a text or its token ids
    POST /v1/continue           {"prompt_token_ids": [...]} -> a completion with its ids and log-probs
    POST /tokenize              {"prompt": text} | {"messages": [...]} -> {"tokens": [...], "count": n}
    GET  /v1/models             the served model
    GET  /v1/episodes/<id>      an episode's calls (DELETE: the same, and the episode forgotten)
    GET  /health                {"status": "ok"}   (no token)

Status codes, as `covey serve-reward`'s: 401 missing or wrong token (when one is set); 400 malformed JSON, a
body that is not the schema, a setting the engine does not take, a prompt plus max_tokens beyond the
model's context, a call that does not extend its episode; 411 no Content-Length; 413 body over
max_body_bytes; 408 a client that stalls mid-body; 404 other paths and unknown episodes; 405 other methods,
with an Allow header; 500 the engine failed on this request (the server keeps serving); 503 the engine did
not answer in time. Every error body is one line of JSON in OpenAI's shape,
{"error": {"message": "...", "type": "...", "code": 400}}.

Security: binds to 127.0.0.1 unless told otherwise; the bearer token comes from the caller (the command reads
it from an environment variable, never from the command line) and is compared in constant time. Plain HTTP:
put TLS in front of it (a reverse proxy) before exposing it beyond one machine.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Callable
from urllib.parse import unquote, urlsplit

from covey.rollout.base import Engine
from covey.runtime.errors import first_line
from covey.runtime.http import JsonHandler
from covey.serve.options import EngineFault, RequestError, ServerOptions
from covey.serve.requests import episode_of
from covey.serve.service import PolicyService

POST_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/continue": "continue",
               "/tokenize": "tokenize"}
GET_ROUTES = ("/health", "/v1/models")
EPISODES = "/v1/episodes/"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "method_not_allowed", 408: "request_timeout", 411: "length_required",
               413: "request_too_large", 500: "internal_error", 503: "service_unavailable"}


def allowed(path: str) -> str | None:
    """The methods a path answers (the Allow header of a 405), or None for a path the server does not have."""
    if path in POST_ROUTES:
        return "POST"
    if path in GET_ROUTES:
        return "GET"
    if path.startswith(EPISODES) and len(path) > len(EPISODES):
        return "GET, DELETE"
    return None


class PolicyHandler(JsonHandler):
    """One request; the server carries `service` and `options`."""

    server_version = "covey-policy/1"
    realm = "covey-policy"

    def request_timeout_s(self) -> float:
        return self.server.options.request_timeout_s

    def verbose(self) -> bool:
        return self.server.options.verbose

    def fail(self, code: int, message: str, close: bool = False, allow: str = "") -> None:
        error = {"message": message, "type": ERROR_TYPES.get(code, "error"), "code": code}
        self.send_json(code, {"error": error}, close=close, allow=allow)

    @property
    def route(self) -> str:
        path = urlsplit(self.path).path
        return path.rstrip("/") or "/"

    def authorised(self) -> bool:
        token = self.server.options.token
        return not token or self.bearer_is(token)

    def read_json(self) -> dict | None:
        """The parsed body, or None after an error response was sent."""
        length, limit = self.headers.get("Content-Length"), self.server.options.max_body_bytes
        if length is None or not length.isdigit():
            self.fail(411, "Content-Length required", close=True)
            return None
        if int(length) > limit:  # refused before a byte of it is read
            self.fail(413, f"body of {length} bytes exceeds the limit of {limit}", close=True)
            return None
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            self.fail(408, "request body not received in time", close=True)
            return None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.fail(400, f"malformed JSON: {e}")
            return None
        except RecursionError:  # the parser recurses once per level of nesting
            self.fail(400, "JSON nested too deeply")
            return None
        if not isinstance(body, dict):
            self.fail(400, f"the body must be a JSON object, not {type(body).__name__}")
            return None
        return body

    def answer(self, work: Callable[[], dict]) -> None:
        """Run a route's work and send its result, or its error: the request's, never the server's end."""
        try:
            payload = work()
        except RequestError as e:
            self.fail(e.status, first_line(e))
        except EngineFault as e:
            self.fail(500, first_line(e))
        except Exception as e:  # noqa: BLE001 - a bug on one request answers 500; the server keeps serving
            self.fail(500, f"internal error: {type(e).__name__}: {first_line(e)}")
        else:
            self.send_json(200, payload)

    def refuse(self, method: str) -> bool:
        """Answer 404 / 405 / 401 where the request cannot go on (True then)."""
        path = self.route
        methods = allowed(path)
        if methods is None:
            known = ", ".join(["POST " + p for p in POST_ROUTES] + ["GET " + p for p in GET_ROUTES])
            self.fail(404, f"no such path {path}; the routes are: {known}, GET|DELETE {EPISODES}<id>", close=True)
            return True
        if method not in methods:
            self.fail(405, f"method {method} not allowed on {path}; use {methods}", close=True, allow=methods)
            return True
        if path != "/health" and not self.authorised():
            self.fail(401, "missing or wrong bearer token", close=True)
            return True
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.refuse("GET"):
            return
        service, path = self.server.service, self.route
        if path == "/health":
            self.send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self.answer(service.models)
        else:
            self.answer(lambda: service.episode(unquote(path[len(EPISODES):])))

    def do_DELETE(self) -> None:  # noqa: N802
        if self.refuse("DELETE"):
            return
        path = self.route
        self.answer(lambda: self.server.service.episode(unquote(path[len(EPISODES):]), take=True))

    def do_POST(self) -> None:  # noqa: N802
        if self.refuse("POST"):
            return
        body = self.read_json()
        if body is None:
            return
        service, route = self.server.service, POST_ROUTES[self.route]
        if route == "tokenize":
            self.answer(lambda: service.tokenize(body))
            return

        def work() -> dict:
            episode = episode_of(self.headers.get("X-Episode-Id"), body)
            return service.chat(body, episode) if route == "chat" else service.completion(body, episode, route)
        self.answer(work)

    def reject(self) -> None:
        methods = allowed(self.route) or "GET, POST"
        self.fail(405, f"method {self.command} not allowed; use {methods}", close=True, allow=methods)

    do_PUT = do_PATCH = do_OPTIONS = do_HEAD = reject  # noqa: N815


class PolicyServer(ThreadingHTTPServer):
    """The policy server: bound at construction (port 0: any free port), serving once `start()` runs it in a
    background thread (or `serve_forever()` in this one). The engine is only called from the server's engine
    thread; `between_batches(fn)` runs `fn` there (a training run syncing new weights into the engine)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # many agents connect at once: the default backlog of 5 would drop their connects

    def __init__(self, engine: Engine, options: ServerOptions, host: str = "127.0.0.1", port: int = 0):
        self.options = options
        self.service = PolicyService(engine, options)
        self.thread: threading.Thread | None = None
        self.connections: dict[socket.socket, threading.Thread] = {}  # open ones, and the thread serving each
        self.connections_lock = threading.Lock()
        try:
            super().__init__((host, port), PolicyHandler)
        except BaseException:
            self.service.close()
            raise

    @property
    def url(self) -> str:
        """The base URL, e.g. http://127.0.0.1:8000 (an OpenAI client's base_url is this + "/v1")."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        """Serve in a daemon thread; the base URL. Stop with `close()`."""
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="covey-policy-server", daemon=True)
        self.thread.start()
        return self.url

    def process_request_thread(self, request, client_address) -> None:
        """One connection's thread (socketserver's), known to `close` while it runs."""
        with self.connections_lock:
            self.connections[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.connections_lock:
                self.connections.pop(request, None)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving (if started), close the listening socket and the open connections (a client's idle
        keep-alive one included), end the engine's thread after the requests it holds, and wait for the
        connections' threads: none is left running Python when the process exits."""
        if self.thread is not None:
            self.shutdown()
            self.thread.join(timeout_s)
            self.thread = None
        self.server_close()
        with self.connections_lock:
            open_now = dict(self.connections)
        for connection in open_now:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass
        self.service.close()
        for thread in open_now.values():
            thread.join(timeout_s)

    def take_episode(self, episode: str) -> list[dict]:
        """The episode's calls in order ({"route", "prompt_ids", "seed", "choices": [{"completion_ids",
        "logprobs", "finish_reason"}]}), and the episode forgotten; KeyError for an unknown episode."""
        calls = self.service.episodes.take(episode)
        self.service.episode_seeds.pop(episode, None)
        if calls is None:
            raise KeyError(f"no episode {episode!r}")
        return calls

    def seed_episode(self, episode: str, seed: int) -> None:
        """Seed an episode before its first call: its call k that sends no `seed` samples from
        `turn_seed(seed, k)` (covey/rollout/episodes.py), so its tokens depend on this seed alone, not on
        the requests batched with it (a training run's harness episodes; forgotten by `take_episode`)."""
        self.service.episode_seeds[episode] = seed

    def episode(self, episode: str) -> list[dict] | None:
        """The episode's calls so far (kept), None for an unknown episode."""
        return self.service.episodes.trace(episode)

    def between_batches(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run `fn()` on the engine's thread between two engine calls; its result."""
        return self.service.batcher.between_batches(fn, timeout_s)

    @property
    def stats(self):
        """The engine thread's counters (requests, engine_calls, rows, largest_batch)."""
        return self.service.batcher.stats
