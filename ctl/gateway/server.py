"""The gateway's HTTP server: uvicorn, configured with the gateway's bounds (``limits``).

uvicorn's own settings hold what they can: the head's size (``h11_max_incomplete_event_size``),
the idle time after a response (``timeout_keep_alive``), the listen backlog, and
``limit_concurrency`` as a backstop. What uvicorn has no setting for is held by
``BoundedH11Protocol``, its HTTP/1.1 protocol with three additions: connections counted per
client and in all (over either, the connection gets a 503 and is closed at once), a new
connection that sends nothing is closed after ``idle_timeout_s``, and a request head must be
complete ``head_timeout_s`` after its first byte (bytes trickling in do not extend it). The
descriptor limit is raised to its hard limit and the connection bound kept below it, so accept()
never fails for want of descriptors. The error loggers are rate-limited (``LogRateLimit``). At
shutdown the generations in flight are ended with an error at once (``GatewayServer``).

``serve`` runs it until SIGTERM; ``make_server`` builds it (tests run it in a thread on a free
port, with smaller limits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from ntx.ctl.gateway.limits import LISTEN_BACKLOG, GatewayLimits, Shares

log = logging.getLogger("uvicorn.error.gateway")  # uvicorn's handler and format, like its own lines

# Loggers whose records a peer can cause (accept errors, bad requests, exceptions, refusals), and
# so limited (a logger's filters apply to the records logged on it, not to its children's).
RATE_LIMITED_LOGGERS = ("uvicorn.error", "uvicorn.error.gateway", "asyncio")
# Peers whose X-Forwarded-For names the client (a reverse proxy on this machine): loopback only,
# whatever FORWARDED_ALLOW_IPS says.
TRUSTED_PROXIES = "127.0.0.1,::1"
# Descriptors asked for where the hard limit is unlimited.
UNLIMITED_DESCRIPTORS_WANTED = 65536


class LogRateLimit(logging.Filter):
    """At most ``per_window`` records of one kind (logger and message template) per
    ``window_s``; the first record after a window that dropped some says how many."""

    MAX_KINDS = 1000

    def __init__(self, per_window: int = 20, window_s: float = 10.0) -> None:
        super().__init__()
        self.per_window = per_window
        self.window_s = window_s
        self.windows: dict[tuple[str, str], list] = {}  # kind -> [window start, records let through, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        w = self.windows.get(kind)
        if w is None or now - w[0] >= self.window_s:
            if len(self.windows) >= self.MAX_KINDS:
                self.windows.clear()
            self.windows[kind] = [now, 1, 0]
            if w is not None and w[2]:
                record.msg = f"{record.msg} [{w[2]} more like this in the {self.window_s:g} s before were not logged]"
            return True
        if w[1] < self.per_window:
            w[1] += 1
            return True
        w[2] += 1
        return False


def limit_logs(rate_limit: LogRateLimit | None = None) -> LogRateLimit:
    rate_limit = rate_limit or LogRateLimit()
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, LogRateLimit) for f in logger.filters):
            logger.addFilter(rate_limit)
    return rate_limit


def _refusal_response(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with per-client and total connection bounds, and time bounds
    on a connection with no request under way (``bounded_protocol`` makes the class for one
    server: its ``limits`` and the ``connections`` its instances share)."""

    limits: GatewayLimits
    connections_held: Shares

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else "local"
        self.holds_share = False
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_started = False
        refusal = self.connections_held.refusal(self.peer)
        if refusal is not None:
            held = self.connections_held
            message = (f"this client has {held.per_client} connections open, the most one client may"
                       if refusal == "client" else f"the gateway has {held.total} connections open, the most it takes")
            log.warning("refused a connection from %s: %s", self.peer, message)
            transport.write(_refusal_response(message + "; retry later"))
            transport.close()
            return
        self.connections_held.take(self.peer)
        self.holds_share = True
        self._arm(self.limits.idle_timeout_s, started=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.holds_share:
            self.holds_share = False
            self.connections_held.give_back(self.peer)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        waiting = cycle is None or cycle.response_complete
        if waiting and not self.head_started:  # a request's first bytes: its head has head_timeout_s
            self._arm(self.limits.head_timeout_s, started=True)
        super().data_received(data)
        if self.cycle is not cycle:  # the head is complete (the body has its own bound, in the app)
            self._disarm()
            self.head_started = False

    def _arm(self, after_s: float, started: bool) -> None:
        self._disarm()
        self.head_started = started
        self.head_timer = self.loop.call_later(after_s, self._time_out)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _time_out(self) -> None:
        self.head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def bounded_protocol(limits: GatewayLimits) -> type[BoundedH11Protocol]:
    held = Shares(limits.max_connections, limits.max_connections_per_client)
    return type("GatewayH11Protocol", (BoundedH11Protocol,), {"limits": limits, "connections_held": held})


def raise_descriptor_limit() -> int:
    """Raise this process' open-files limit to its hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = UNLIMITED_DESCRIPTORS_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return UNLIMITED_DESCRIPTORS_WANTED if soft == resource.RLIM_INFINITY else soft


class GatewayServer(uvicorn.Server):
    """uvicorn's server that, when it begins to shut down, ends the generations in flight with
    ``shutdown`` (cancelled at the pipeline; their clients get a 503 or an error event and
    ``[DONE]``) instead of leaving them to be cut off after the graceful timeout."""

    async def shutdown(self, sockets=None) -> None:
        link = self.config.app.state.gateway.link
        if link is not None:
            link.end_all("shutdown", "the HTTP gateway is stopping; the request was cancelled")
        await super().shutdown(sockets)


def make_server(app: Starlette, host: str, port: int, limits: GatewayLimits, log_level: str = "info") -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2,
        loop="asyncio", http=bounded_protocol(limits), backlog=LISTEN_BACKLOG,
        timeout_keep_alive=limits.idle_timeout_s, h11_max_incomplete_event_size=limits.max_head_bytes,
        limit_concurrency=limits.max_connections + 4 * LISTEN_BACKLOG,
        proxy_headers=True, forwarded_allow_ips=TRUSTED_PROXIES,
    )
    limit_logs()
    return GatewayServer(config)


def serve(app: Starlette, host: str, port: int, limits: GatewayLimits, log_level: str = "info") -> None:
    """Serve until SIGTERM, with the connection bound kept below the descriptors this process
    may open (``limits`` must be the app's own, lowered the same way: ``for_descriptors``)."""
    make_server(app, host, port, limits, log_level).run()
