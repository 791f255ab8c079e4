"""The Python client of an ntx pipeline (docs/PROTOCOL.md has the wire format for other languages).

    from ntx.ctl.client import Client
    with Client() as c:
        for ev in c.generate("Why is the sky blue?", max_tokens=64):
            print(ev["text"], end="", flush=True)

One ZeroMQ DEALER socket carries any number of concurrent requests; replies are sorted by
request id, so several ``generate`` iterators can be consumed in any order. An error for a
frame whose id the server could not read names the frame's number on the connection instead
(``frame``); the client counts the frames it sends, so that error still ends the request it
belongs to. A request whose frame is over the server's frame bound is refused here, at once.

A pipeline that listens where other machines can reach it requires CURVE: give the server's
public key file and this client's secret key file (both from ``ntxctl keygen``), as arguments or
in ``NTX_CURVE_SERVER_KEY`` / ``NTX_CURVE_CLIENT_KEY`` (which ntxctl's commands read too).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict, deque
from typing import Any, Iterator

import zmq
import zmq.auth

from ntx.shared import messages as m
from ntx.shared.config import DEFAULT_LISTEN
from ntx.shared.errors import NtxError

DEFAULT_EVENT_TIMEOUT_S = 600.0


class ClientError(NtxError):
    """An error reply (``code``, message) or a pipeline that stopped answering."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


