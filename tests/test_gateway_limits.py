"""The gateway's bounds and its link to the supervisor, with the gateway's real uvicorn server on a
free port (in a thread, with small limits) and a ZeroMQ ROUTER in the supervisor's place that
answers what the test says: so that a connection can be dropped at a chosen moment and brought
back, and requests held in flight as long as a test needs. The same bounds against the real
pipeline are in tests/test_gateway.py.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import msgpack
import pytest
import zmq

from ntx.ctl.gateway.app import create_app
from ntx.ctl.gateway.limits import GatewayLimits
from ntx.ctl.gateway.server import make_server

from .pipeline_util import free_port, wait_for

HI = [{"role": "user", "content": "hi"}]
READY = {"state": "ready", "model": "/models/m.gguf", "uptime_s": 1.0, "requests": {"in_flight": 0}}


class SupervisorStandIn:
    """A ROUTER on ``address`` in a thread of its own: answers ``status`` with ``READY``, keeps
    every ``generate`` it receives (``generates``) and the id of every ``cancel``, and does what ``do`` asks between polls
    (sockets belong to their thread): ``drop`` closes the socket (every connection to it ends),
    ``bind`` opens a new one, ``reply`` sends a frame to the peer of a kept request."""

    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.generates: list[tuple[bytes, dict]] = []
        self.cancels: list[str] = []
        self._todo: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def do(self, action: str, *args) -> None:
        done = threading.Event()
        self._todo.put((action, args, done))
        assert done.wait(5.0), f"the stand-in did not {action}"

    def reply(self, rid: str, **ev) -> None:
        peer = next(p for p, msg in self.generates if msg["id"] == rid)
        self.do("send", peer, {"id": rid, **ev})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = self._bind(ctx)
        while not self._stop.is_set():
            while not self._todo.empty():
                action, args, done = self._todo.get()
                if action == "drop" and sock is not None:
                    sock.close(linger=0)
                    sock = None
                elif action == "bind":
                    sock = self._bind(ctx)
                elif action == "send":
                    sock.send_multipart([args[0], msgpack.packb(args[1])])
                done.set()
            if sock is None or not sock.poll(20):
                time.sleep(0.02) if sock is None else None
                continue
            peer, frame = sock.recv_multipart()
            msg = msgpack.unpackb(frame)
            if msg.get("op") == "status":
                sock.send_multipart([peer, msgpack.packb({"type": "status", "id": msg["id"], "status": READY})])
            elif msg.get("op") == "generate":
                self.generates.append((peer, msg))
            elif msg.get("op") == "cancel":
                self.cancels.append(msg["id"])
        if sock is not None:
            sock.close(linger=0)
        ctx.term()

    def _bind(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        return sock


@contextmanager
def gateway_on(pipeline_address: str, limits: GatewayLimits, api_key: str | None = None):
    """The gateway's own server (``server.make_server``) on a free port, in a thread."""
    port = free_port()
    app = create_app(pipeline_address, api_key, limits)
    server = make_server(app, "127.0.0.1", port, limits, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.started, 30.0, "the gateway's server to start")
        yield base, app.state.gateway
    finally:
        server.should_exit = True
        thread.join(10.0)


@pytest.fixture
def supervisor():
    s = SupervisorStandIn()
    yield s
    s.close()


SMALL = GatewayLimits(max_body_bytes=64 * 1024, max_requests=6, max_requests_per_client=3)


@pytest.fixture
def gateway(supervisor):
    with gateway_on(supervisor.address, SMALL) as (base, gw):
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30.0, "the gateway to see the stand-in")
        yield base, gw


def _ids(supervisor, n: int) -> list[str]:
    wait_for(lambda: len(supervisor.generates) >= n, 10.0, f"{n} generate requests at the stand-in")
    return [msg["id"] for _, msg in supervisor.generates]


