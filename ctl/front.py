"""The instance's client socket: who is connected, and what waits to be sent to each of them.

The supervisor decides what to answer; this module decides how an answer reaches the one client
that asked, and only that client:

* **Connections, not routing ids.** A ZeroMQ ROUTER names its peers by routing id, and a peer
  may choose its own: a new client that takes the id of one that just left would receive the
  departed client's tokens and could cancel its requests. So a request belongs to a
  ``Connection``, which the supervisor recognises by the socket descriptor its frames arrive on
  (``ZMQ_SRCFD``) together with their routing id. The socket monitor reports each
  disconnect with that descriptor (``EVENT_DISCONNECTED``); the connection ends there, its
  requests are cancelled (``on_gone``), and nothing is ever sent to its routing id again, whoever
  takes it next. The monitor is read before every receive and every send, and libzmq reports a
  disconnect before it closes the descriptor, so a reused descriptor is never mistaken for the
  old connection. A peer that vanishes without closing (cable, suspended laptop) is found by TCP
  keepalive (``ZMQ_TCP_KEEPALIVE``): the kernel probes an idle connection and closes it when
  the peer's kernel stops answering, which the monitor then reports. Not ZMTP heartbeats: a
  client that does not read stops answering them too (its libzmq stops reading the socket), so
  they would cut off a slow reader that is still there, and libzmq 4.3.5 aborts the process
  (``Assertion failed: !_io_error``) when that happens to a connection whose input is stalled.
* **Nothing dropped silently.** The socket is ``ZMQ_ROUTER_MANDATORY``: a full pipe to a slow
  reader is ``EAGAIN`` instead of a silent drop. Replies then wait in the connection's
  ``outbox`` and go out as the client reads. An outbox over ``OUTBOX_LIMIT_BYTES`` means the
  client reads far slower than it asks: ``on_slow`` cancels its requests, their queued tokens are
  dropped and each gets one ``client_too_slow`` error instead (bounded memory, a clear reason).
  Replies that belong to no stream (status answers, errors) are bounded apart: a status request
  is refused while more than ``STATUS_OUTBOX_LIMIT_BYTES`` wait (the supervisor's check), and an
  outbox never holds more than ``OUTBOX_HARD_LIMIT_BYTES``: a reply past it is dropped, counted
  and said in the log, the one case where a reply is dropped (its client left 64 MiB unread).
* **Authentication.** A listen address other machines can reach requires CURVE
  (``InstanceConfig.validate``): the server's secret key and a folder of the clients' public
  keys, all made by ``ntxctl keygen``; pyzmq's ZAP authenticator refuses any other key.
* **Operators.** Status details (model path, pids, listen address) go only to connections from
  this machine (loopback or ipc); ``Connection.operator`` says which.
* **Any bytes.** The port is open to whatever a peer sends: a browser's GET, random bytes, a
  ZMTP/1.0-style frame. libzmq takes a peer whose first byte is not ZMTP/3's signature for a
  ZMTP/1.0 one and hands its messages up with no descriptor (``ZMQ_SRCFD`` is EINVAL): such a
  message, like one of a shape no client sends, is dropped in ``receive`` (counted, and said at
  most once per ``DROP_NOTE_INTERVAL_S``), never raised into the supervisor's loop.
"""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig
from ntx.shared.errors import ConfigError

KEEPALIVE_IDLE_S = 30  # an idle connection is probed after this long
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3  # unanswered probes before the kernel closes it (about 45 s in all)
# Replies waiting for one slow client: 64 streaming requests of 2,000 tokens come to about 6 MiB.
OUTBOX_LIMIT_BYTES = 32 << 20
# What one outbox holds at most, whatever it holds: past it replies are dropped (counted, logged).
OUTBOX_HARD_LIMIT_BYTES = 2 * OUTBOX_LIMIT_BYTES
# A status request is answered only while its connection has less than this unread (a status
# reply is about 4 KiB: some 250 of them); beyond, it is refused ``overloaded`` in a few bytes.
STATUS_OUTBOX_LIMIT_BYTES = 1 << 20
# Replies in libzmq's pipe to one client, past which a send waits in the outbox (counted in
# messages, not bytes, so kept small: a done reply with prompt_logprobs can be megabytes).
PIPE_LIMIT_MESSAGES = 100
# libzmq drops the connection of a peer that sends a frame larger than this (no reply is
# possible then); frames up to m.MAX_FRAME_BYTES get a clear error, larger ones up to here too.
CONNECTION_FRAME_LIMIT_BYTES = 16 * m.MAX_FRAME_BYTES
# Frames taken in one ``receive``: the loop then serves compute's outputs and the other
# connections' replies before it reads more (one client's 100k frames do not hold it).
RECEIVE_BATCH_FRAMES = 512
DROP_NOTE_INTERVAL_S = 10.0  # dropped messages are said at most this often, with their count