def _use_curve(sock: zmq.Socket, server_key: str, client_key: str) -> None:
    """Make ``sock`` a CURVE client of the server whose public key file is ``server_key``."""
    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, secret = zmq.auth.load_certificate(client_key)
    except (OSError, ValueError) as e:
        raise ClientError("bad_key", f"cannot read a CURVE key file: {e}") from None
    if not secret:
        raise ClientError("bad_key", f"{client_key} holds no secret key (give the .key_secret file from `ntxctl keygen`)")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class Client:
    def __init__(self, address: str = DEFAULT_LISTEN, event_timeout_s: float = DEFAULT_EVENT_TIMEOUT_S,
                 server_key: str | None = None, client_key: str | None = None) -> None:
        self.address = address
        self.event_timeout_s = event_timeout_s
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        server_key = server_key or os.environ.get("NTX_CURVE_SERVER_KEY")
        client_key = client_key or os.environ.get("NTX_CURVE_CLIENT_KEY")
        if server_key or client_key:
            if not (server_key and client_key):
                self.sock.close(linger=0)
                raise ClientError("bad_key", "CURVE needs both the server's public key and the client's secret key")
            try:
                _use_curve(self.sock, server_key, client_key)
            except ClientError:
                self.sock.close(linger=0)
                raise
        # A lost connection (the supervisor died: its sockets close) loses every reply owed on it:
        # the monitor tells a waiting caller at once instead of after event_timeout_s. No ZMTP
        # heartbeats: a client that reads slowly stops reading its socket, its pongs queue behind
        # the replies, and the heartbeat would cut it off (docs/PROTOCOL.md: TCP keepalive finds a vanished peer).
        # Only a connection that completed its handshake can be lost: a refused CURVE key is said
        # as such, and a server not up yet is simply retried (libzmq reconnects).
        self._lost = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                  | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self.listener_found = False  # a TCP connection was made (something listens there)
        self._connected = False  # a handshake completed
        self._gone = False  # and that connection dropped since
        self._curve = bool(server_key)  # this client offers CURVE (else ZeroMQ's NULL mechanism)
        self.sock.connect(address)
        self._inbox: dict[Any, deque[dict]] = defaultdict(deque)
        self._ids = itertools.count()
        self._frames_sent = 0  # frames sent on the connection: the server numbers them the same way
        self._frame_rids: dict[int, str] = {}  # frame number -> the request it carried, until its last reply
        self._rid_frames: dict[str, int] = {}
        self._prefix = f"c{os.getpid()}-{id(self) & 0xFFFF:x}-"

    def close(self) -> None:
        self.sock.disable_monitor()
        self._lost.close(linger=0)
        self.sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- wire ------------------------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        self.send_raw(m.pack(msg))

    def send_raw(self, frame: bytes, timeout_s: float | None = None) -> None:
        """Send a frame as is (``send`` and the tests of the server's handling of bad input).

        Never a blocking send: a connection whose handshake the server refused (a CURVE key it
        does not know, or no key where it requires one) is dropped by libzmq together with its
        queue, and a DEALER with no queue left blocks ``send`` forever. So the frame waits for
        room while the monitor is read: a refusal raises ``auth_refused`` at once, and no room
        within ``timeout_s`` (default ``event_timeout_s``) raises ``timeout``."""
        timeout_s = self.event_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        poller = None  # made only when the socket has no room: the usual send takes it at once
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                pass
            if poller is None:
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLOUT)
                poller.register(self._lost, zmq.POLLIN)
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise ClientError("timeout", f"could not send to {self.address} within {timeout_s:.0f} s: "
                                             "no connection took the request")
            if self._lost in dict(poller.poll(int(left_s * 1000) + 1)):
                self._connection_events()  # raises auth_refused for a refused handshake
        self._frames_sent += 1

    def _send_request(self, msg: dict[str, Any], timeout_s: float | None = None) -> None:
        """Send a generate or status map, remembering its frame's number until its last reply;
        one over the frame bound is refused here (the server could only refuse it too, and
        libzmq drops the connection of a frame over 16 MiB)."""
        frame = m.pack(msg)
        if len(frame) > m.MAX_FRAME_BYTES:
            raise ClientError("bad_frame", f"request of {len(frame)} bytes is larger than the frame limit of "
                                           f"{m.MAX_FRAME_BYTES} bytes (docs/PROTOCOL.md, Limits)")
        self.send_raw(frame, timeout_s)
        if isinstance(msg.get("id"), str):
            self._frame_rids[self._frames_sent] = msg["id"]
            self._rid_frames[msg["id"]] = self._frames_sent

    def _sort(self, ev: Any) -> None:
        """File a reply under its request: by ``id``, or for an id-less error by its ``frame``."""
        rid = ev.get("id") if isinstance(ev, dict) else None
        if rid is None and isinstance(ev, dict) and ev.get("type") == "error":
            rid = self._frame_rids.get(ev.get("frame"))
        if rid is not None and isinstance(ev, dict) and ev.get("type") in ("done", "error", "status"):
            self._frame_rids.pop(self._rid_frames.pop(rid, None), None)
        self._inbox[rid].append(ev)

    def _pump(self, timeout_s: float) -> bool:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._lost, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if self._lost in ready:
            self._connection_events()
        if self._gone and self.sock not in ready:  # the replies that came before the loss are read first
            raise ClientError("pipeline_lost", f"the connection to {self.address} was lost (the supervisor "
                                               f"died or stopped answering); requests in flight there are lost")
        if not ready:
            return False
        while self.sock.poll(0):
            self._sort(m.unpack(self.sock.recv()))
        return True

    def _connection_events(self) -> None:
        """Read the socket monitor: a handshake done, a key refused or CURVE on one side only
        (``auth_refused``), or an established connection lost (``_gone``: ``pipeline_lost`` once
        the replies that came before it are read)."""
        from zmq.utils.monitor import recv_monitor_message

        while self._lost.poll(0):
            message = recv_monitor_message(self._lost)
            event, event_value = message["event"], message["value"]
            if event == zmq.EVENT_CONNECTED:
                self.listener_found = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise ClientError("auth_refused", f"{self.address} refused this client's CURVE key: give the key "
                                                  "pair the operator let in (NTX_CURVE_CLIENT_KEY, ntxctl keygen)")
            elif (event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  and event_value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                if self._curve:
                    raise ClientError("auth_refused", f"{self.address} does not use CURVE: leave out the CURVE keys "
                                                      "(NTX_CURVE_SERVER_KEY, NTX_CURVE_CLIENT_KEY)")
                raise ClientError("auth_refused", f"{self.address} requires CURVE keys and refused this client, "
                                                  "which has none: give the server's public key and this client's "
                                                  "key pair in NTX_CURVE_SERVER_KEY and NTX_CURVE_CLIENT_KEY "
                                                  "(docs/PROTOCOL.md, Authentication)")
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._gone = True

    def next_event(self, rid: Any, timeout_s: float | None = None) -> dict:
        """The next reply for request ``rid`` (None: replies with no id, e.g. to a bad frame)."""
        timeout_s = self.event_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._inbox[rid]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pump(left):
                raise ClientError("timeout", f"no reply from {self.address} for request {rid!r} within {timeout_s:.0f} s")
        ev = self._inbox[rid].popleft()
        if not self._inbox[rid]:
            del self._inbox[rid]
        return ev

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt: str | None = None, *, messages=None, tokens=None, id: str | None = None, **params) -> str:
        """Send a generate request; returns its id. Read replies with ``events(id)``."""
        rid = id or f"{self._prefix}{next(self._ids)}"
        msg: dict[str, Any] = {"op": "generate", "id": rid}
        if prompt is not None:
            msg["prompt"] = prompt
        if messages is not None:
            msg["messages"] = messages
        if tokens is not None:
            msg["tokens"] = list(tokens)
        msg.update({k: v for k, v in params.items() if v is not None})
        self._send_request(msg)
        return rid

    def events(self, rid: str) -> Iterator[dict]:
        """Replies of ``rid`` until ``done``; an ``error`` reply raises ClientError."""
        while True:
            ev = self.next_event(rid)
            if ev.get("type") == "error":
                raise ClientError(ev.get("code", "error"), ev.get("message", ""))
            yield ev
            if ev.get("type") == "done":
                return

    def generate(self, prompt: str | None = None, **kw) -> Iterator[dict]:
        """Stream a generation: ``token`` events, then the ``done`` event."""
        return self.events(self.submit(prompt, **kw))

    def complete(self, prompt: str | None = None, **kw) -> dict:
        """Run a generation to the end; returns the ``done`` event."""
        kw.setdefault("stream", False)
        done = None
        for ev in self.generate(prompt, **kw):
            done = ev
        return done

    def cancel(self, rid: str) -> None:
        self.send({"op": "cancel", "id": rid})

    def status(self, timeout_s: float = 5.0) -> dict:
        rid = f"{self._prefix}status-{next(self._ids)}"
        self._send_request({"op": "status", "id": rid}, timeout_s)
        return self.next_event(rid, timeout_s)["status"]


def pipeline_available(address: str = DEFAULT_LISTEN, timeout_s: float = 0.5) -> bool:
    """Whether a pipeline answers a status request at ``address``."""
    try:
        with Client(address) as c:
            c.status(timeout_s=timeout_s)
            return True
    except (ClientError, zmq.ZMQError):
        return False
