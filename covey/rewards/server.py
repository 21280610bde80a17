"""`covey serve-reward`: any configured reward source over HTTP (standard library only).

    POST /score    Authorization: Bearer <token>
      {"items": [{"prompt": str | messages, "completion": str | messages, "columns": {"answer": "42", ...}}, ...]}
      -> 200 {"results": [{"reward": 1.0, "parts": {"correctness": 1.0}} | {"error": "..."}, ...], "errors": 1}
    GET /health    -> 200 {"status": "ok", "terms": ["correctness", ...]}   (no token: it reveals nothing else)

The reward is the same weighted sum `covey train` computes from the `reward.*`
config keys (rules, user callables, learned RM / PRM, even another remote).

Status codes: 401 missing or wrong token; 400 malformed JSON, JSON nested too
deeply to parse, or not the schema above; 411 no Content-Length; 413 body over
--max-body-mb or more than --max-batch items; 408 a client that stalls mid-body
(the per-request socket timeout); 404 other paths; 405 other methods (PUT,
DELETE, PATCH, OPTIONS, HEAD), with an Allow header. Every error body is one line
of JSON, {"error": "..."}. A batch mixing good and bad items
is answered 200 with one result per item: a bad item (wrong types, or a reward
function fault on it) gets `{"error": ...}`, the others are scored. Items
whose faults come from a whole-batch exception are re-scored one by one so a
single bad item cannot fail its neighbours.

Security: binds to 127.0.0.1 unless --host says otherwise; the token comes
from an environment variable (never from the command line, where `ps` shows
it) and is compared in constant time. Plain HTTP: put TLS in front of it
(a reverse proxy) before exposing it beyond one machine.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from covey.runtime.http import JsonHandler

MiB = 2**20
ALLOWED = {"/score": "POST", "/health": "GET"}
"""The method each path answers; the Allow header of a 405."""


class ServeError(ValueError):
    """The reward server cannot start as configured (one line)."""


@dataclass
class ServerLimits:
    max_body_bytes: int = 8 * MiB
    """Largest request body accepted (413 beyond)."""
    max_batch: int = 256
    """Most items per request (413 beyond)."""
    request_timeout_s: float = 30.0
    """Socket timeout while reading a request: a stalled client is dropped with 408."""


# --------------------------------------------------------------------------- scoring


def _is_text(value) -> bool:
    """A string, or chat messages: a list of {"role", "content"} dicts."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                           for m in value)


def item_error(item) -> str | None:
    """Why an item cannot be scored, or None."""
    if not isinstance(item, dict):
        return f"an item must be an object, got {type(item).__name__}"
    for key in ("prompt", "completion"):
        if key not in item:
            return f"missing '{key}'"
        if not _is_text(item[key]):
            return f"'{key}' must be a string or a list of chat messages"
    columns = item.get("columns", {})
    if not isinstance(columns, dict):
        return "'columns' must be an object"
    if {"prompts", "completions"} & set(columns):
        return "'columns' must not be named prompts or completions"
    return None


