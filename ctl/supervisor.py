"""The supervisor: starts the three daemons, watches them, restarts them, and fronts the clients.

Why the client socket lives here and not in the compute daemon: when compute dies (kill -9, an
out-of-memory kill, a driver fault), somebody must still tell every client with a request in
flight that it failed. The supervisor holds the ROUTER the clients talk to, remembers which
client owns which request, forwards requests to compute over the control channel, and routes
compute's replies back. A dead daemon becomes an error reply for every in-flight request and a
restart of the whole pipeline under a new generation number (fresh sockets and shared memory
names, so nothing stale can be mistaken for current), with bounded retries spaced by an
exponential back-off; a model file that changed under the pipeline stops it instead
(ctl/restart_policy.py has both rules).

Bring-up is a state machine inside the main loop, never a blocking wait, so ``ntxctl status``
answers while a 40 GB model loads: compute first (it owns the device slots), then dma (it opens
them and creates the host slots and the pinned-RAM tier), then the reader (it maps the host
slots). Each does Hello → Config → Ready with a timeout; a ``Fatal`` message carries the daemon's
own one-line reason to ``ntxctl start``. (The messages: ntx.shared.messages.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ntx.ctl.front import ClientFront, Connection
from ntx.ctl.request_limits import MAX_QUEUED_BYTES, MAX_QUEUED_REQUESTS, MAX_REQUESTS_PER_CONNECTION, RequestLimits
from ntx.ctl.restart_policy import FILE_CHECK_INTERVAL_S, ModelFiles, RestartPolicy
from ntx.daemons.compute.threads import bound_blas_threads
from ntx.shared import messages as m
from ntx.shared.config import LOG_LEVELS, InstanceConfig, InstancePaths
from ntx.shared.errors import NtxError
from ntx.shared.plan import RAM, STORAGE, Plan
from ntx.shared.run_files import open_private, private_dir, write_private
from ntx.shared.shm import unlink_all
from ntx.shared.stats import bottleneck

DRAIN_TIMEOUT_S = 30.0
# A send to a daemon waits at most this long for room in its pipe (the compute window keeps it
# far from full, so a wait this long means the daemon is stuck): then the pipeline has failed.
CONTROL_SEND_TIMEOUT_S = 30.0
# Status fields only operators see (connections from this machine; ntxctl status)
OPERATOR_STATUS_FIELDS = ("model", "listen", "supervisor_pid", "reason")
GATEWAY_MIN_RUN_S = 5.0  # a gateway that dies sooner cannot start at all; it is not restarted


def request_log_line(rid: str, client_rid: str, ev: dict) -> str:
    """One line per finished request: ids, prompt and generated tokens, finish, time to first
    token (queued + prefill, as compute measured them) and decode tok/s."""
    head = f"request {rid} (client id {client_rid!r}):"
    if ev.get("type") == "error":
        return f"{head} error {ev.get('code')}: {ev.get('message')}"
    usage, t = ev.get("usage") or {}, ev.get("timings") or {}
    ttft_s = (t.get("queued_s") or 0.0) + (t.get("prefill_s") or 0.0)
    tok_s = t.get("decode_tokens_per_s")  # None when there was nothing to decode after the first token
    return (f"{head} prompt {usage.get('prompt_tokens', 0)} tokens, generated {usage.get('completion_tokens', 0)}, "
            f"finish {ev.get('finish_reason')}, ttft {ttft_s:.3f} s, "
            + (f"{tok_s:.1f} tok/s" if tok_s is not None else "no decode"))


@dataclass
class DaemonProc:
    name: str
    proc: subprocess.Popen
    started_s: float
    state: str = "spawned"  # spawned -> configured -> ready
    ready: m.Ready = field(default_factory=m.Ready)  # what its Ready handed on


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Supervisor:
    def __init__(self, cfg: InstanceConfig, plan: Plan, foreground: bool = False) -> None:
        self.cfg = cfg
        self.plan = plan
        self.paths = InstancePaths(cfg.name)
        self.started_s = time.monotonic()
        private_dir(self.paths.root)
        private_dir(self.paths.log_dir)
        self.order = ["compute"]
        if plan.streamed_layers:
            self.order.append("dma")
        if plan.layers_on(STORAGE):
            self.order.append("reader")
        # foreground (ntxctl serve): everything, daemons' output too, to stderr for systemd/containers;
        # else the log files, opened once before anything starts, so a planted link fails the start in one line
        self.foreground = foreground
        self.log = sys.stderr if foreground else open_private(self.paths.log_dir / "supervisor.log", "a")
        self.daemon_logs = {name: sys.stderr if foreground else open_private(self.paths.log_dir / f"{name}.log", "ab")
                            for name in self.order}
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        # a message to a daemon that is not connected is an error, a full pipe a wait, never a drop
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.control.setsockopt(zmq.SNDTIMEO, int(CONTROL_SEND_TIMEOUT_S * 1000))
        self.control.bind(self.paths.control)
        self.front = ClientFront(self.ctx, cfg, on_gone=self.connection_gone, on_slow=self.connection_slow)
        self.limits = RequestLimits(max_context=cfg.ctx, max_batch=cfg.max_batch)
        self.gen = 0
        self.state = "starting"
        self.reason: str | None = None
        self.ever_ready = False
        self.restart_policy = RestartPolicy(cfg.max_restarts)
        self.restart_at_s: float | None = None  # when the next generation starts (back-off)
        self.model_files = ModelFiles(cfg.model, cfg.draft_model)
        self.next_file_check_s = 0.0
        self.restarts = 0
        self.daemons: dict[str, DaemonProc] = {}
        self.stage_stats: dict[str, dict] = {}
        self.inflight: dict[str, tuple[Connection, str]] = {}  # internal id -> (connection, client id)
        self.by_client: dict[tuple[int, str], str] = {}  # (connection serial, client id) -> internal id
        # requests waiting for room at compute: internal id -> (generate map, frame bytes)
        self.pending: dict[str, tuple[dict, int]] = {}
        self.pending_bytes = 0
        self.at_compute: set[str] = set()  # forwarded, compute's done/error not yet seen
        self.cancel_sent: set[str] = set()
        self._ids = itertools.count()
        self.stop_requested: dict | None = None
        self.stop_waiters: list[bytes] = []
        self.drain_deadline_s: float | None = None
        self.done = False
        self.signalled: int | None = None
        self.gateway: subprocess.Popen | None = None  # the HTTP gateway (ntx.ctl.gateway), with --http
        self.gateway_started_s = 0.0

    # -- logging & state file -----------------------------------------------------------------
    def say(self, text: str) -> None:
        now = time.time()  # milliseconds: a restart's steps take tenths of a second
        self.log.write(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {text}\n")

    def write_state(self) -> None:
        tmp = self.paths.state_file.with_suffix(".tmp")
        write_private(tmp, json.dumps({"state": self.state, "reason": self.reason, "gen": self.gen, "pid": os.getpid()}))
        os.replace(tmp, self.paths.state_file)

    # -- daemons -------------------------------------------------------------------------------
    def shm_names(self) -> dict[str, str]:
        return {
            "dev_slot": self.paths.shm_name(self.gen, "dslot"),
            "host_slot": self.paths.shm_name(self.gen, "hslot"),
            "ram": self.paths.shm_name(self.gen, "ramtier"),
        }

    def spawn(self, name: str) -> None:
        env = dict(os.environ)
        if name != "compute":  # the copy and read loops gain nothing from BLAS threads
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
        else:
            bound_blas_threads(env)
        proc = subprocess.Popen(
            [sys.executable, "-m", f"ntx.daemons.{name}", "--control", self.paths.control, "--gen", str(self.gen),
             "--supervisor-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=self.daemon_logs[name], stderr=subprocess.STDOUT, env=env,
        )
        self.daemons[name] = DaemonProc(name, proc, time.monotonic())
        self.say(f"gen {self.gen}: started {name} (pid {proc.pid})")

    def config_for(self, name: str) -> m.Config:
        return m.Config(
            instance=self.cfg.to_dict(), plan=self.plan.to_dict(), shm_names=self.shm_names(),
            host_ring=self.paths.host_ring(self.gen), device_ring=self.paths.device_ring(self.gen),
            device_slots=self.daemons["compute"].ready.device_slots if name == "dma" else [],
            host_slots=self.daemons["dma"].ready.host_slots if name == "reader" else [],
        )

    def bring_up(self) -> None:
        self.state = "starting"
        self.stage_stats.clear()
        self.write_state()
        self.spawn(self.order[0])

    def teardown_daemons(self, grace_s: float = 3.0) -> None:
        """Stop every daemon of this generation and free what they held.

        SIGTERM rather than a Shutdown message: a daemon blocked in a ring wait (its peer just
        died) does not read its control socket, but every wait heeds the signal's flag within
        ``WAIT_SLICE_S`` (shared/daemon.py). SIGKILL after ``grace_s``; the sweep of the
        generation's shared memory below covers a daemon that could not unlink its own."""
        for d in self.daemons.values():
            if d.proc.poll() is None:
                d.proc.terminate()
        deadline = time.monotonic() + grace_s
        for d in self.daemons.values():
            try:
                d.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        self.daemons.clear()
        n = unlink_all(self.paths.shm_prefix)
        if n:
            self.say(f"freed {n} shared memory segment(s) left by gen {self.gen}")
        for sock in self.paths.socket_files():
            if sock.name.startswith("ring-"):
                sock.unlink(missing_ok=True)

    def fail_inflight(self, code: str, message: str) -> None:
        """Answer every request in flight with an error: compute has gone or is going."""
        for rid in list(self.inflight):
            self.end_request(rid, error=(code, message))
        self.at_compute.clear()
        self.cancel_sent.clear()

    def pipeline_failed(self, reason: str) -> None:
        self.say(f"gen {self.gen}: {reason}")
        if self.state == "stopping":
            return
        if not self.ever_ready:
            # A daemon that cannot start (bad model, no GPU, no memory) will not start on retry.
            self.reason = reason
            self.fail_inflight("pipeline_failure", reason)
            self.shutdown()
            return
        delay_s = self.restart_policy.after_failure(time.monotonic())
        self.fail_inflight("pipeline_failure", f"{reason}; the pipeline is restarting")
        self.teardown_daemons()
        if delay_s is None:
            self.reason = (f"{reason}; gave up after {self.cfg.max_restarts} restarts "
                           f"in {self.restart_policy.window_s:.0f} s")
            self.shutdown()
            return
        self.say(f"restarting in {delay_s:.2f} s")
        self.state = "restarting"
        self.write_state()
        self.restart_at_s = time.monotonic() + delay_s

    def model_changed(self, change: str) -> None:
        """Stop for good: the daemons would read another file than the one the plan was made for."""
        self.say(change)
        self.reason = f"{change}; stopped (start the instance again to serve the new file)"
        self.fail_inflight("model_changed", self.reason)
        self.shutdown()

    # -- the HTTP gateway: a plain protocol client, restarted if it dies after running a while --
    def spawn_gateway(self) -> None:
        logf = sys.stderr if self.foreground else open_private(self.paths.log_dir / "gateway.log", "ab")
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", self.cfg.listen, "--http", self.cfg.http,
             "--log-level", self.cfg.log_level],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
        )
        if not self.foreground:
            logf.close()
        self.gateway_started_s = time.monotonic()
        self.say(f"started the HTTP gateway on {self.cfg.http} (pid {self.gateway.pid})")

    def watch_gateway(self) -> None:
        code = self.gateway.poll() if self.gateway else None
        if code is None:
            return
        ran_s = time.monotonic() - self.gateway_started_s
        if ran_s < GATEWAY_MIN_RUN_S:  # it cannot start (port taken): retrying will not help
            self.say(f"the HTTP gateway {_exit_description(code)} after {ran_s:.1f} s; not restarting it "
                     f"(its reason: {self.paths.log_dir / 'gateway.log'})")
            self.gateway = None
            return
        self.say(f"the HTTP gateway {_exit_description(code)}; restarting it")
        self.spawn_gateway()

    def stop_gateway(self) -> None:
        if self.gateway and self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()

    def watch(self) -> None:
        """Notice a dead daemon (or gateway) at once, a handshake that takes too long, a changed
        model file within ``FILE_CHECK_INTERVAL_S`` (and before every restart); restart when the
        back-off has passed."""
        self.watch_gateway()
        now = time.monotonic()
        restart_due = self.restart_at_s is not None and now >= self.restart_at_s
        if now >= self.next_file_check_s or restart_due:
            self.next_file_check_s = now + FILE_CHECK_INTERVAL_S
            change = self.model_files.change()
            if change:
                self.model_changed(change)
                return
        if restart_due:
            self.restart_at_s = None
            self.restarts += 1
            self.gen += 1
            self.bring_up()
            return
        for d in list(self.daemons.values()):
            code = d.proc.poll()
            if code is not None:
                self.pipeline_failed(f"{d.name} daemon (pid {d.proc.pid}) {_exit_description(code)}")
                return
            if d.state != "ready" and time.monotonic() - d.started_s > self.cfg.timeout:
                self.pipeline_failed(f"{d.name} daemon was not ready within {self.cfg.timeout:.0f} s")
                return

    # -- messages from daemons and ntxctl --------------------------------------------------
    def on_control(self, ident: bytes, frame: bytes) -> None:
        """A frame on the control socket: from ntxctl (identity ``ctl-…``) or from a daemon
        (identity ``<name>-g<gen>``, which says who sent it)."""
        who = ident.decode(errors="replace")
        if who.startswith("ctl"):
            self.on_ctl(ident, m.CTL_TO_SUPERVISOR.decode(frame))
            return
        name, _, gen = who.rpartition("-g")
        if not gen.isdigit() or int(gen) != self.gen or name not in self.daemons:
            return  # a message from a generation already torn down
        msg = m.DAEMON_TO_SUPERVISOR.decode(frame)
        d = self.daemons[name]
        if isinstance(msg, m.Hello):
            self.control.send_multipart([ident, self.config_for(name).encode()])
            d.state = "configured"
        elif isinstance(msg, m.Ready):
            d.state = "ready"
            d.ready = msg
            self.say(f"gen {self.gen}: {name} ready")
            nxt = self.order.index(name) + 1
            if nxt < len(self.order):
                self.spawn(self.order[nxt])
            else:
                self.state = "ready"
                self.ever_ready = True
                self.write_state()
                self.dispatch()
        elif isinstance(msg, m.Fatal):
            self.pipeline_failed(msg.message)
        elif isinstance(msg, m.Stats):
            self.stage_stats[name] = msg.stats
        elif isinstance(msg, m.Events):
            for ev in msg.events:
                self.route(ev)
        elif isinstance(msg, m.Drained):
            self.drain_deadline_s = None
            self.shutdown()

    def on_ctl(self, ident: bytes, msg: m.CtlStatus | m.CtlStop) -> None:
        if isinstance(msg, m.CtlStatus):
            self.control.send_multipart([ident, m.StatusReport(status=self.status()).encode()])
        else:
            self.stop_waiters.append(ident)
            self.begin_stop(force=msg.force)

    def begin_stop(self, force: bool) -> None:
        if self.state == "stopping":
            return
        self.say(f"stop requested ({'force' if force else 'graceful'})")
        self.state = "stopping"
        self.write_state()
        for rid in list(self.pending):
            self.end_request(rid, error=("shutdown", "the pipeline is stopping; request not started"))
        compute = self.daemons.get("compute")
        if force or not compute or compute.state != "ready" or not self.inflight:
            self.fail_inflight("shutdown", "the pipeline was stopped (--force); request cancelled")
            self.shutdown()
        elif self.send_compute(m.Drain(timeout_s=DRAIN_TIMEOUT_S)):
            self.drain_deadline_s = time.monotonic() + DRAIN_TIMEOUT_S + 5.0

    def shutdown(self) -> None:
        self.state = "stopping"
        self.teardown_daemons()
        self.state = "failed" if self.reason else "stopped"
        self.done = True

    # -- clients -----------------------------------------------------------------------------
    # A request is in ``inflight`` from its admission to its last reply; meanwhile it waits in
    # ``pending`` (the supervisor's bounded queue) or is ``at_compute`` (at most the compute
    # window). Every admitted request ends in exactly one done or error reply (``end_request``).
    def send_compute(self, msg: m.Message) -> bool:
        """Send to this generation's compute; a failure to deliver fails the pipeline (False)."""
        try:
            self.control.send_multipart([f"compute-g{self.gen}".encode(), msg.encode()])
            return True
        except zmq.ZMQError as e:
            why = "is not connected" if e.errno == zmq.EHOSTUNREACH else f"took no message for {CONTROL_SEND_TIMEOUT_S:.0f} s"
            self.pipeline_failed(f"compute daemon {why}")
            return False

    def dispatch(self) -> None:
        """Forward queued requests, oldest first, while compute's window has room."""
        while self.pending and self.state == "ready" and len(self.at_compute) < self.limits.compute_window:
            rid = next(iter(self.pending))
            req, n_bytes = self.pending.pop(rid)
            self.pending_bytes -= n_bytes
            self.at_compute.add(rid)
            if not self.send_compute(m.Request(rid=rid, generate=req)):
                return

    def cancel_at_compute(self, rid: str) -> None:
        if rid in self.at_compute and rid not in self.cancel_sent:
            self.cancel_sent.add(rid)
            self.send_compute(m.Cancel(rid=rid))

    def end_request(self, rid: str, error: tuple[str, str] | None = None) -> None:
        """Forget a request (its reply, if any, is sent first); an error ends it for its client."""
        conn, client_rid = self.inflight.pop(rid)
        self.by_client.pop((conn.serial, client_rid), None)
        conn.rids.discard(rid)
        if rid in self.pending:
            self.pending_bytes -= self.pending.pop(rid)[1]
        if error is not None:
            self.front.send(conn, m.error_reply(client_rid, *error))

    def connection_gone(self, conn: Connection) -> None:
        """Its client disconnected: nobody will read these requests' replies, so they stop."""
        if conn.rids:
            self.say(f"client connection {conn.serial} closed; cancelling its {len(conn.rids)} request(s)")
        for rid in list(conn.rids):
            self.end_request(rid)
            self.cancel_at_compute(rid)

    def connection_slow(self, conn: Connection) -> None:
        """Its client reads far slower than its requests produce: cancel them, with a reason."""
        self.say(f"client connection {conn.serial} has {conn.outbox_bytes} bytes unread; cancelling its requests")
        client_rids = {self.inflight[rid][1] for rid in conn.rids}
        self.front.drop_queued(conn, client_rids)
        for rid in list(conn.rids):
            self.cancel_at_compute(rid)
            self.end_request(rid, error=("client_too_slow", "the client did not read its replies (more than "
                                         f"{conn.outbox_bytes >> 20} MiB waiting); request cancelled"))

    def route(self, ev: dict[str, Any]) -> None:
        rid = ev.get("id")
        last = ev.get("type") in ("done", "error")
        if last:
            self.at_compute.discard(rid)
            self.cancel_sent.discard(rid)
        owner = self.inflight.get(rid)
        if owner is not None:
            conn, client_rid = owner
            if last:
                self.end_request(rid)
            self.front.send(conn, dict(ev, id=client_rid))
            if last and LOG_LEVELS.index(self.cfg.log_level) <= LOG_LEVELS.index("info"):
                self.say(request_log_line(rid, client_rid, ev))
        if last:
            self.dispatch()

    def on_client(self, conn: Connection, frame: bytes) -> None:
        try:
            msg = m.decode_client_frame(frame)
            if msg["op"] == "generate":
                self.limits.check(msg)
        except m.ProtocolError as e:
            self.front.send(conn, m.error_reply(m.client_frame_id(frame), e.code, str(e)))
            return
        op = msg["op"]
        if op == "status":
            self.front.send(conn, {"id": msg.get("id"), "type": "status", "status": self.status(operator=conn.operator)})
            return
        key = (conn.serial, msg["id"])
        if op == "cancel":
            rid = self.by_client.get(key)
            if rid is None:
                self.front.send(conn, m.error_reply(msg["id"], "unknown_id", f"no request {msg['id']!r} in flight"))
            elif rid in self.pending:
                self.route({"id": rid, "type": "done", "finish_reason": "cancelled", "text": "", "tokens": [],
                            "prompt_tokens": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "timings": {}})
            else:
                self.cancel_at_compute(rid)
            return
        refusal = self.refusal(conn, key, len(frame))
        if refusal is not None:
            self.front.send(conn, m.error_reply(msg["id"], *refusal))
            return
        rid = f"r{next(self._ids)}"
        self.inflight[rid] = (conn, msg["id"])
        self.by_client[key] = rid
        conn.rids.add(rid)
        self.pending[rid] = (msg, len(frame))
        self.pending_bytes += len(frame)
        self.dispatch()

    def refusal(self, conn: Connection, key: tuple[int, str], n_bytes: int) -> tuple[str, str] | None:
        """Why a checked generate request cannot be admitted now (code, message), or None."""
        if self.state == "stopping":
            return "shutdown", "the pipeline is stopping"
        if key in self.by_client:
            return "duplicate_id", f"request id {key[1]!r} is already in flight"
        if len(conn.rids) >= MAX_REQUESTS_PER_CONNECTION:
            return "overloaded", f"this connection has {MAX_REQUESTS_PER_CONNECTION} requests in flight, the most it may"
        if len(self.pending) >= MAX_QUEUED_REQUESTS or self.pending_bytes + n_bytes > MAX_QUEUED_BYTES:
            return "overloaded", f"{len(self.pending)} requests are queued, the most the pipeline holds; retry later"
        return None

    def on_client_frame(self, conn: Connection, frame: bytes) -> None:
        """``on_client``, and whatever goes wrong in it is this frame's error, never the loop's."""
        try:
            self.on_client(conn, frame)
        except Exception as e:  # noqa: BLE001 - one bad frame must not take the instance down
            self.say(f"client frame of {len(frame)} bytes failed: {type(e).__name__}: {str(e)[:200]}")
            self.front.send(conn, m.error_reply(None, "internal_error",
                                                f"the server failed on this frame ({type(e).__name__}); it was dropped"))

    # -- status -----------------------------------------------------------------------------
    def status(self, operator: bool = True) -> dict[str, Any]:
        """The status map; without ``operator``, less what only operators see (paths, pids)."""
        now = time.monotonic()
        compute = self.stage_stats.get("compute", {})
        stages = {n: s for n, s in self.stage_stats.items() if "total" in s}
        st = {
            "instance": self.cfg.name, "state": self.state, "reason": self.reason, "gen": self.gen,
            "model": self.cfg.model, "backend": self.cfg.backend, "listen": self.cfg.listen,
            "kernels": self.cfg.kernel_options.describe(),
            "uptime_s": round(now - self.started_s, 3), "restarts": self.restarts,
            "supervisor_pid": os.getpid(), "log_dir": str(self.paths.log_dir),
            "http": self.cfg.http if self.gateway else None,
            "plan": {**self.plan.to_dict(), "lines": self.plan.describe()},
            "daemons": {
                n: {**({"pid": d.proc.pid} if operator else {}), "state": d.state,
                    "uptime_s": round(now - d.started_s, 3), "restarts": self.restarts}
                for n, d in self.daemons.items()
            },
            "stages": stages,
            "bottleneck": bottleneck(stages),
            "requests": {
                "active": len(compute.get("active", [])), "queued": len(compute.get("queued", [])) + len(self.pending),
                "in_flight": len(self.inflight),
            },
            "tokens_per_s": compute.get("tokens_per_s", 0.0),
            "tokens_generated": compute.get("tokens_generated", 0),
            "speculation": compute.get("speculation"),
            "slots": {
                "n_slots": self.plan.n_slots, "slot_bytes": self.plan.slot_bytes,
                "host": self.stage_stats.get("dma", {}).get("host_slots"),
                "device_free_at_dma": self.stage_stats.get("dma", {}).get("device_slots_free_seen"),
            },
            "io": {k: self.stage_stats.get("reader", {}).get(k) for k in ("io_mode", "io_fallback")},
            "ram_tier_layers": len(self.plan.layers_on(RAM)),
        }
        if not operator:
            for key in OPERATOR_STATUS_FIELDS:
                del st[key]
        return st

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        self.bring_up()
        if self.cfg.http:
            self.spawn_gateway()
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
            if self.control in events:
                while self.control.poll(0) and not self.done:
                    ident, frame = self.control.recv_multipart()[:2]
                    try:
                        self.on_control(ident, frame)
                    except Exception as e:  # one broken daemon message must not take the front down
                        self.say(f"bad control message from {ident!r}: {e}")
            if not self.done:
                for conn, frame in self.front.receive():
                    self.on_client_frame(conn, frame)
                self.front.flush()
            if not self.done:
                self.watch()
            if self.drain_deadline_s is not None and time.monotonic() > self.drain_deadline_s:
                self.fail_inflight("shutdown", "the pipeline stopped before the request finished")
                self.shutdown()
        self.finish()
        return 0 if not self.reason else 1

    def finish(self) -> None:
        """Leave nothing behind: daemons, shared memory, sockets, run folder."""
        self.fail_inflight("shutdown", self.reason or "the pipeline stopped")
        self.stop_gateway()
        self.teardown_daemons(grace_s=1.0)
        if self.reason:
            write_private(self.paths.log_dir / "last_failure", self.reason + "\n")
        self.say(f"stopped{': ' + self.reason if self.reason else ''}")
        for ident in self.stop_waiters:
            try:
                self.control.send_multipart([ident, m.Stopped(reason=self.reason).encode()])
            except zmq.ZMQError:
                pass
        time.sleep(0.05)
        self.front.close()
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
    from ntx.shared.daemon import set_process_name

    set_process_name("ntx-supervisor")
    paths = InstancePaths(cfg.name)
    try:
        sup = Supervisor(cfg, plan, foreground=args.foreground)
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
