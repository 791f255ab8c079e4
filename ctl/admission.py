"""Admission and routing: which client requests the pipeline takes, when compute gets them, and
where compute's outputs go.

A request is in ``inflight`` from its admission to its last reply; meanwhile it waits in
``pending`` (the supervisor's bounded queue) or is ``at_compute`` (at most the compute window:
twice a batch, so compute's next admissions are at hand and its control socket never fills).
Every admitted request ends in exactly one ``done`` or ``error`` reply (``end_request``). It
belongs to its ``Connection`` (``ctl/front.py``) and to the client's id on it, so only that
connection sees its replies or can cancel it; a connection that closes has its requests
cancelled, one that reads far too slowly has them cancelled with ``client_too_slow``.

Text is the front's (``ctl/requests.py``): a request is checked and turned into the engine's
token ids when it is admitted, and each output of compute goes through the request's
``OutputProcessor`` on its way back. A request the front ended on a stop string leaves
``inflight`` at once and is cancelled at compute; it stays ``at_compute`` (in the window) until
compute's last output for it, which is dropped.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ntx.ctl.front import ClientFront, Connection
from ntx.ctl.request_limits import MAX_QUEUED_BYTES, MAX_QUEUED_REQUESTS, MAX_REQUESTS_PER_CONNECTION, RequestLimits
from ntx.ctl.requests import OutputProcessor, RequestFront
from ntx.shared import messages as m


@dataclass
class Flight:
    """An admitted request: the connection and client id that own it, its output processor (the
    tokens generated so far) and when it was admitted (``time.monotonic``: its age in status)."""

    conn: Connection
    client_id: str
    out: OutputProcessor
    admitted_s: float = field(default_factory=time.monotonic)


def request_log_line(rid: str, reply: m.DoneReply | m.ErrorReply) -> str:
    """One line per finished request: ids, prompt and generated tokens, finish, time to first
    token (queued + prefill, as compute measured them) and decode tok/s."""
    head = f"request {rid} (client id {reply.id!r}):"
    if isinstance(reply, m.ErrorReply):
        return f"{head} error {reply.code}: {reply.message}"
    t = reply.timings
    tok_s = t.decode_tokens_per_s  # None when there was nothing to decode after the first token
    return (f"{head} prompt {len(reply.prompt_tokens)} tokens, generated {len(reply.tokens)}, "
            f"finish {reply.finish_reason}, ttft {t.queued_s + t.prefill_s:.3f} s, "
            + (f"{tok_s:.1f} tok/s" if tok_s is not None else "no decode"))


@dataclass(eq=False)
class Admission:
    """The pending queue, the compute window, the requests in flight and their routes.

    ``send_compute(msg) -> bool`` delivers to the current generation's compute (False: it could
    not, and the pipeline has failed); ``compute_ready()`` says whether compute takes requests
    now; ``log`` (or None) gets one line per finished request. ``closed`` refuses new requests
    (the instance is stopping)."""

    front: ClientFront
    requests: RequestFront
    limits: RequestLimits
    send_compute: Callable[[m.Message], bool]
    compute_ready: Callable[[], bool]
    log: Callable[[str], None] | None
    closed: bool = False
    inflight: dict[str, Flight] = field(default_factory=dict)  # internal id -> its owner and output
    by_client: dict[tuple[int, str], str] = field(default_factory=dict)  # (connection serial, client id) -> internal id
    # requests waiting for room at compute: internal id -> (engine request, frame bytes)
    pending: dict[str, tuple[m.EngineRequest, int]] = field(default_factory=dict)
    pending_bytes: int = 0
    at_compute: set[str] = field(default_factory=set)  # sent to compute, its last output not yet seen
    cancel_sent: set[str] = field(default_factory=set)
    # counts admissions and endings: the status map (ctl/status_map.py) is reused for a moment
    # only while this stays the same, so a status asked right after a request is admitted or
    # ended counts it (a map reused across an admission once said 0 in flight to a client that
    # was reading the request's first token; CI failed)
    changes: int = 0
    _ids: Iterator[int] = field(default_factory=itertools.count)

    # -- from clients -----------------------------------------------------------------------
    def generate(self, conn: Connection, msg: dict[str, Any], n_bytes: int) -> None:
        """A generate map (its frame decoded): the front's one check, then admission (or a
        refusal), then the prompt as token ids; every failure is this request's error reply."""
        key = (conn.serial, msg["id"])
        try:
            req = self.requests.parse(msg)
            refusal = self.refusal(conn, key, n_bytes)
            if refusal is not None:
                raise m.RequestError(*refusal)
            rid = f"r{next(self._ids)}"
            engine_req, out = self.requests.start(rid, req)
        except m.RequestError as e:
            self.front.send(conn, m.ErrorReply(msg["id"], e.code, str(e)))
            return
        self.inflight[rid] = Flight(conn, msg["id"], out)
        self.changes += 1
        self.by_client[key] = rid
        conn.rids.add(rid)
        self.pending[rid] = (engine_req, n_bytes)
        self.pending_bytes += n_bytes
        self.dispatch()

    def refusal(self, conn: Connection, key: tuple[int, str], n_bytes: int) -> tuple[str, str] | None:
        """Why a checked generate request cannot be admitted now (code, message), or None."""
        if self.closed:
            return "shutdown", "the pipeline is stopping"
        if key in self.by_client:
            return "duplicate_id", f"request id {key[1]!r} is already in flight"
        if len(conn.rids) >= MAX_REQUESTS_PER_CONNECTION:
            return "overloaded", f"this connection has {MAX_REQUESTS_PER_CONNECTION} requests in flight, the most it may"
        if len(self.pending) >= MAX_QUEUED_REQUESTS or self.pending_bytes + n_bytes > MAX_QUEUED_BYTES:
            return "overloaded", f"{len(self.pending)} requests are queued, the most the pipeline holds; retry later"
        return None

    def cancel(self, conn: Connection, client_id: str) -> None:
        rid = self.by_client.get((conn.serial, client_id))
        if rid is None:
            self.front.send(conn, m.ErrorReply(client_id, "unknown_id", f"no request {client_id!r} in flight"))
        elif rid in self.pending:
            self._finish(rid, self.inflight[rid].out.cancelled())
        else:
            self.cancel_at_compute(rid)

    # -- to and from compute ----------------------------------------------------------------
    def dispatch(self) -> None:
        """Forward queued requests, oldest first, while compute's window has room."""
        while self.pending and self.compute_ready() and len(self.at_compute) < self.limits.compute_window:
            rid = next(iter(self.pending))
            req, n_bytes = self.pending.pop(rid)
            self.pending_bytes -= n_bytes
            self.at_compute.add(rid)
            if not self.send_compute(req):
                return

    def cancel_at_compute(self, rid: str) -> None:
        if rid in self.at_compute and rid not in self.cancel_sent:
            self.cancel_sent.add(rid)
            self.send_compute(m.Cancel(rid=rid))

    def route(self, ev: m.EngineEvent) -> None:
        """One of compute's events, through its request's output processor to its client."""
        rid = ev.id
        last_at_compute = isinstance(ev, m.EngineError) or ev.finish_reason is not None
        if last_at_compute:
            self.at_compute.discard(rid)
            self.cancel_sent.discard(rid)
        flight = self.inflight.get(rid)
        if flight is not None:
            out = flight.out
            replies = [out.failed(ev.code, ev.message)] if isinstance(ev, m.EngineError) else out.process(ev)
            for reply in replies:
                if rid not in self.inflight:  # ended meanwhile: its client reads too slowly
                    break
                if reply is replies[-1] and out.finished:
                    self._finish(rid, reply)
                else:
                    self.front.send(flight.conn, reply)
            if out.needs_cancel:  # a stop string ended it here; compute still runs it
                self.cancel_at_compute(rid)
        if last_at_compute:
            self.dispatch()

    # -- endings ------------------------------------------------------------------------------
    def _finish(self, rid: str, reply: m.DoneReply | m.ErrorReply) -> None:
        """Send a request's last reply and forget it."""
        flight = self.inflight[rid]
        self.end_request(rid)
        self.front.send(flight.conn, reply)
        if self.log is not None:
            self.log(request_log_line(rid, reply))

    def end_request(self, rid: str, error: tuple[str, str] | None = None) -> None:
        """Forget a request (its reply, if any, is sent first); an error ends it for its client."""
        flight = self.inflight.pop(rid)
        self.changes += 1
        self.by_client.pop((flight.conn.serial, flight.client_id), None)
        flight.conn.rids.discard(rid)
        if rid in self.pending:
            self.pending_bytes -= self.pending.pop(rid)[1]
        if error is not None:
            self.front.send(flight.conn, flight.out.failed(*error))

    def abort(self, rid: str, code: str, message: str) -> None:
        """End one request with an error, wherever it is (its compute side is cancelled)."""
        if rid in self.inflight:
            self.end_request(rid, error=(code, message))
        self.cancel_at_compute(rid)

    def fail_pending(self, code: str, message: str) -> None:
        """Answer every request not yet at compute with an error."""
        for rid in list(self.pending):
            self.end_request(rid, error=(code, message))

    def fail_inflight(self, code: str, message: str) -> None:
        """Answer every request in flight with an error: compute has gone or is going."""
        for rid in list(self.inflight):
            self.end_request(rid, error=(code, message))
        self.at_compute.clear()
        self.cancel_sent.clear()

    def connection_gone(self, conn: Connection) -> None:
        """Its client disconnected: nobody will read these requests' replies, so they stop."""
        for rid in list(conn.rids):
            self.end_request(rid)
            self.cancel_at_compute(rid)

    def connection_slow(self, conn: Connection) -> None:
        """Its client reads far slower than its requests produce: cancel them, with a reason."""
        client_ids = {self.inflight[rid].client_id for rid in conn.rids}
        self.front.drop_queued(conn, client_ids)
        for rid in list(conn.rids):
            self.cancel_at_compute(rid)
            self.end_request(rid, error=("client_too_slow", "the client did not read its replies (more than "
                                         f"{conn.outbox_bytes >> 20} MiB waiting); request cancelled"))