@dataclass(eq=False)
class Connection:
    """One client connection: the descriptor and routing id its frames arrive with, whether it
    may see status details, the internal ids of its requests in flight (the supervisor's
    bookkeeping) and the replies waiting for it to read."""

    serial: int
    fd: int
    routing_id: bytes
    operator: bool
    frames: int = 0  # messages received on it: the number an error for an id-less frame names
    rids: set[str] = field(default_factory=set)
    outbox: deque[tuple[str | None, bytes]] = field(default_factory=deque)  # (client request id, frame)
    outbox_bytes: int = 0
    alive: bool = True
    slow: bool = False  # over OUTBOX_LIMIT_BYTES until its outbox empties
    dropped: int = 0  # replies dropped past OUTBOX_HARD_LIMIT_BYTES


def _is_operator_peer(frame: zmq.Frame, listen: str) -> bool:
    if listen.startswith("ipc://"):
        return True
    try:
        address = frame.get("Peer-Address")
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except (zmq.ZMQError, ValueError, AttributeError):
        return False


def load_curve_server(cfg: InstanceConfig) -> tuple[bytes, bytes] | None:
    """The server's CURVE key pair from ``cfg.curve_server_key`` (None: no CURVE); ConfigError
    naming the file if it is not a secret key made by ``ntxctl keygen``."""
    if not cfg.curve_server_key:
        return None
    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_server_key)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--curve-server-key {cfg.curve_server_key}: cannot read it ({e})") from None
    if not secret:
        raise ConfigError(f"--curve-server-key {cfg.curve_server_key}: holds no secret key "
                          "(give the .key_secret file made by `ntxctl keygen`)")
    return public, secret


