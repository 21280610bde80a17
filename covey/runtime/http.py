"""JSON over HTTP, for covey's servers (`covey serve-reward`, `covey serve-policy`): the request handler's
common part. Keep-alive connections, a per-request socket timeout (a client that stalls mid-body is cut
off), one JSON body per reply with its length, a bearer-token check in constant time; `connect_error`, the
one TCP probe of a service covey is about to use. Standard library only.
"""

from __future__ import annotations

import hmac
import json
import socket
from http.server import BaseHTTPRequestHandler


def connect_error(host: str, port: int, timeout_s: float) -> str | None:
    """None when one TCP connection to host:port opens within `timeout_s`; else why not, in words: "no
    connection to host:port within T s (reason)" (the reachability checks made before any model loads)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        return f"no connection to {host}:{port} within {timeout_s:g} s ({err.strerror or type(err).__name__})"
    return None


class JsonHandler(BaseHTTPRequestHandler):
    """One request of a JSON server; a subclass names its realm and where its settings live."""

    protocol_version = "HTTP/1.1"  # keep-alive, so clients can pool connections
    realm = "covey"
    """The realm a 401's WWW-Authenticate header names."""

    def request_timeout_s(self) -> float:
        """Seconds the socket waits for a client (its server's setting)."""
        raise NotImplementedError

    def verbose(self) -> bool:
        """Log every request to stderr (http.server's lines)."""
        return False

    def setup(self) -> None:
        self.timeout = self.request_timeout_s()
        super().setup()

    def log_message(self, fmt: str, *args) -> None:
        if self.verbose():
            super().log_message(fmt, *args)

    def send_json(self, code: int, payload: dict, close: bool = False, allow: str = "") -> None:
        """`payload` as the reply's body; `close`: the connection ends after it; `allow`: a 405's methods."""
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code == 401:
            self.send_header("WWW-Authenticate", f'Bearer realm="{self.realm}"')
        if allow:
            self.send_header("Allow", allow)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":  # a reply to HEAD has headers only
            self.wfile.write(body)

    def bearer_is(self, token: str) -> bool:
        """The request's Authorization header is `Bearer <token>`, compared in constant time."""
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
