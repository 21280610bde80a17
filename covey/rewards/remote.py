"""A reward source served over HTTP (by `covey serve-reward` or anything speaking its JSON).

`RemoteReward(url, token)` is a TRL-shaped reward function: it sends the batch
in chunks of `batch_size` items to `POST {url}/score` and returns one float per
completion, or None for an item the server could not score (the Rewarder's
`reward.on_error` policy then applies, as for any local function).

Transport: keep-alive `http.client` connections in a small pool (one per
concurrent caller, reused across calls); a socket timeout per request;
connection errors, timeouts, 408/429/5xx answers are retried with exponential
backoff and jitter; after the last retry a `RemoteRewardError` names the URL,
the number of attempts and the last failure. 400/401/404/413 are not retried:
sending the same request again cannot fix them.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import queue
import random
import time
from urllib.parse import urlsplit

from covey.runtime.http import connect_error

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    """The remote reward service could not score a batch (one line)."""


def check_reachable(url: str, timeout_s: float = 2.0) -> None:
    """One TCP connection to the service's host and port, before any model loads: a service that is down
    or a wrong URL is one line now, not a failed step after the model load and the baseline evaluation."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteRewardError(f"reward.remote_url must look like http://host:port, got {url!r}")
    why = connect_error(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), timeout_s)
    if why:
        raise RemoteRewardError(f"reward.remote_url={url}: {why}: start the scorer (covey serve-reward --port N) "
                                "or fix the URL")


def _per_item(columns: dict, n: int) -> list[dict]:
    """Dataset columns (a list per sample, or one value for all) -> one JSON object per item."""
    out: list[dict] = [{} for _ in range(n)]
    for key, value in columns.items():
        values = list(value) if isinstance(value, (list, tuple)) and len(value) == n else [value] * n
        for row, v in zip(out, values):
            row[key] = v.tolist() if hasattr(v, "tolist") else v
    return out


class RemoteReward:
    """TRL-shaped reward function backed by a remote service."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, batch_size: int = 64, pool_size: int = 8):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteRewardError(f"remote reward URL must look like http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.path = parts.path.rstrip("/") + "/score"
        self.host, self.port, self.https = parts.hostname, parts.port, parts.scheme == "https"
        self.token, self.timeout_s, self.retries = token, timeout_s, retries
        self.backoff_s, self.batch_size = backoff_s, batch_size
        self.pool: queue.LifoQueue = queue.LifoQueue(maxsize=pool_size)
        self.last_item_errors: list[str] = []

    @classmethod
    def from_env(cls, url: str, token_env: str, **kwargs) -> "RemoteReward":
        """The service at `url` (reward.remote_url) with the bearer token of the environment variable `token_env`
        (reward.remote_token_env); `kwargs` as the constructor takes them."""
        token = os.environ.get(token_env, "")
        if not token:
            raise RemoteRewardError(f"reward.remote_url is set but {token_env} holds no bearer token")
        return cls(url, token, **kwargs)

    # ------------------------------------------------------------------ connections

    def _connection(self) -> http.client.HTTPConnection:
        try:
            return self.pool.get_nowait()
        except queue.Empty:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            return cls(self.host, self.port, timeout=self.timeout_s)

    def _release(self, conn: http.client.HTTPConnection) -> None:
        try:
            self.pool.put_nowait(conn)
        except queue.Full:
            conn.close()

    def close(self) -> None:
        while not self.pool.empty():
            self.pool.get_nowait().close()

    def _post_once(self, body: bytes) -> tuple[int, bytes]:
        """One request on a pooled connection; a broken connection is closed, never reused."""
        conn = self._connection()
        try:
            conn.request("POST", self.path, body=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            self._release(conn)
        return response.status, data

    # ------------------------------------------------------------------ requests

    def _post(self, payload: dict) -> dict:
        """POST with retries; the decoded answer of a 200, else RemoteRewardError."""
        body = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                status, data = self._post_once(body)
            except TimeoutError:
                last = f"timed out after {self.timeout_s:g}s"
                continue
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if status == 200:
                try:
                    return json.loads(data)
                except json.JSONDecodeError:
                    raise RemoteRewardError(f"remote reward {self.url}: answer is not JSON") from None
            message = _error_text(data)
            if status not in RETRY_STATUS:
                hint = " (check the bearer token)" if status == 401 else ""
                raise RemoteRewardError(f"remote reward {self.url}: HTTP {status}: {message}{hint}")
            last = f"HTTP {status}: {message}"
        raise RemoteRewardError(f"remote reward {self.url}: no answer after {self.retries + 1} attempts "
                                f"(last: {last})")

    def score_items(self, items: list[dict]) -> list[dict]:
        """Raw per-item results ({"reward", "parts"} or {"error"}), in order, chunked by batch_size."""
        results: list[dict] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start:start + self.batch_size]
            answer = self._post({"items": chunk})
            got = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(got, list) or len(got) != len(chunk):
                raise RemoteRewardError(f"remote reward {self.url}: expected {len(chunk)} results")
            results += got
        return results

    def __call__(self, prompts, completions, trainer_state=None, **columns) -> list[float | None]:
        """The service's reward per item: None where no function there scored it (TRL's None), NaN
        (a fault under reward.on_error) where it answered with an error for that item."""
        rows = _per_item(columns, len(completions))
        items = [{"prompt": p, "completion": c, "columns": col} for p, c, col in zip(prompts, completions, rows)]
        results = self.score_items(items)
        self.last_item_errors = [r["error"] for r in results if "error" in r]
        return [r.get("reward") if isinstance(r, dict) and "error" not in r else math.nan for r in results]


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data).get("error", ""))[:200]
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return data[:200].decode(errors="replace")