class RewardService:
    """Scores items with a Rewarder's terms and reports faults per item."""

    def __init__(self, rewarder):
        self.rewarder = rewarder
        self.term_names = [t.name for t in rewarder.terms]

    def _score_group(self, items: list[dict]) -> list[dict]:
        """Items sharing one set of column names, scored as one batch per term."""
        prompts = [it["prompt"] for it in items]
        completions = [it["completion"] for it in items]
        keys = sorted(items[0].get("columns", {}))
        columns = {k: [it["columns"][k] for it in items] for k in keys}
        totals, parts = [None] * len(items), [{} for _ in items]
        errors: list[str | None] = [None] * len(items)
        for term in self.rewarder.terms:
            # The same checks as training (count, None, NaN, exceptions, timeout), per sample.
            values, faults = self.rewarder.run_term(term, prompts, completions, columns)
            whole_batch = len(items) > 1 and all(f is not None for f in faults) and len(set(faults)) == 1
            if whole_batch and not faults[0].startswith("timed out"):  # one exception for all: find the culprits
                return [r for it in items for r in self._score_group([it])]
            for i, (value, fault) in enumerate(zip(values, faults)):
                if fault is not None and errors[i] is None:
                    errors[i] = f"reward '{term.name}' {fault}"
                scored = not math.isnan(value)  # NaN: the function returned None (did not score it)
                parts[i][term.name] = value if scored else None
                if scored:
                    totals[i] = (totals[i] or 0.0) + term.weight * value
        # An item that no function scored has reward null: the client passes TRL's None on.
        return [{"error": e} if e else {"reward": t, "parts": p} for t, p, e in zip(totals, parts, errors)]

    def score(self, items: list) -> list[dict]:
        results: list[dict | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            problem = item_error(item)
            if problem:
                results[i] = {"error": problem}
            else:
                groups.setdefault(tuple(sorted(item.get("columns", {}))), []).append(i)
        for index in groups.values():
            for i, result in zip(index, self._score_group([items[i] for i in index])):
                results[i] = result
        return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- HTTP


class RewardHandler(JsonHandler):
    """One request; the server carries `service`, `token`, `limits` and `verbose`."""

    server_version = "covey-reward/1"
    realm = "covey-reward"

    def request_timeout_s(self) -> float:
        return self.server.limits.request_timeout_s

    def verbose(self) -> bool:
        return self.server.verbose

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/health":
            self.send_json(200, {"status": "ok", "terms": self.server.service.term_names})
        else:
            self.send_json(404, {"error": f"no such path {self.path}; use POST /score or GET /health"})

    def _authorised(self) -> bool:
        return self.bearer_is(self.server.token)

    def _read_json(self):
        """The parsed body, or None after an error response was sent."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.send_json(411, {"error": "Content-Length required"}, close=True)
            return None
        if int(length) > self.server.limits.max_body_bytes:  # refuse before reading a byte of it
            self.send_json(413, {"error": f"body of {length} bytes exceeds the limit of "
                                      f"{self.server.limits.max_body_bytes}"}, close=True)
            return None
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            self.send_json(408, {"error": "request body not received in time"}, close=True)
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.send_json(400, {"error": f"malformed JSON: {e}"})
            return None
        except RecursionError:  # the parser recurses once per level of nesting
            self.send_json(400, {"error": "JSON nested too deeply"})
            return None

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self.send_json(404, {"error": f"no such path {self.path}; use POST /score"}, close=True)
            return
        if not self._authorised():
            self.send_json(401, {"error": "missing or wrong bearer token"}, close=True)
            return
        body = self._read_json()
        if body is None:
            return
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            self.send_json(400, {"error": "body must be an object with a list 'items'"})
            return
        if len(items) > self.server.limits.max_batch:
            limit = self.server.limits.max_batch
            self.send_json(413, {"error": f"{len(items)} items exceed the batch limit of {limit}"})
            return
        results = self.server.service.score(items)
        self.send_json(200, {"results": results, "errors": sum("error" in r for r in results)})

    def _reject(self) -> None:
        allow = ALLOWED.get(self.path.rstrip("/"), ", ".join(sorted(set(ALLOWED.values()))))
        self.send_json(405, {"error": f"method {self.command} not allowed; use {allow}"}, close=True, allow=allow)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _reject  # noqa: N815


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, service: RewardService, token: str, limits: ServerLimits, verbose: bool = False):
        if not token:
            raise ServeError("the reward server needs a non-empty bearer token")
        self.service, self.token, self.limits, self.verbose = service, token, limits, verbose
        super().__init__(address, RewardHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def start_in_thread(server: RewardServer) -> threading.Thread:
    """serve_forever in a daemon thread (tests, notebooks); stop with server.shutdown(), which returns
    within the 0.05 s the loop waits between checks of its stop flag (serve_forever's default is 0.5 s)."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="covey-reward-server", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- CLI