class ClientFront:
    """The ROUTER the clients talk to, its monitor, its connections and their outboxes.

    ``on_gone(conn)`` is called once when a connection ends; ``on_slow(conn)`` once when its
    outbox passes the limit. Both may call ``send``."""

    def __init__(self, ctx: zmq.Context, cfg: InstanceConfig, on_gone: Callable[[Connection], None],
                 on_slow: Callable[[Connection], None], say: Callable[[str], None] | None = None) -> None:
        self.listen = cfg.listen
        self.on_gone = on_gone
        self.on_slow = on_slow
        self.say = say
        self.dropped = 0  # messages of peers that are no client (since start)
        self._dropped_said = 0
        self._drop_note_s = float("-inf")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, PIPE_LIMIT_MESSAGES)
        self.sock.setsockopt(zmq.MAXMSGSIZE, CONNECTION_FRAME_LIMIT_BYTES)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
        self.auth: ThreadAuthenticator | None = None
        keys = load_curve_server(cfg)
        if keys is not None:
            self.auth = ThreadAuthenticator(ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=cfg.curve_clients)
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.bind(cfg.listen)
        self.by_fd: dict[int, Connection] = {}
        self.waiting: set[Connection] = set()  # connections with something in their outbox
        self._serials = 0

    # -- connections -----------------------------------------------------------------------
    def _end(self, conn: Connection) -> None:
        if not conn.alive:
            return
        conn.alive = False
        if self.by_fd.get(conn.fd) is conn:
            del self.by_fd[conn.fd]
        conn.outbox.clear()
        conn.outbox_bytes = 0
        self.waiting.discard(conn)
        self.on_gone(conn)

    def check_disconnects(self) -> None:
        """End every connection the monitor reports closed."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            conn = self.by_fd.get(int(event["value"]))
            if conn is not None:
                self._end(conn)

    def _connection(self, routing_id: bytes, frame: zmq.Frame) -> Connection | None:
        """The connection a frame came on; None for a peer libzmq gives no descriptor for (a
        ZMTP/1.0-style peer), whose connection cannot be told apart from others'."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return None
        conn = self.by_fd.get(fd)
        if conn is not None and conn.routing_id != routing_id:
            self._end(conn)  # the descriptor was reused: the old connection is gone
            conn = None
        if conn is None:
            self._serials += 1
            conn = Connection(self._serials, fd, routing_id, _is_operator_peer(frame, self.listen))
            self.by_fd[fd] = conn
        return conn

    def receive(self) -> Iterator[tuple[Connection, bytes]]:
        """The client frames waiting now (at most ``RECEIVE_BATCH_FRAMES``), each with the
        connection it came on. A message of several frames is answered ``bad_frame`` here; one from
        a peer without a descriptor (no client of this protocol) is dropped here."""
        for _ in range(RECEIVE_BATCH_FRAMES):
            self.check_disconnects()
            if not self.sock.poll(0):
                return
            parts = self.sock.recv_multipart(copy=False)
            conn = self._connection(parts[0].bytes, parts[-1]) if len(parts) >= 2 else None
            if conn is None:
                self._drop("a message from a peer that is no ZeroMQ client of this protocol (ZMTP/1.0 or stray bytes)")
                continue
            conn.frames += 1
            if len(parts) > 2:
                self.send(conn, m.ErrorReply(None, "bad_frame", f"a request is one frame; this message had "
                                                                f"{len(parts) - 1}", frame=conn.frames))
            else:
                yield conn, parts[1].bytes

    def _drop(self, what: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if self.say is not None and now - self._drop_note_s >= DROP_NOTE_INTERVAL_S:
            self.say(f"client port: dropped {what}; {self.dropped - self._dropped_said} dropped since the last note")
            self._dropped_said = self.dropped
            self._drop_note_s = now

    # -- replies ---------------------------------------------------------------------------
    def send(self, conn: Connection, reply: m.Reply) -> None:
        """Queue a reply for ``conn`` (dropped if it has gone) and send what its client takes."""
        if not conn.alive:
            return
        frame = m.pack(reply.to_wire())
        if conn.outbox_bytes + len(frame) > OUTBOX_HARD_LIMIT_BYTES:
            conn.dropped += 1
            if conn.dropped == 1 and self.say is not None:
                self.say(f"client connection {conn.serial} left {conn.outbox_bytes} bytes of replies unread; "
                         "dropping its further replies until it reads")
            self._flush(conn)
            return
        conn.outbox.append((reply.id, frame))
        conn.outbox_bytes += len(frame)
        self.waiting.add(conn)
        self._flush(conn)
        if conn.alive and not conn.slow and conn.outbox_bytes > OUTBOX_LIMIT_BYTES:
            conn.slow = True
            self.on_slow(conn)

    def drop_queued(self, conn: Connection, client_rids: set[str]) -> None:
        """Forget the replies of these requests that still wait in ``conn``'s outbox."""
        kept = deque((rid, f) for rid, f in conn.outbox if rid not in client_rids)
        conn.outbox = kept
        conn.outbox_bytes = sum(len(f) for _, f in kept)

    def _flush(self, conn: Connection) -> None:
        self.check_disconnects()
        while conn.alive and conn.outbox:
            try:
                self.sock.send_multipart([conn.routing_id, conn.outbox[0][1]], zmq.NOBLOCK)
            except zmq.Again:
                return  # its pipe is full: the client is not reading; try again later
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH and self.say is not None:  # EHOSTUNREACH: gone before the monitor said so
                    self.say(f"client connection {conn.serial}: a reply could not be sent ({e}); ending the connection")
                self._end(conn)
                return
            conn.outbox_bytes -= len(conn.outbox.popleft()[1])
        if not conn.outbox:
            self.waiting.discard(conn)
            conn.slow = False
            conn.dropped = 0

    def flush(self) -> None:
        """Send what the waiting connections' clients take now."""
        for conn in list(self.waiting):
            self._flush(conn)

    @property
    def has_backlog(self) -> bool:
        return bool(self.waiting)

    def close(self) -> None:
        self.flush()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=200)
        if self.auth is not None:
            self.auth.stop()
