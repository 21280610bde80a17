"""`covey serve-reward` and the RemoteReward client: status codes, per-item faults, load, stalls, deaths."""

import concurrent.futures as cf
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from covey.rewards.combine import Rewarder, RewardTerm
from covey.rewards.remote import RemoteReward, RemoteRewardError
from covey.rewards.rules import correctness_reward
from covey.rewards.server import RewardServer, RewardService, ServerLimits, start_in_thread

TOKEN = "s3cret-token"


def picky_reward(prompts, completions, **columns):
    """Raises for the whole batch if any completion is 'BOOM'; None (not scored, TRL's convention)
    for 'NONE'; NaN (a fault) for 'NAN'; else 0.5."""
    if "BOOM" in completions:
        raise ValueError("cannot score BOOM")
    return [None if c == "NONE" else float("nan") if c == "NAN" else 0.5 for c in completions]


def _serve(request_timeout_s: float, max_body_bytes: int = 4096):
    rewarder = Rewarder([RewardTerm("correctness", correctness_reward, 1.0),
                         RewardTerm("picky", picky_reward, 2.0)], on_error="zero", timeout_s=5)
    srv = RewardServer(("127.0.0.1", 0), RewardService(rewarder), TOKEN,
                       ServerLimits(max_body_bytes=max_body_bytes, max_batch=16, request_timeout_s=request_timeout_s))
    start_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def server():
    yield from _serve(request_timeout_s=0.5)  # short, so the stalled-client test is quick


@pytest.fixture
def patient_server():
    # For the load test: on a loaded CPU a client thread can pause between sending the headers and
    # the body for longer than 0.5 s, and the server would rightly answer 408 (seen once in a run
    # beside a training job).
    yield from _serve(request_timeout_s=10)


@pytest.fixture
def roomy_server():
    yield from _serve(request_timeout_s=5, max_body_bytes=2**20)  # room for a 200 kB body


def raw(srv, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=5)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


def auth(extra=None):
    return {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **(extra or {})}


def item(completion, answer="12"):
    return {"prompt": "What is 3*4?", "completion": completion, "columns": {"answer": answer}}


def test_health_needs_no_token(server):
    assert raw(server, "GET", "/health") == (200, {"status": "ok", "terms": ["correctness", "picky"]})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_missing_or_wrong_token_is_401(server, headers):
    status, data = raw(server, "POST", "/score", json.dumps({"items": [item("12")]}).encode(), headers)
    assert status == 401 and "token" in data["error"]


@pytest.mark.parametrize("body, message", [(b"{not json", "malformed JSON"), (b'{"items": 3}', "list 'items'"),
                                           (b"[1, 2]", "list 'items'")])
def test_malformed_json_is_400(server, body, message):
    status, data = raw(server, "POST", "/score", body, auth())
    assert status == 400 and message in data["error"]


def test_oversized_body_and_batch_are_413(server):
    big = json.dumps({"items": [item("x" * 5000)]}).encode()
    status, data = raw(server, "POST", "/score", big, auth())
    assert status == 413 and "exceeds the limit of 4096" in data["error"]
    many = json.dumps({"items": [item("1")] * 17}).encode()
    status, data = raw(server, "POST", "/score", many, auth())
    assert status == 413 and "17 items exceed the batch limit of 16" in data["error"]


def test_unknown_path_and_method(server):
    assert raw(server, "GET", "/nope")[0] == 404
    assert raw(server, "PUT", "/score", b"{}", auth())[0] == 405


