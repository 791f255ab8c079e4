"""The supervisor: the instance's one long-lived process, a small loop that wires its roles.

Why the client socket lives here and not in the compute daemon: when compute dies (kill -9, an
out-of-memory kill, a driver fault), somebody must still tell every client with a request in
flight that it failed. The supervisor holds the ROUTER the clients talk to and the text side of
every request, forwards requests to compute as token ids over the control channel, and routes
compute's outputs back as the clients' replies. Its roles, one module each:

* ``ctl/generations.py`` — the pipeline's processes, a generation at a time: spawn, handshake
  (Hello → Config → Ready, a state machine in this loop, so status answers while a model loads),
  watch, teardown, restart with back-off, the model files' stamps; and the HTTP gateway's life.
* ``ctl/admission.py`` — admission and routing: the pending queue, the compute window, the
  requests in flight and who owns them, cancels, compute's outputs to their clients.
* ``ctl/requests.py`` — the front's side of a request: the one check, the prompt as token ids,
  the output as text (the one tokenizer of the instance, loaded here from the GGUF).
* ``ctl/status_map.py`` — the status map, and what only operators see of it.
* ``ctl/front.py`` — the client socket: connections, their outboxes, CURVE.

This module makes the sockets and the roles, turns signals and ``ntxctl stop`` into a stop
(graceful: compute drains; forced: everything in flight is cancelled), dispatches each control
frame to its role, and leaves nothing behind when it ends. (The messages: ntx.shared.messages.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import zmq

from ntx.ctl.admission import Admission
from ntx.ctl.chat import RENDERER
from ntx.ctl.front import STATUS_OUTBOX_LIMIT_BYTES, ClientFront, Connection
from ntx.ctl.generations import CONTROL_SEND_TIMEOUT_S, GatewayProcess, Generations, daemon_order
from ntx.ctl.instance import Owner
from ntx.ctl.request_limits import RequestLimits
from ntx.ctl.requests import RequestFront
from ntx.ctl.status_map import InstanceStatus
from ntx.shared import messages as m
from ntx.shared.config import API_KEY_ENV, LOG_LEVELS, InstanceConfig, InstancePaths
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import open_model
from ntx.shared.plan import Plan
from ntx.shared.run_files import open_private, private_dir, take_secret, write_private

DRAIN_TIMEOUT_S = 30.0
OWNER_POLL_S = 1.0  # how often a supervisor with an owner (ctl/instance.Owner) looks whether it lives


class Supervisor:
    """The loop: control frames to the generations (daemons) or to admission (compute's
    outputs), client frames to admission or status, the watch of processes, stop and finish."""

    def __init__(self, cfg: InstanceConfig, plan: Plan, foreground: bool = False,
                 owner: Owner | None = None) -> None:
        self.cfg = cfg
        self.owner = owner
        self.owner_checked_s = time.monotonic()
        self.paths = InstancePaths(cfg.name)
        private_dir(self.paths.root)
        private_dir(self.paths.log_dir)
        # foreground (ntxctl serve): everything, daemons' output too, to stderr for systemd/containers;
        # else the log files, opened once before anything starts, so a planted link fails the start in one line
        self.foreground = foreground
        self.log = sys.stderr if foreground else open_private(self.paths.log_dir / "supervisor.log", "a")
        self.daemon_logs = {name: sys.stderr if foreground else open_private(self.paths.log_dir / f"{name}.log", "ab")
                            for name in daemon_order(plan)}
        # the one tokenizer of the instance: a vocabulary it cannot use fails the start in one line
        limits = RequestLimits(max_context=plan.ctx, max_batch=cfg.max_batch)
        requests = RequestFront.for_model(open_model(cfg.model), limits)
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        # a message to a daemon that is not connected is an error, a full pipe a wait, never a drop
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.control.setsockopt(zmq.SNDTIMEO, int(CONTROL_SEND_TIMEOUT_S * 1000))
        self.control.bind(self.paths.control)
        self.front = ClientFront(self.ctx, cfg, on_gone=self.connection_gone, on_slow=self.connection_slow, say=self.say)
        self.gens = Generations(cfg, plan, self.paths, self.control, self.say, self.daemon_logs,
                                on_ready=self.on_pipeline_ready, fail_requests=self.fail_requests)
        log_requests = LOG_LEVELS.index(cfg.log_level) <= LOG_LEVELS.index("info")
        self.admission = Admission(self.front, requests, limits, send_compute=self.gens.send_compute,
                                   compute_ready=lambda: self.gens.compute_ready,
                                   log=self.say if log_requests else None)
        # the HTTP API key, taken from the file ntxctl left (and deleted); handed on to each gateway
        key_file = self.paths.secret_file("supervisor")
        api_key = take_secret(key_file) if key_file.exists() else None
        self.gateway = GatewayProcess(cfg, self.paths, foreground, self.say, api_key)
        self.status = InstanceStatus(cfg, plan, self.paths, self.gens, self.admission, self.gateway)
        self.stop_waiters: list[bytes] = []
        self.drain_deadline_s: float | None = None
        self.signalled: int | None = None

    @property
    def done(self) -> bool:
        return self.gens.done

    def say(self, text: str) -> None:
        now = time.time()  # milliseconds: a restart's steps take tenths of a second
        self.log.write(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {text}\n")

    # -- between the roles ----------------------------------------------------------------
    def on_pipeline_ready(self) -> None:
        self.admission.dispatch()

    def fail_requests(self, code: str, message: str) -> None:
        self.admission.fail_inflight(code, message)

    def connection_gone(self, conn: Connection) -> None:
        if conn.rids:
            self.say(f"client connection {conn.serial} closed; cancelling its {len(conn.rids)} request(s)")
        self.admission.connection_gone(conn)

    def connection_slow(self, conn: Connection) -> None:
        self.say(f"client connection {conn.serial} has {conn.outbox_bytes} bytes unread; cancelling its requests")
        self.admission.connection_slow(conn)

    # -- messages from daemons and ntxctl --------------------------------------------------
    def on_control(self, ident: bytes, frame: bytes) -> None:
        """A frame on the control socket: from ntxctl (identity ``ctl-…``) or from a daemon
        (identity ``<name>-g<gen>``, which says who sent it)."""
        if ident.startswith(b"ctl"):
            self.on_ctl(ident, m.CTL_TO_SUPERVISOR.decode(frame))
            return
        msg = self.gens.on_message(ident, frame)
        if isinstance(msg, m.EngineOutputs):
            for ev in msg.events:
                try:
                    self.admission.route(ev)
                except Exception as e:  # noqa: BLE001 - one request's output ends that request, not the others
                    self.say(f"request {ev.id}: its output failed at the front: {type(e).__name__}: {str(e)[:200]}")
                    self.admission.abort(ev.id, "internal_error", f"the server failed on this request's output "
                                                                  f"({type(e).__name__}); it was cancelled")
        elif isinstance(msg, m.Drained):
            self.drain_deadline_s = None
            self.gens.shutdown()

    def on_ctl(self, ident: bytes, msg: m.CtlStatus | m.CtlStop) -> None:
        if isinstance(msg, m.CtlStatus):
            self.control.send_multipart([ident, m.StatusReport(status=self.status.build()).encode()])
        else:
            self.stop_waiters.append(ident)
            self.begin_stop(force=msg.force)

    def begin_stop(self, force: bool) -> None:
        gens = self.gens
        if gens.state == "stopping":
            return
        self.say(f"stop requested ({'force' if force else 'graceful'})")
        gens.state = "stopping"
        gens.write_state()
        self.admission.closed = True
        self.admission.fail_pending("shutdown", "the pipeline is stopping; request not started")
        compute = gens.daemons.get("compute")
        if force or not compute or compute.state != "ready" or not self.admission.inflight:
            self.admission.fail_inflight("shutdown", "the pipeline was stopped (--force); request cancelled")
            gens.shutdown()
        elif gens.send_compute(m.Drain(timeout_s=DRAIN_TIMEOUT_S)):
            self.drain_deadline_s = time.monotonic() + DRAIN_TIMEOUT_S + 5.0

    # -- clients -----------------------------------------------------------------------------
    def frame_error(self, conn: Connection, frame: bytes, code: str, message: str) -> None:
        """Refuse a whole frame: under its request's id when it can be read, else under the
        frame's number on its connection (``ErrorReply.frame``), so its client can match it."""
        rid = m.client_frame_id(frame)
        self.front.send(conn, m.ErrorReply(rid, code, message, frame=None if rid is not None else conn.frames))

    def on_client(self, conn: Connection, frame: bytes) -> None:
        try:
            msg = m.decode_client_frame(frame)
        except m.RequestError as e:
            self.frame_error(conn, frame, e.code, str(e))
            return
        op = msg["op"]
        if op == "status":
            if conn.outbox_bytes > STATUS_OUTBOX_LIMIT_BYTES:  # it asks faster than it reads
                self.front.send(conn, m.ErrorReply(msg.get("id"), "overloaded", f"{conn.outbox_bytes} bytes of replies "
                                                   "wait unread on this connection; read them before asking status"))
            else:
                self.front.send(conn, m.StatusReply(msg.get("id"), self.status.build(operator=conn.operator)))
        elif op == "cancel":
            self.admission.cancel(conn, msg["id"])
        else:
            self.admission.generate(conn, msg, len(frame))

    def on_client_frame(self, conn: Connection, frame: bytes) -> None:
        """``on_client``, and whatever goes wrong in it is this frame's error, never the loop's."""
        try:
            self.on_client(conn, frame)
        except Exception as e:  # noqa: BLE001 - one bad frame must not take the instance down
            self.say(f"client frame of {len(frame)} bytes failed: {type(e).__name__}: {str(e)[:200]}")
            self.frame_error(conn, frame, "internal_error",
                             f"the server failed on this frame ({type(e).__name__}); it was dropped")

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        self.gens.bring_up()
        if self.cfg.http:
            self.gateway.spawn()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.front.sock, zmq.POLLIN)
        poller.register(self.front.monitor, zmq.POLLIN)
        while not self.done:
            # replies waiting for slow readers are retried soon (each new reply retries its
            # connection at once); otherwise wait for a message
            events = dict(poller.poll(20 if self.front.has_backlog else 50))
            if self.signalled is not None:
                self.begin_stop(force=self.signalled == signal.SIGINT)
                self.signalled = None
            if self.owner is not None and time.monotonic() - self.owner_checked_s >= OWNER_POLL_S:
                self.owner_checked_s = time.monotonic()
                if not self.owner.alive():
                    self.say(f"the process this instance was started for (pid {self.owner.pid}) is gone; stopping")
                    self.owner = None
                    self.begin_stop(force=True)
            if self.control in events:
                while self.control.poll(0) and not self.done:
                    parts = self.control.recv_multipart()
                    try:
                        self.on_control(parts[0], parts[1])
                    except Exception as e:  # one broken daemon message must not take the front down
                        self.say(f"bad control message from {parts[0]!r:.80}: {type(e).__name__}: {str(e)[:200]}")
            if not self.done:
                for conn, frame in self.front.receive():
                    self.on_client_frame(conn, frame)
                self.front.flush()
            if not self.done:
                self.gateway.watch()
                self.gens.watch()
            if self.drain_deadline_s is not None and time.monotonic() > self.drain_deadline_s:
                self.admission.fail_inflight("shutdown", "the pipeline stopped before the request finished")
                self.gens.shutdown()
        self.finish()
        return 0 if not self.gens.reason else 1

    def finish(self) -> None:
        """Leave nothing behind: daemons, shared memory, sockets, run folder."""
        reason = self.gens.reason
        self.admission.fail_inflight("shutdown", reason or "the pipeline stopped")
        self.gateway.stop()
        self.gens.teardown_daemons(grace_s=1.0)
        if reason:
            write_private(self.paths.log_dir / "last_failure", reason + "\n")
        self.say(f"stopped{': ' + reason if reason else ''}")
        for ident in self.stop_waiters:
            try:
                self.control.send_multipart([ident, m.Stopped(reason=reason).encode()])
            except zmq.ZMQError:
                pass
        time.sleep(0.05)
        self.front.close()
        RENDERER.stop()
        self.control.close(linger=200)
        self.paths.remove_runtime()
        if not self.foreground:
            for f in self.daemon_logs.values():
                f.close()
            self.log.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ntx-supervisor")
    ap.add_argument("--config", required=True, help="instance config JSON written by ntxctl start")
    ap.add_argument("--foreground", action="store_true", help="ntxctl serve: log to stderr")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        data = json.load(f)
    cfg = InstanceConfig.from_dict(data["instance"])
    plan = Plan.from_dict(data["plan"])
    owner = Owner.from_dict(data["owner"]) if data.get("owner") else None
    os.environ.pop(API_KEY_ENV, None)  # the daemons inherit this environment; the key comes by file
    from ntx.shared.daemon import set_process_name

    set_process_name("ntx-supervisor")
    paths = InstancePaths(cfg.name)
    try:
        sup = Supervisor(cfg, plan, foreground=args.foreground, owner=owner)
    except (zmq.ZMQError, NtxError) as e:
        reason = f"cannot listen on {cfg.listen}: {e}" if isinstance(e, zmq.ZMQError) else str(e)
        try:
            write_private(private_dir(paths.log_dir) / "last_failure", reason + "\n")
        except NtxError:
            print(reason, file=sys.stderr, flush=True)  # supervisor.out: ntxctl start shows its last line
        paths.remove_runtime()
        sys.exit(1)

    def on_signal(signum, frame):  # noqa: ARG001
        sup.signalled = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sys.exit(sup.run())


if __name__ == "__main__":
    main()
