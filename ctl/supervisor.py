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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from ntx.ctl.restart_policy import FILE_CHECK_INTERVAL_S, ModelFiles, RestartPolicy
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig, InstancePaths
from ntx.shared.errors import NtxError
from ntx.shared.plan import RAM, STORAGE, Plan
from ntx.shared.run_files import open_private, private_dir, write_private
from ntx.shared.shm import unlink_all
from ntx.shared.stats import bottleneck

DRAIN_TIMEOUT_S = 30.0


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
    def __init__(self, cfg: InstanceConfig, plan: Plan) -> None:
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
        # opened once, before anything starts, so that a planted link fails the start in one line
        self.log = open_private(self.paths.log_dir / "supervisor.log", "a")
        self.daemon_logs = {name: open_private(self.paths.log_dir / f"{name}.log", "ab") for name in self.order}
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(self.paths.control)
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 500)
        self.front.bind(cfg.listen)
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
        self.inflight: dict[str, tuple[bytes, str]] = {}  # internal id -> (client identity, client id)
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.pending: deque[tuple[str, dict]] = deque()  # requests waiting for the pipeline
        self._ids = itertools.count()
        self.stop_requested: dict | None = None
        self.stop_waiters: list[bytes] = []
        self.drain_deadline_s: float | None = None
        self.done = False
        self.signalled: int | None = None

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
        for rid, (client, client_rid) in list(self.inflight.items()):
            self.reply(client, m.error_reply(client_rid, code, message))
        self.inflight.clear()
        self.by_client.clear()

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

    def watch(self) -> None:
        """Notice a dead daemon at once, a handshake that takes too long, a changed model file
        within ``FILE_CHECK_INTERVAL_S`` (and before every restart); restart when the back-off
        has passed."""
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
            if d.state != "ready" and time.monotonic() - d.started_s > self.cfg.handshake_timeout_s:
                self.pipeline_failed(f"{d.name} daemon was not ready within {self.cfg.handshake_timeout_s:.0f} s")
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
                while self.pending:
                    rid, req = self.pending.popleft()
                    self.forward(rid, req)
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
        while self.pending:
            rid, _ = self.pending.popleft()
            client, client_rid = self.inflight.pop(rid)
            self.by_client.pop((client, client_rid), None)
            self.reply(client, m.error_reply(client_rid, "shutdown", "the pipeline is stopping; request not started"))
        compute = self.daemons.get("compute")
        if force or not compute or compute.state != "ready" or not self.inflight:
            self.fail_inflight("shutdown", "the pipeline was stopped (--force); request cancelled")
            self.shutdown()
        else:
            self.control.send_multipart([f"compute-g{self.gen}".encode(), m.Drain(timeout_s=DRAIN_TIMEOUT_S).encode()])
            self.drain_deadline_s = time.monotonic() + DRAIN_TIMEOUT_S + 5.0

    def shutdown(self) -> None:
        self.state = "stopping"
        self.teardown_daemons()
        self.state = "failed" if self.reason else "stopped"
        self.done = True

    # -- clients -----------------------------------------------------------------------------
    def reply(self, client: bytes, msg: dict[str, Any]) -> None:
        try:
            self.front.send_multipart([client, m.pack(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client is gone or not reading; nothing else to tell

    def route(self, ev: dict[str, Any]) -> None:
        rid = ev.get("id")
        owner = self.inflight.get(rid)
        if owner is None:
            return
        client, client_rid = owner
        ev = dict(ev, id=client_rid)
        if ev.get("type") in ("done", "error"):
            del self.inflight[rid]
            self.by_client.pop((client, client_rid), None)
        self.reply(client, ev)

    def forward(self, rid: str, req: dict) -> None:
        target = f"compute-g{self.gen}".encode()
        msg = m.Cancel(rid=rid) if req.get("op") == "cancel" else m.Request(rid=rid, generate=req)
        self.control.send_multipart([target, msg.encode()])

    def on_client(self, client: bytes, frame: bytes) -> None:
        try:
            msg = m.decode_client_frame(frame)
        except m.ProtocolError as e:
            rid = None
            try:
                raw = m.unpack(frame)
                rid = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
            except Exception:
                pass
            self.reply(client, m.error_reply(rid, e.code, str(e)))
            return
        op = msg["op"]
        if op == "status":
            self.reply(client, {"id": msg.get("id"), "type": "status", "status": self.status()})
            return
        key = (client, msg["id"])
        if op == "cancel":
            rid = self.by_client.get(key)
            if rid is None:
                self.reply(client, m.error_reply(msg["id"], "unknown_id", f"no request {msg['id']!r} in flight"))
            elif any(r == rid for r, _ in self.pending):
                self.pending = deque((r, q) for r, q in self.pending if r != rid)
                self.route({"id": rid, "type": "done", "finish_reason": "cancelled", "text": "", "tokens": [],
                            "prompt_tokens": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "timings": {}})
            else:
                self.forward(rid, {"op": "cancel"})
            return
        if self.state == "stopping":
            self.reply(client, m.error_reply(msg["id"], "shutdown", "the pipeline is stopping"))
            return
        if key in self.by_client:
            self.reply(client, m.error_reply(msg["id"], "duplicate_id", f"request id {msg['id']!r} is already in flight"))
            return
        rid = f"r{next(self._ids)}"
        self.inflight[rid] = (client, msg["id"])
        self.by_client[key] = rid
        if self.state == "ready":
            self.forward(rid, msg)
        else:
            self.pending.append((rid, msg))

    # -- status -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        compute = self.stage_stats.get("compute", {})
        stages = {n: s for n, s in self.stage_stats.items() if "total" in s}
        return {
            "instance": self.cfg.name, "state": self.state, "reason": self.reason, "gen": self.gen,
            "model": self.cfg.model, "backend": self.cfg.backend, "listen": self.cfg.listen,
            "uptime_s": round(now - self.started_s, 3), "restarts": self.restarts,
            "supervisor_pid": os.getpid(),
            "plan": {**self.plan.to_dict(), "lines": self.plan.describe()},
            "daemons": {
                n: {"pid": d.proc.pid, "state": d.state, "uptime_s": round(now - d.started_s, 3), "restarts": self.restarts}
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

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        self.bring_up()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.front, zmq.POLLIN)
        while not self.done:
            events = dict(poller.poll(50))
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
            if self.front in events and not self.done:
                while self.front.poll(0):
                    parts = self.front.recv_multipart()
                    if len(parts) >= 2:
                        self.on_client(parts[0], parts[-1])
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
        self.front.close(linger=200)
        self.control.close(linger=200)
        self.paths.remove_runtime()
        for f in self.daemon_logs.values():
            f.close()
        self.log.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ntx-supervisor")
    ap.add_argument("--config", required=True, help="instance config JSON written by ntxctl start")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        data = json.load(f)
    cfg = InstanceConfig.from_dict(data["instance"])
    plan = Plan.from_dict(data["plan"])
    from ntx.shared.daemon import set_process_name

    set_process_name("ntx-supervisor")
    paths = InstancePaths(cfg.name)
    try:
        sup = Supervisor(cfg, plan)
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