def test_deeply_nested_json_is_400_on_a_connection_kept_open(roomy_server):
    # Python's JSON parser recurses once per nesting level: 100000 nested lists exceed its recursion limit.
    conn = http.client.HTTPConnection("127.0.0.1", roomy_server.server_address[1], timeout=10)
    conn.request("POST", "/score", body=b"[" * 100_000 + b"]" * 100_000, headers=auth())
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 400 and json.loads(body) == {"error": "JSON nested too deeply"}
    assert b"\n" not in body
    conn.request("GET", "/health")  # the same keep-alive connection still serves
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
@pytest.mark.parametrize("path, allow", [("/score", "POST"), ("/health", "GET"), ("/nope", "GET, POST")])
def test_other_methods_are_405_with_allow(server, method, path, allow):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    conn.request(method, path, body=b"{}", headers=auth())
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert (resp.status, resp.getheader("Allow")) == (405, allow)
    assert resp.getheader("Content-Type") == "application/json"
    if method != "HEAD":  # a reply to HEAD has no body
        assert json.loads(body) == {"error": f"method {method} not allowed; use {allow}"}


def test_mixed_batch_is_scored_per_item(server):
    items = [item("The answer is 12"), item("13"), {"prompt": "p"}, item(7), item("BOOM"), item("NONE"),
             {"prompt": "p", "completion": "12", "columns": {}}, "not an object"]
    status, data = raw(server, "POST", "/score", json.dumps({"items": items}).encode(), auth())
    assert status == 200
    res = data["results"]
    assert res[0] == {"reward": 1.0 + 2 * 0.5, "parts": {"correctness": 1.0, "picky": 0.5}}
    assert res[1] == {"reward": 0.0 + 2 * 0.5, "parts": {"correctness": 0.0, "picky": 0.5}}
    assert res[2] == {"error": "missing 'completion'"}
    assert "must be a string" in res[3]["error"]
    assert res[4] == {"error": "reward 'picky' raised ValueError: cannot score BOOM"}  # isolated, not the batch
    # None is TRL's "not scored": the part is null and adds nothing to the total
    assert res[5] == {"reward": 0.0, "parts": {"correctness": 0.0, "picky": None}}
    assert "correctness' raised ValueError: correctness needs the reference answers" in res[6]["error"]
    assert "must be an object" in res[7]["error"]
    assert data["errors"] == 5


def test_client_scores_and_reports_bad_items_as_faults(server):
    client = RemoteReward(server.url, TOKEN, batch_size=2)
    out = client(["q"] * 4, ["12", "5", "NAN", "NONE"], answer=["12"] * 4, completion_lengths=[1] * 4)
    assert out[:2] == [2.0, 1.0] and math.isnan(out[2])  # an item the service failed on: NaN, a fault
    assert out[3] == 0.0  # scored by correctness (0); picky's None adds nothing
    assert client.last_item_errors == ["reward 'picky' returned nan"]
    rewarder = Rewarder([RewardTerm("remote", client, 1.0)], on_error="zero")
    scores = rewarder(["q"] * 4, ["12", "5", "NAN", "NONE"], {"answer": ["12"] * 4})
    assert scores.total.tolist() == [2.0, 1.0, 0.0, 0.0] and scores.errors == 1 and scores.unscored == 0


def test_client_wrong_token_fails_at_once(server):
    client = RemoteReward(server.url, "bad", retries=3, backoff_s=5)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match="HTTP 401: missing or wrong bearer token .check the bearer"):
        client(["q"], ["12"], answer=["12"])
    assert time.perf_counter() - t0 < 2  # 401 is not retried (backoff would take >= 2.5 s)


