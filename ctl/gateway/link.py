"""The gateway's one ZeroMQ connection to the supervisor, shared by every HTTP request.

One DEALER socket carries all requests (the protocol allows any number in flight per
connection); a reader task sorts replies into one queue per request id. A second task asks for
the pipeline's status once a second and keeps the last minute of it: /health, /metrics and the
status page read that copy instead of each asking the supervisor.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from ntx.shared import messages as m

STATUS_INTERVAL_S = 1.0
HISTORY_S = 60  # the status page's chart spans the last minute, one sample per interval
STATUS_STALE_S = 5.0  # a status older than this means the supervisor stopped answering
STAGE_STATES = ("busy", "starved", "blocked")


class PipelineGone(Exception):
    """The supervisor does not answer (not started, stopped, or busy beyond the timeout)."""


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
            ev = await self.queue.get()
            if ev.get("type") in ("done", "error"):
                self.finished = True
            yield ev

    def cancel(self) -> None:
        """Ask the pipeline to stop this request (if it still runs, and once); its ``done``
        reply follows."""
        if not self.finished and not self.cancel_sent:
            self.cancel_sent = True
            self.link.send({"op": "cancel", "id": self.rid})


class PipelineLink:
    """The gateway's client of the supervisor (docs/PROTOCOL.md), for use inside one event loop."""

    def __init__(self, address: str) -> None:
        self.address = connect_address(address)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)
        self._ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        self._status_waiters: dict[str, asyncio.Future] = {}
        self.status: dict[str, Any] | None = None  # the newest status, or None
        self.status_at_s = 0.0  # time.monotonic() when it came
        self.history: deque[dict] = deque(maxlen=HISTORY_S)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._poll_status())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for stream in self._streams.values():
            stream.cancel()
        self.sock.close(linger=200)
        self.ctx.term()

    def send(self, msg: dict) -> None:
        try:
            self.sock.send(m.pack(msg), zmq.NOBLOCK)
        except zmq.Again:  # the supervisor is gone: the status poll notices and /health says so
            pass

    # -- requests --------------------------------------------------------------------------
    def submit(self, request: dict) -> RequestStream:
        """Send a generate request (without ``op``/``id``); its replies arrive on the stream."""
        rid = f"gw-{next(self._ids)}"
        stream = self._streams[rid] = RequestStream(self, rid)
        self.send({"op": "generate", "id": rid, **request})
        return stream

    def forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.rid, None)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

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
        self.send({"op": "status", "id": rid})
        try:
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
        while True:
            frame = await self.sock.recv()
            try:
                ev = m.unpack(frame)
            except ValueError:  # msgpack's errors are ValueErrors: a frame not from the supervisor
                continue
            if not isinstance(ev, dict):
                continue
            rid = ev.get("id")
            if ev.get("type") == "status" and rid in self._status_waiters:
                fut = self._status_waiters[rid]
                if not fut.done():
                    fut.set_result(ev["status"])
                continue
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(ev)
