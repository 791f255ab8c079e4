"""The gateway's bounds: what one HTTP connection, one client and one request body may hold.

The gateway is one ZeroMQ connection for all of its HTTP users (docs/PROTOCOL.md), so without
bounds of its own one user could take what the supervisor grants that connection (256 requests in
flight), hold every descriptor of the process with silent sockets, or make the gateway read a
body of any size. docs/RELIABILITY.md ("HTTP gateway") lists each bound with the test that holds
it. A client is its address: the TCP peer's, except that a peer on loopback (a reverse proxy on
this machine) may name the client's in X-Forwarded-For (uvicorn's proxy headers, trusted from
loopback only; ``server.TRUSTED_PROXIES``). Connections are counted by the TCP peer alone (no
header has arrived when one opens).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ntx.ctl.request_limits import MAX_REQUESTS_PER_CONNECTION
from ntx.shared.messages import MAX_FRAME_BYTES

# A request body's bytes, at most: twice the supervisor's frame bound, room for JSON's escapes
# and field names around a prompt that fills a frame (the packed frame is checked against the
# frame bound itself before it is sent). Far below libzmq's 16 MiB, which would drop the
# gateway's one connection and with it every user's requests.
MAX_BODY_BYTES = 2 * MAX_FRAME_BYTES
# Bodies being received at once hold at most this many bytes together (a client that sends
# slowly holds its part until the body timeout).
MAX_BODY_BYTES_IN_FLIGHT = 64 << 20
# Generations in flight through the gateway: what the supervisor takes on one connection, so
# that its own `overloaded` for too many on this connection is never reached.
MAX_REQUESTS = MAX_REQUESTS_PER_CONNECTION
# One client's share of them: four clients at their cap fill the gateway, one cannot.
MAX_REQUESTS_PER_CLIENT = MAX_REQUESTS // 4
# Open HTTP connections (further bounded by the descriptors the process may open), and one
# client's share of them.
MAX_CONNECTIONS = 2048
MAX_CONNECTIONS_PER_CLIENT = 128
# Descriptors kept free of HTTP connections: Python, ZeroMQ's sockets and threads, the log.
RESERVED_DESCRIPTORS = 64
# Connections the kernel queues before the gateway accepts them; asyncio accepts up to this many
# per turn of its loop before any is looked at, so a few times this is kept free as well.
LISTEN_BACKLOG = 64
# A request's head (request line and headers) in bytes; larger is 400 (h11's bound).
MAX_HEAD_BYTES = 16 * 1024
# A connection with no request under way (new, or after a response) is closed after this.
IDLE_TIMEOUT_S = 5.0
# From a request's first byte until its head is complete, and from then until its body is:
# bytes that keep trickling in do not extend either.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
# A generation with no reply from the pipeline for this long is cancelled and answered 504: the
# last bound on a request's life, whatever was lost on the way (the client library's own wait).
REPLY_TIMEOUT_S = 600.0
# What a refusal for load asks the client to wait before trying again.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class GatewayLimits:
    """The bounds one gateway enforces (the module's constants; tests give smaller ones)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT
    max_requests: int = MAX_REQUESTS
    max_requests_per_client: int = MAX_REQUESTS_PER_CLIENT
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    max_head_bytes: int = MAX_HEAD_BYTES
    idle_timeout_s: float = IDLE_TIMEOUT_S
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    reply_timeout_s: float = REPLY_TIMEOUT_S

    def for_descriptors(self, open_files_limit: int) -> GatewayLimits:
        """These limits with the connection bound lowered to what ``open_files_limit``
        descriptors allow: past it, accept() fails and the loop cannot even refuse politely."""
        room = open_files_limit - RESERVED_DESCRIPTORS - 4 * LISTEN_BACKLOG
        cap = max(1, min(self.max_connections, room))
        return GatewayLimits(**{**self.__dict__, "max_connections": cap,
                                "max_connections_per_client": min(self.max_connections_per_client, cap)})


class Shares:
    """Counts of something each client holds (connections, request slots), with a bound for
    all clients together and one for each client."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.held: Counter[str] = Counter()
        self.n_held = 0

    def refusal(self, client: str) -> str | None:
        """Why ``client`` may not take one more now (``"client"`` or ``"total"``), or None."""
        if self.held[client] >= self.per_client:
            return "client"
        if self.n_held >= self.total:
            return "total"
        return None

    def take(self, client: str) -> None:
        self.held[client] += 1
        self.n_held += 1

    def give_back(self, client: str) -> None:
        self.held[client] -= 1
        self.n_held -= 1
        if self.held[client] <= 0:
            del self.held[client]