def test_load_1000_requests_concurrency_8(patient_server):
    """1000 requests from 8 threads through one pooled client: every answer right, none lost."""
    client = RemoteReward(patient_server.url, TOKEN, timeout_s=30, retries=0, pool_size=8)

    def one(i):
        answer = str(i % 50)
        return client(["q", "q"], [answer, "nope"], answer=[answer, answer])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(1000)))
    elapsed = time.perf_counter() - t0
    assert results == [[2.0, 1.0]] * 1000
    print(f"1000 requests, concurrency 8: {elapsed:.2f}s ({1000 / elapsed:.0f} req/s)")


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends before it closes: headers and body may come in separate reads."""
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_server_drops_a_client_that_stalls_mid_body(server):
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                 + b"\r\nContent-Length: 100\r\n\r\n{\"items\"")
    reply = read_until_closed(sock).decode()  # the server closes after its 408; a timeout here fails
    sock.close()
    assert reply.startswith("HTTP/1.1 408") and "not received in time" in reply


# --------------------------------------------------------------------------- servers that stall or die


@pytest.fixture
def stalling_port():
    """Accepts connections, reads, never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_client_times_out_retries_with_backoff_then_fails(stalling_port):
    client = RemoteReward(f"http://127.0.0.1:{stalling_port}", TOKEN, timeout_s=0.2, retries=2, backoff_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=r"no answer after 3 attempts \(last: timed out after 0.2s\)"):
        client(["q"], ["1"], answer=["1"])
    assert time.perf_counter() - t0 >= 3 * 0.2 + 0.05 * 0.5 * (1 + 2)  # 3 timeouts + 2 backoffs


def test_client_against_a_dead_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    client = RemoteReward(f"http://127.0.0.1:{port}", TOKEN, retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="no answer after 2 attempts .last: ConnectionRefusedError"):
        client(["q"], ["1"], answer=["1"])


def test_client_when_the_server_dies_between_calls():
    """A real death: the server process is SIGKILLed while the client holds a pooled keep-alive connection."""
    proc = start_cli_server()
    try:
        client = RemoteReward(server_url(proc), TOKEN, retries=1, backoff_s=0.01)
        assert client(["q"], ["Answer: 12"], answer=["12"]) == [1.5]  # leaves a pooled connection
        proc.kill()
        proc.wait(timeout=20)
        with pytest.raises(RemoteRewardError, match="no answer after 2 attempts"):
            client(["q"], ["12"], answer=["12"])
    finally:
        proc.kill()
        proc.wait(timeout=20)


class FlakyHandler(BaseHTTPRequestHandler):
    """503 for the first two requests, then a valid answer."""
    protocol_version = "HTTP/1.1"
    calls = 0

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        n = int(self.headers["Content-Length"])
        items = json.loads(self.rfile.read(n))["items"]
        type(self).calls += 1
        status, payload = (503, {"error": "busy"}) if type(self).calls <= 2 else \
            (200, {"results": [{"reward": 0.25}] * len(items)})
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_client_retries_503_then_succeeds():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        client = RemoteReward(f"http://127.0.0.1:{srv.server_address[1]}", TOKEN, retries=3, backoff_s=0.01)
        assert client(["q", "q"], ["a", "b"]) == [0.25, 0.25]
        assert FlakyHandler.calls == 3
    finally:
        srv.shutdown()
        srv.server_close()


def test_bad_url_is_a_one_line_error():
    with pytest.raises(RemoteRewardError, match="must look like http://host:port"):
        RemoteReward("127.0.0.1:8765", TOKEN)


# --------------------------------------------------------------------------- the CLI


def start_cli_server() -> subprocess.Popen:
    """`covey serve-reward` in its own process: correctness 1 + format 0.5, on a free port."""
    env = {**os.environ, "COVEY_REWARD_TOKEN": TOKEN}
    return subprocess.Popen([sys.executable, "-m", "covey.cli", "serve-reward", "--port", "0", "reward.format=0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def server_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert "listening on http://127.0.0.1:" in line, proc.stderr.read()
    return line.split("listening on ")[1].split()[0]


def test_serve_reward_cli_serves_and_stops_on_sigterm():
    proc = start_cli_server()
    try:
        client = RemoteReward(server_url(proc), TOKEN)
        assert client(["q", "q"], ["Answer: 12", "11"], answer=["12", "12"]) == [1.5, 0.0]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_serve_reward_cli_without_token_is_one_line_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "COVEY_REWARD_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "covey.cli", "serve-reward", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("covey serve-reward: error: set COVEY_REWARD_TOKEN to the bearer token "
                                   "clients must send")
