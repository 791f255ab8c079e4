"""The gateway's one ZeroMQ connection to the supervisor, shared by every HTTP request.

One DEALER socket carries all requests (the protocol allows any number in flight per
connection); a reader task sorts replies into one queue per request id. A second task asks for
the pipeline's status once a second and keeps the last minute of it: /health, /metrics and the
status page read that copy instead of each asking the supervisor.

The connection can drop (the supervisor restarted or died, or dropped it): every reply owed on
it is then lost, so the socket's monitor ends each request in flight with a ``pipeline_lost``
error at once (after the replies that came before the loss), and libzmq reconnects. While no
connection is up a request is refused at once (``ZMQ_IMMEDIATE``: nothing waits in a queue for
a supervisor that may never come back).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from ntx.shared import messages as m

log = logging.getLogger("uvicorn.error.gateway")

STATUS_INTERVAL_S = 1.0
HISTORY_S = 60  # the status page's chart spans the last minute, one sample per interval
STATUS_STALE_S = 5.0  # a status older than this means the supervisor stopped answering
STAGE_STATES = ("busy", "starved", "blocked")


class PipelineGone(Exception):
    """The supervisor does not answer (not started, stopped, or busy beyond the timeout)."""


class FrameRefused(ValueError):
    """A request that cannot go on the wire as it is: a value msgpack cannot hold (an integer
    beyond 64 bits) or a frame over the supervisor's bound; the reason is the message."""


class FrameTooLarge(FrameRefused):
    """A request whose frame is over the supervisor's bound (``messages.MAX_FRAME_BYTES``)."""




def generate_frame(rid: str, request: dict) -> bytes:
    """The ``generate`` frame of ``request`` (without ``op``/``id``) as id ``rid``, checked as the
    supervisor checks a frame: FrameRefused (FrameTooLarge) names what keeps it off the wire.
    Every client of the gateway's routes (one pipeline, or a cluster's replicas) sends only
    frames that pass this."""
    try:
        frame = m.pack({"op": "generate", "id": rid, **request})
    except (OverflowError, ValueError, TypeError) as e:  # msgpack: an integer beyond 64 bits, ...
        raise FrameRefused(f"the request holds a value that cannot be sent ({e})") from None
    if len(frame) > m.MAX_FRAME_BYTES:
        raise FrameTooLarge(f"the request is {len(frame)} bytes on the wire, more than the pipeline's limit of "
                            f"{m.MAX_FRAME_BYTES} bytes")
    try:  # the supervisor's own frame checks: a frame it would refuse as a frame is never sent
        m.decode_client_frame(frame)
    except m.RequestError as e:
        raise FrameRefused(f"the request cannot be sent as it is: {e}") from None
    return frame