def test_a_dropped_link_ends_every_request_in_flight_and_reconnects(supervisor, gateway):
    """The supervisor drops the gateway's connection (as libzmq does for a frame over its
    ZMQ_MAXMSGSIZE): a streamed request gets an error event and [DONE], a plain one a 503 with
    Retry-After, at once; the link reconnects and the gateway serves again."""
    base, gw = gateway
    results: dict[str, object] = {}

    def streamed():
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30,
                          json={"messages": HI, "stream": True}) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data:")]

    def plain():
        results["plain"] = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=30)

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    ids = _ids(supervisor, 2)
    for rid in ids:  # both requests started: their first event came
        supervisor.reply(rid, type="token", text="a", token=1)
    time.sleep(0.3)
    assert gw.link.in_flight == 2
    dropped_s = time.monotonic()
    supervisor.do("drop")
    for t in threads:
        t.join(10.0)
        assert not t.is_alive(), "a request hung after the link dropped"
    assert time.monotonic() - dropped_s < 5.0  # at once; the clients' own timeout is 30 s
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][5:])["error"]["code"] == "pipeline_lost"
    plain_r = results["plain"]
    assert plain_r.status_code == 503 and plain_r.headers["retry-after"] == "1"
    assert plain_r.json()["error"]["code"] == "pipeline_lost"
    assert gw.link.in_flight == 0 and gw.slots.n_held == 0

    # no supervisor: refused at once, nothing left behind
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert gw.link.in_flight == 0 and gw.slots.n_held == 0

    supervisor.do("bind")
    wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 10.0, "the link to reconnect")
    t = threading.Thread(target=plain)
    t.start()
    (rid,) = _ids(supervisor, 3)[2:]
    supervisor.reply(rid, type="done", text="ok", finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 1})
    t.join(10.0)
    assert results["plain"].status_code == 200 and results["plain"].json()["choices"][0]["text"] == "ok"


def test_stopping_the_gateway_ends_its_requests_in_flight_with_an_error(supervisor):
    """SIGTERM's shutdown ends the requests in flight at once (503 ``shutdown``, cancelled at
    the pipeline) instead of cutting them off after the graceful timeout (a 500 and a traceback)."""
    results: dict[str, httpx.Response] = {}
    with gateway_on(supervisor.address, SMALL) as (base, gw):
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30.0, "the gateway to see the stand-in")
        t = threading.Thread(target=lambda: results.update(r=httpx.post(f"{base}/v1/completions", json={"prompt": "x"},
                                                                        timeout=30)))
        t.start()
        (rid,) = _ids(supervisor, 1)
        supervisor.reply(rid, type="token", text="a", token=1)
        time.sleep(0.3)
        stopping_s = time.monotonic()
    t.join(10.0)
    # cut off after the graceful timeout, it was a 500 (or no answer at all)
    assert results["r"].status_code == 503 and results["r"].json()["error"]["code"] == "shutdown"
    assert time.monotonic() - stopping_s < 10.0
    wait_for(lambda: supervisor.cancels == [rid], 5.0, "the request's cancel at the pipeline")


def test_a_request_with_no_reply_ends_at_the_reply_timeout(supervisor):
    """The last bound on a request's life: no reply for ``reply_timeout_s`` (a reply lost on the
    way, whatever lost it) is a 504 for the client and a cancel for the pipeline."""
    with gateway_on(supervisor.address, GatewayLimits(reply_timeout_s=0.5)) as (base, gw):
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30.0, "the gateway to see the stand-in")
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "reply_timeout"
        assert time.monotonic() - t0 < 3.0
        (rid,) = _ids(supervisor, 1)
        wait_for(lambda: supervisor.cancels == [rid], 5.0, "the request's cancel at the pipeline")
        assert gw.link.in_flight == 0 and gw.slots.n_held == 0


def test_a_body_over_the_limit_is_413_before_it_is_read(supervisor, gateway):
    base, gw = gateway
    big = {"prompt": "x", "unknown_field": "y" * (SMALL.max_body_bytes + 1)}
    r = httpx.post(f"{base}/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a Content-Length that says too much is refused without reading a byte of the body
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 52428800\r\n\r\n")
        s.settimeout(5.0)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    # chunked, no length: counted as it comes
    def chunks():
        for _ in range(100):
            yield b" " * 4096
    r = httpx.post(f"{base}/v1/completions", content=chunks())
    assert r.status_code == 413
    assert supervisor.generates == [] and gw.slots.n_held == 0 and gw.body_bytes_in_flight == 0


def test_one_client_cannot_hold_every_slot(supervisor, gateway):
    """A client at its share gets 429 with Retry-After; another client is still served; the
    gateway full is 503 with Retry-After; every slot comes back."""
    base, gw = gateway
    port = int(base.rsplit(":", 1)[1])
    results: list[httpx.Response] = []

    def post(source: str):
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=30) as c:
            results.append(c.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}))

    held = [threading.Thread(target=post, args=("127.0.0.1",)) for _ in range(SMALL.max_requests_per_client)]
    for t in held:
        t.start()
    _ids(supervisor, SMALL.max_requests_per_client)
    post("127.0.0.1")
    r = results.pop()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    others = [threading.Thread(target=post, args=("127.0.0.2",)) for _ in range(SMALL.max_requests_per_client)]
    for t in others:
        t.start()
    _ids(supervisor, SMALL.max_requests)  # the other client was served
    post("127.0.0.3")
    r = results.pop()
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    for rid in _ids(supervisor, SMALL.max_requests):
        supervisor.reply(rid, type="error", code="overloaded", message="queue full")
    for t in held + others:
        t.join(10.0)
    assert [r.status_code for r in results] == [503] * SMALL.max_requests
    assert all(r.headers["retry-after"] == "1" for r in results)  # the pipeline's overloaded: 503, not 500
    assert gw.link.in_flight == 0 and gw.slots.n_held == 0 and not gw.slots.held


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"prompt": "x", "max_tokens": -(2 ** 64)}, "max_tokens"),
    ({"prompt": [1, 2 ** 64]}, "prompt"),
    ({"prompt": "x", "stream_options": "yes"}, "stream_options"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "x", "n": list(range(10000))}, "n"),  # its repr is not echoed whole
])
def test_out_of_range_values_are_400_and_leave_nothing_behind(supervisor, gateway, body, param):
    base, gw = gateway
    r = httpx.post(f"{base}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and len(r.text) < 1000
    assert supervisor.generates == [] and gw.link.in_flight == 0 and gw.slots.n_held == 0


def test_a_request_the_supervisor_would_refuse_as_a_frame_is_400_and_never_sent(supervisor):
    """More token ids or stop strings than a frame may hold (262,144 items) in a body under the
    gateway's bound: the gateway runs the supervisor's own frame checks first (such a frame got
    an id-less bad_frame no client could match, and the HTTP client waited for ever)."""
    from ntx.shared.messages import MAX_ARRAY_ITEMS

    with gateway_on(supervisor.address, GatewayLimits()) as (base, gw):
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30.0, "the gateway to see the stand-in")
        for body in ({"prompt": [1] * (MAX_ARRAY_ITEMS + 1)}, {"prompt": "x", "stop": ["a"] * (MAX_ARRAY_ITEMS + 1)}):
            r = httpx.post(f"{base}/v1/completions", content=json.dumps(body, separators=(",", ":")),
                           headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 400 and "cannot be sent" in r.json()["error"]["message"], r.text
        assert supervisor.generates == [] and gw.link.in_flight == 0 and gw.slots.n_held == 0


@pytest.mark.parametrize("raw, says", [
    (b"[" * 30_000 + b"]" * 30_000, "nests too deeply"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"prompt": "\xff"}', "not valid JSON"),
    (b"[1]", "must be a JSON object"),
])
def test_bodies_that_are_not_json_objects_are_400(supervisor, gateway, raw, says):
    base, gw = gateway
    r = httpx.post(f"{base}/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"]
    assert gw.slots.n_held == 0


TIGHT = GatewayLimits(idle_timeout_s=0.5, head_timeout_s=1.0, body_timeout_s=1.0, max_connections=8,
                      max_connections_per_client=4)


@pytest.fixture
def tight_gateway(supervisor):
    with gateway_on(supervisor.address, TIGHT) as (base, gw):
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30.0, "the gateway to see the stand-in")
        yield int(base.rsplit(":", 1)[1]), gw


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    s.settimeout(10.0)
    return s


def _closed_after_s(s: socket.socket) -> float:
    """Seconds until the gateway closes ``s`` (reading whatever it sends first)."""
    t0 = time.monotonic()
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_a_silent_connection_is_closed_after_the_idle_timeout(tight_gateway):
    port, _ = tight_gateway
    with _connect(port) as s:
        assert _closed_after_s(s) < TIGHT.idle_timeout_s + 1.0
    with _connect(port) as s:  # after a response, the same
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_after_s(s) < TIGHT.idle_timeout_s + 1.0