def connect_address(listen: str) -> str:
    """The address to connect to for a ``--listen`` address: a wildcard bind (``tcp://*:5555``,
    ``tcp://0.0.0.0:5555``) is reached on loopback."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if listen.startswith(wildcard):
            return "tcp://127.0.0.1:" + listen[len(wildcard):]
    return listen


def stage_shares(prev: dict, cur: dict) -> dict[str, dict[str, float]]:
    """Each stage's busy / starved / blocked share of the wall time between two status
    snapshots (from the stages' running totals), so the chart shows idle as empty and a busy
    stage as full. A stage that restarted (its uptime went back) starts from zero."""
    out = {}
    for name, snap in cur.get("stages", {}).items():
        before = prev.get("stages", {}).get(name, {})
        dt_s = snap.get("uptime_s", 0.0) - before.get("uptime_s", 0.0)
        if not before or dt_s <= 0:
            before, dt_s = {}, snap.get("uptime_s", 0.0)
        total, total_before = snap.get("total", {}), before.get("total", {})
        out[name] = {k: round(max(0.0, total.get(k, 0.0) - total_before.get(k, 0.0)) / dt_s, 4) if dt_s > 0 else 0.0
                     for k in STAGE_STATES}
    return out


class RequestStream:
    """The replies of one generate request, in order; iterate with ``async for``."""

    def __init__(self, link: PipelineLink, rid: str) -> None:
        self.link = link
        self.rid = rid
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.finished = False
        self.cancel_sent = False

    async def __aiter__(self) -> AsyncIterator[dict]:
        while not self.finished:
            try:
                async with asyncio.timeout(self.link.reply_timeout_s):
                    ev = await self.queue.get()
            except TimeoutError:  # the last bound on a request's life: it ends, whatever was lost
                self.cancel()
                ev = {"type": "error", "id": self.rid, "code": "reply_timeout",
                      "message": f"no reply from the pipeline for {self.link.reply_timeout_s:g} s; the request was "
                                 "cancelled"}
            if ev.get("type") in ("done", "error"):
                self.finished = True
            yield ev

    def cancel(self) -> None:
        """Ask the pipeline to stop this request (if it still runs, and once); its ``done``
        reply follows."""
        if not self.finished and not self.cancel_sent:
            self.cancel_sent = True
            self.link.send({"op": "cancel", "id": self.rid})


class StreamTable:
    """The request streams a link is reading, by request id (a link's ``forget`` and
    ``in_flight``, the same for one pipeline's link and a cluster's)."""

    _streams: dict

    def forget(self, stream) -> None:
        self._streams.pop(stream.rid, None)

    @property
    def in_flight(self) -> int:
        return len(self._streams)


class PipelineLink(StreamTable):
    """The gateway's client of the supervisor (docs/PROTOCOL.md), for use inside one event loop."""

    def __init__(self, address: str, reply_timeout_s: float) -> None:
        self.address = connect_address(address)
        self.reply_timeout_s = reply_timeout_s  # a request with no reply for this long is ended
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no connection: a send fails at once, nothing queues
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.connected = False  # a handshake completed and that connection has not dropped
        self.connections_lost = 0
        self.sock.connect(self.address)
        self._ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        self._status_waiters: dict[str, asyncio.Future] = {}
        self.status: dict[str, Any] | None = None  # the newest status, or None
        self.status_at_s = 0.0  # time.monotonic() when it came
        self.history: deque[dict] = deque(maxlen=HISTORY_S)
        self._tasks: list[asyncio.Task] = []

    def start(self, poll_status: bool = True) -> None:
        """Read replies, and ask for the status once per ``STATUS_INTERVAL_S`` unless not
        ``poll_status`` (a cluster ingress reading an instance's replies has its status already)."""
        self._tasks = [asyncio.create_task(self._read())]
        if poll_status:
            self._tasks.append(asyncio.create_task(self._poll_status()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for stream in self._streams.values():
            stream.cancel()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=200)
        self.ctx.term()

    def send(self, msg: dict) -> bool:
        """Send ``msg`` without waiting; False when no connection is up (the supervisor is
        gone: the status poll notices and /health says so)."""
        return self._send_frame(m.pack(msg))

    def _send_frame(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK).result()  # a NOBLOCK send's future is already done
        except zmq.Again:
            return False
        return True

    # -- requests --------------------------------------------------------------------------
    def submit(self, request: dict) -> RequestStream:
        """Send a generate request (without ``op``/``id``); its replies arrive on the stream.
        FrameRefused when it cannot be sent as it is, PipelineGone when no connection is up;
        neither leaves anything behind."""
        rid = f"gw-{next(self._ids)}"
        frame = generate_frame(rid, request)
        stream = self._streams[rid] = RequestStream(self, rid)
        if not self._send_frame(frame):
            del self._streams[rid]
            raise PipelineGone(f"no connection to the pipeline on {self.address}")
        return stream

    # -- status ----------------------------------------------------------------------------
    @property
    def fresh_status(self) -> dict | None:
        """The newest status if the supervisor answered within ``STATUS_STALE_S``."""
        if self.status is None or time.monotonic() - self.status_at_s > STATUS_STALE_S:
            return None
        return self.status

    async def ask_status(self, timeout_s: float = 2.0) -> dict:
        rid = f"gw-status-{next(self._ids)}"
        fut = self._status_waiters[rid] = asyncio.get_running_loop().create_future()
        try:
            if not self.send({"op": "status", "id": rid}):
                raise PipelineGone(f"no connection to the pipeline on {self.address}")
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise PipelineGone(f"the pipeline on {self.address} did not answer within {timeout_s:g} s") from None
        finally:
            self._status_waiters.pop(rid, None)

    async def _poll_status(self) -> None:
        while True:
            try:
                st = await self.ask_status()
            except PipelineGone:
                st = None
            if st is not None:
                prev = self.status or {}
                self.status, self.status_at_s = st, time.monotonic()
                self.history.append({
                    "t": round(time.time(), 3), "tokens_per_s": st.get("tokens_per_s", 0.0),
                    "in_flight": st.get("requests", {}).get("in_flight", 0), "stages": stage_shares(prev, st),
                })
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            try:
                if self.sock in ready:
                    await self._drain()
                if self.monitor in ready:
                    await self._connection_events()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                raise
            except Exception:  # this task dying would leave every request without replies
                log.exception("the gateway's reader of the pipeline's replies failed on one; it reads on")

    async def _drain(self) -> None:
        """Every reply already received."""
        while True:
            try:
                frame = await self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(frame)

    async def _connection_events(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(await self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                await self._drain()  # the replies that came before the loss first
                self._lose_all()

    def _lose_all(self) -> None:
        """End every request in flight with ``pipeline_lost``: the supervisor dropped them with
        the connection, and no reply for them will come."""
        self.connections_lost += 1
        self.status = None  # /health says unavailable until the supervisor answers again
        self.end_all("pipeline_lost", f"the connection to the pipeline on {self.address} was lost (the supervisor "
                                      "restarted or stopped); the request was not finished", cancel=False)

    def end_all(self, code: str, message: str, cancel: bool = True) -> None:
        """End every request in flight with an error ``code`` (after the replies already
        queued for it), cancelling it at the pipeline when ``cancel`` (the gateway stops)."""
        for stream in list(self._streams.values()):
            if not stream.finished:
                if cancel:
                    stream.cancel()
                stream.cancel_sent = True
                stream.queue.put_nowait({"type": "error", "id": stream.rid, "code": code, "message": message})

    def _dispatch(self, frame: bytes) -> None:
        try:
            ev = m.unpack(frame)
        except ValueError:  # msgpack's errors are ValueErrors: a frame not from the supervisor
            return
        if not isinstance(ev, dict):
            return
        rid = ev.get("id")
        if ev.get("type") == "status" and rid in self._status_waiters:
            fut = self._status_waiters[rid]
            if not fut.done() and isinstance(ev.get("status"), dict):
                fut.set_result(ev["status"])
            return
        stream = self._streams.get(rid)
        if stream is not None:
            stream.queue.put_nowait(ev)