def test_a_head_that_trickles_in_is_cut_off_at_the_head_timeout(tight_gateway):
    port, _ = tight_gateway
    with _connect(port) as s:
        t0 = time.monotonic()
        try:
            for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000:  # a byte each 0.1 s: never idle
                s.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed_s = time.monotonic() - t0 + _closed_after_s(s)
    assert TIGHT.head_timeout_s - 0.2 < closed_s < TIGHT.head_timeout_s + 3.0  # unbounded before


def test_a_body_that_does_not_arrive_is_408_at_the_body_timeout(tight_gateway):
    port, gw = tight_gateway
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        t0 = time.monotonic()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - t0 < TIGHT.body_timeout_s + 1.0
    assert gw.slots.n_held == 0 and gw.body_bytes_in_flight == 0


def test_a_head_over_its_bound_is_400(tight_gateway):
    """A head still incomplete past ``max_head_bytes`` is refused (h11 holds at most that much
    of one; a head that came whole in one read is parsed)."""
    port, _ = tight_gateway
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (TIGHT.max_head_bytes // 2))
        time.sleep(0.2)
        s.sendall(b"a" * TIGHT.max_head_bytes)
        assert s.recv(4096).startswith(b"HTTP/1.1 400")


def test_connections_are_bounded_per_client_and_in_all(tight_gateway):
    """Past its share a client's connection gets a 503 and is closed at once; another client
    is served meanwhile; past the total, everyone's is until some close."""
    port, _ = tight_gateway
    held = [_connect(port, "127.0.0.2") for _ in range(TIGHT.max_connections_per_client)]
    try:
        extra = _connect(port, "127.0.0.2")
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer and b"connections open" in answer
        extra.close()
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        held += [_connect(port, "127.0.0.3") for _ in range(TIGHT.max_connections - len(held))]
        time.sleep(0.1)
        with _connect(port, "127.0.0.4") as s:
            assert s.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 5.0,
             "connections to be served again once the others closed")


def test_silent_connections_past_the_descriptor_limit_neither_deny_service_nor_flood_the_log(supervisor, tmp_path):
    """The gateway run as its own process with 1,024 descriptors: 1,100 silent connections from
    one client (which once held every descriptor, failed accept() and wrote 153 MB of log in
    15 s) take that client's share; the rest are refused, logged a few times; another client is
    served at once, and the silent ones are closed at the idle timeout."""
    import resource
    import subprocess
    import sys

    from ntx.ctl.gateway.limits import IDLE_TIMEOUT_S

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"this test opens 1,100 connections; the descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    port = free_port()
    log_path = tmp_path / "gateway.log"

    def at_1024_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", supervisor.address, "--http",
                                 f"127.0.0.1:{port}"], stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=at_1024_descriptors)
    silent: list[socket.socket] = []
    try:
        def ready():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 30.0, "the gateway to answer")
        for _ in range(1100):
            silent.append(socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)))
        opened_s = time.monotonic()
        for _ in range(5):
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)
            assert r.status_code == 200
        for s in silent:  # every one closed: the refused at once, the held at the idle timeout
            s.settimeout(IDLE_TIMEOUT_S + 5.0)
            _closed_after_s(s)
        assert time.monotonic() - opened_s < IDLE_TIMEOUT_S + 5.0
        assert proc.poll() is None
    finally:
        for s in silent:
            s.close()
        proc.terminate()
        proc.wait(10)
    text = log_path.read_text()
    assert 1 <= text.count("refused a connection from 127.0.0.2") <= 40, text[-2000:]  # of 972
    assert log_path.stat().st_size < 64 * 1024


def test_the_log_rate_limit_lets_a_few_through_and_counts_the_rest():
    import logging

    from ntx.ctl.gateway.server import LogRateLimit

    limit = LogRateLimit(per_window=3, window_s=0.2)
    record = lambda: logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "accept failed", None, None)
    assert [limit.filter(record()) for _ in range(10)] == [True] * 3 + [False] * 7
    time.sleep(0.25)
    later = record()
    assert limit.filter(later) and "7 more like this" in later.getMessage()


def test_status_for_key_holders_elsewhere_has_no_operator_fields(supervisor, gateway):
    """/api/status: a request from loopback (an operator) sees the model path; one from
    elsewhere (Starlette's test client names its peer "testclient") sees none of what only
    operators see, the supervisor's own list of them included."""
    from starlette.testclient import TestClient

    from ntx.ctl.gateway.app import OPERATOR_FIELDS
    from ntx.ctl.status_map import OPERATOR_STATUS_FIELDS

    assert set(OPERATOR_STATUS_FIELDS) <= set(OPERATOR_FIELDS)
    base, _ = gateway
    mine = httpx.get(f"{base}/api/status").json()
    assert mine["status"]["model"] == READY["model"] and mine["gateway"]["pid"] > 0  # the gateway's own pid
    # through a reverse proxy on this machine: the client it names
    proxied = httpx.get(f"{base}/api/status", headers={"X-Forwarded-For": "203.0.113.9"}).json()["status"]
    assert "model" not in proxied and proxied["state"] == "ready"
    full = {**READY, "listen": "tcp://127.0.0.1:5555", "supervisor_pid": 1, "reason": None, "log_dir": "/run/x/logs",
            "http": "127.0.0.1:8080", "backend": "cpu", "daemons": {"compute": {"pid": 7, "state": "ready"}}}
    with TestClient(create_app(f"tcp://127.0.0.1:{free_port()}", "k")) as http:  # no poll overwrites the status
        link = http.app.state.gateway.link
        link.status, link.status_at_s = full, time.monotonic()
        page = http.get("/api/status", headers={"Authorization": "Bearer k"}).json()
    st = page["status"]
    assert not set(OPERATOR_FIELDS) & set(st) and st["backend"] == "cpu"
    assert "pid" not in page["gateway"] and page["gateway"]["uptime_s"] >= 0
    assert st["daemons"] == {"compute": {"state": "ready"}}


def test_the_api_key_file_must_be_private_and_the_environment_is_the_fallback(tmp_path):
    import subprocess
    import sys

    key_file = tmp_path / "key"
    key_file.write_text("k")
    key_file.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", "tcp://127.0.0.1:9", "--http",
                        "0.0.0.0:9", "--api-key-file", str(key_file)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"ntx-gateway: error: --api-key-file {key_file} is readable by others (mode 644); refusing its secret"]

    from ntx.ctl.gateway.api_key import api_key

    assert not key_file.exists()  # a refused secret file is deleted all the same: others may have read it
    key_file.write_text("k")
    key_file.chmod(0o600)
    assert api_key(str(key_file)) == "k" and not key_file.exists()
    import os
    os.environ["NTX_API_KEY"] = "from-env"
    try:
        assert api_key(None) == "from-env" and "NTX_API_KEY" not in os.environ  # not passed on
    finally:
        os.environ.pop("NTX_API_KEY", None)


def test_eight_50_mb_bodies_at_once_cost_the_gateway_little_memory(supervisor):
    """Eight clients send 50 MB bodies at once without a Content-Length (chunked), which the
    gateway once read whole (673 MiB): each is 413 after 2 MiB, and the gateway process' peak
    resident memory grows by far less than one such body."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", supervisor.address, "--http",
                             f"127.0.0.1:{port}", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def peak_rss_bytes() -> int:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    answers_seen: list[bytes] = []

    def send_50_mb() -> None:
        chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(30.0)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            try:
                for _ in range(50):
                    s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                answers_seen.append(s.recv(4096))
            except ConnectionResetError:
                answers_seen.append(b"reset")

    try:
        wait_for(answers, 30.0, "the gateway to answer")
        before = peak_rss_bytes()
        threads = [threading.Thread(target=send_50_mb) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
        grown = peak_rss_bytes() - before
        assert grown < 64 << 20, f"the gateway's peak memory grew by {grown >> 20} MiB"
        assert any(a.startswith(b"HTTP/1.1 413") for a in answers_seen), answers_seen
        assert all(a.startswith(b"HTTP/1.1 413") or a in (b"", b"reset") for a in answers_seen), answers_seen
        assert answers()
    finally:
        proc.terminate()
        proc.wait(10)
