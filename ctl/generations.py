"""The pipeline's processes, one generation at a time: spawn, handshake, watch, tear down, restart.

A *generation* is one set of daemons (compute, then dma when a layer streams, then the reader
when a layer is on storage) with its own sockets and shared-memory names, so nothing of a
torn-down generation can be mistaken for current. Bring-up is a state machine driven by the
supervisor's loop, never a blocking wait, so ``ntxctl status`` answers while a 40 GB model
loads: each daemon does Hello → Config → Ready with a timeout, and its ``Ready`` is handed on in
the next one's ``Config``; a ``Fatal`` carries the daemon's own one-line reason to ``ntxctl
start``. A dead daemon fails the requests in flight and restarts the whole pipeline under the
next generation after a back-off; a model file that changed under it stops the instance instead
(``ctl/restart_policy.py`` has both rules). A ready daemon that stops sending its ``Stats``
(stopped, deadlocked, stuck in a driver call) is *stalled*: after ``STALL_REPORT_S`` the
state says ``stalled`` and names it (new requests wait, ``/health`` answers 503), after
``--stall-timeout`` it is killed and the pipeline restarted like after a crash. The HTTP
gateway (``GatewayProcess``) lives beside the generations: restarted alone when it dies, never
with the pipeline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Callable

import zmq

from ntx.ctl.restart_policy import FILE_CHECK_INTERVAL_S, STALL_REPORT_S, ModelFiles, RestartPolicy
from ntx.daemons.compute.threads import bound_blas_threads
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig, InstancePaths
from ntx.shared.plan import STORAGE, Plan
from ntx.shared.run_files import hand_over_secret, open_private, write_private
from ntx.shared.shm import unlink_all

# A send to a daemon waits at most this long for room in its pipe (the compute window keeps it
# far from full, so a wait this long means the daemon is stuck): then the pipeline has failed.
CONTROL_SEND_TIMEOUT_S = 30.0
GATEWAY_MIN_RUN_S = 5.0  # a gateway that dies sooner cannot start at all; it is not restarted


@dataclass
class DaemonProc:
    name: str
    proc: subprocess.Popen
    started_s: float
    state: str = "spawned"  # spawned -> configured -> ready (<-> stalled: no Stats for STALL_REPORT_S)
    ready: m.Ready = field(default_factory=m.Ready)  # what its Ready handed on
    heard_s: float = 0.0  # monotonic time of its Ready or last Stats: the age liveness measures
    longest_step_s: float = 0.0  # its loop's longest step so far (compute: a pass), from its Stats

    def silent_s(self, now_s: float) -> float:
        """Seconds since the daemon last said anything its loop sends (Ready, Stats)."""
        return now_s - self.heard_s

    def stall_after_s(self, bound_s: float) -> float:
        """How long a silence means stalled: ``bound_s``, or longer where the daemon's own steps
        are long (a CPU backend's pass over a big model sends nothing while it runs)."""
        return max(bound_s, 2 * self.longest_step_s + m.STATS_INTERVAL_S)


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Generations:
    """The instance's life: its ``state`` (starting → ready; stalled while a ready daemon is
    silent; restarting after a failure; stopping → stopped or failed, with a ``reason``), the
    current generation's daemons and their last ``Stats``, and the control socket they talk on.

    The roles around it are told through two callbacks: ``on_ready()`` when the pipeline can
    take requests, ``fail_requests(code, message)`` when every request in flight must end with
    an error because compute has gone or is going. ``done`` is set once the instance stopped."""

    def __init__(self, cfg: InstanceConfig, plan: Plan, paths: InstancePaths, control: zmq.Socket,
                 say: Callable[[str], None], daemon_logs: dict[str, IO], on_ready: Callable[[], None],
                 fail_requests: Callable[[str, str], None]) -> None:
        self.cfg = cfg
        self.plan = plan
        self.paths = paths
        self.control = control
        self.say = say
        self.daemon_logs = daemon_logs
        self.on_ready = on_ready
        self.fail_requests = fail_requests
        self.order = daemon_order(plan)
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
        self.done = False

    def write_state(self) -> None:
        tmp = self.paths.state_file.with_suffix(".tmp")
        write_private(tmp, json.dumps({"state": self.state, "reason": self.reason, "gen": self.gen, "pid": os.getpid()}))
        os.replace(tmp, self.paths.state_file)

    @property
    def compute_ready(self) -> bool:
        """Whether compute takes requests now (the pipeline is up and not stopping)."""
        return self.state == "ready"

    # -- bring-up ---------------------------------------------------------------------------
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

    def on_message(self, ident: bytes, frame: bytes) -> m.Message | None:
        """A frame from a daemon (identity ``<name>-g<gen>``): the handshake and its stats are
        handled here; any other message of the current generation is returned for the
        supervisor to route. A frame of a generation already torn down is dropped."""
        name, _, gen = ident.decode(errors="replace").rpartition("-g")
        if not gen.isdigit() or int(gen) != self.gen or name not in self.daemons:
            return None
        msg = m.DAEMON_TO_SUPERVISOR.decode(frame)
        d = self.daemons[name]
        if isinstance(msg, m.Hello):
            self.control.send_multipart([ident, self.config_for(name).encode()])
            d.state = "configured"
        elif isinstance(msg, m.Ready):
            d.state = "ready"
            d.ready = msg
            d.heard_s = time.monotonic()
            self.say(f"gen {self.gen}: {name} ready")
            nxt = self.order.index(name) + 1
            if nxt < len(self.order):
                self.spawn(self.order[nxt])
            else:
                self.state = "ready"
                self.ever_ready = True
                self.write_state()
                self.on_ready()
        elif isinstance(msg, m.Fatal):
            self.pipeline_failed(msg.message)
        elif isinstance(msg, m.Stats):
            self.stage_stats[name] = msg.stats
            d.heard_s = time.monotonic()
            d.longest_step_s = float(msg.stats.get("longest_step_s") or 0.0)
            if d.state == "stalled":
                self.stall_ended(d)
        else:
            return msg
        return None

    def send_compute(self, msg: m.Message) -> bool:
        """Send to this generation's compute; a failure to deliver fails the pipeline (False)."""
        try:
            self.control.send_multipart([f"compute-g{self.gen}".encode(), msg.encode()])
            return True
        except zmq.ZMQError as e:
            why = "is not connected" if e.errno == zmq.EHOSTUNREACH else f"took no message for {CONTROL_SEND_TIMEOUT_S:.0f} s"
            self.pipeline_failed(f"compute daemon {why}")
            return False

    # -- failure, restart, stop ------------------------------------------------------------
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

    def pipeline_failed(self, reason: str) -> None:
        self.say(f"gen {self.gen}: {reason}")
        if self.state == "stopping":
            return
        if not self.ever_ready:
            # A daemon that cannot start (bad model, no GPU, no memory) will not start on retry.
            self.reason = reason
            self.fail_requests("pipeline_failure", reason)
            self.shutdown()
            return
        delay_s = self.restart_policy.after_failure(time.monotonic())
        self.fail_requests("pipeline_failure", f"{reason}; the pipeline is restarting")
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

    # -- liveness --------------------------------------------------------------------------
    @property
    def stalled(self) -> list[str]:
        """The daemons of this generation that are ready but silent (stalled), in bring-up order."""
        return [n for n, d in self.daemons.items() if d.state == "stalled"]

    def check_liveness(self, now_s: float) -> bool:
        """Report a ready daemon silent for ``STALL_REPORT_S`` as stalled (and the instance, when
        it was ready); fail the pipeline (True) when one has been silent for ``--stall-timeout``.
        Its own loop sends ``Stats`` every ``STATS_INTERVAL_S`` whatever it does, ring waits
        included, so silence means that loop is not running."""
        for d in self.daemons.values():
            if d.state not in ("ready", "stalled"):
                continue
            silent_s = d.silent_s(now_s)
            if silent_s > d.stall_after_s(self.cfg.stall_timeout):
                d.proc.kill()  # a stopped (SIGSTOP) or wedged process may not heed SIGTERM
                self.pipeline_failed(f"{d.name} daemon (pid {d.proc.pid}) sent no stats for {silent_s:.1f} s "
                                     f"(stalled; --stall-timeout {self.cfg.stall_timeout:g}); killed it")
                return True
            if silent_s > d.stall_after_s(STALL_REPORT_S) and d.state == "ready":
                d.state = "stalled"
                self.say(f"gen {self.gen}: {d.name} daemon (pid {d.proc.pid}) stalled: no stats for {silent_s:.1f} s")
                if self.state == "ready":
                    self.state = "stalled"
                    self.write_state()
        return False

    def stall_ended(self, d: DaemonProc) -> None:
        """``d`` spoke again: ready, and the instance too once no daemon is stalled."""
        d.state = "ready"
        self.say(f"gen {self.gen}: {d.name} daemon is sending stats again")
        if self.state == "stalled" and not self.stalled:
            self.state = "ready"
            self.write_state()
            self.on_ready()

    def model_changed(self, change: str) -> None:
        """Stop for good: the daemons would read another file than the one the plan was made for."""
        self.say(change)
        self.reason = f"{change}; stopped (start the instance again to serve the new file)"
        self.fail_requests("model_changed", self.reason)
        self.shutdown()

    def shutdown(self) -> None:
        self.state = "stopping"
        self.teardown_daemons()
        self.state = "failed" if self.reason else "stopped"
        self.done = True

    def watch(self) -> None:
        """Notice a dead daemon at once, a handshake that takes too long, a stalled daemon
        (``check_liveness``), a changed model file within ``FILE_CHECK_INTERVAL_S`` (and before
        every restart); restart when the back-off has passed."""
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
                self.pipeline_failed(f"{d.name} daemon (pid {d.proc.pid}) {exit_description(code)}")
                return
            if d.state in ("spawned", "configured") and time.monotonic() - d.started_s > self.cfg.timeout:
                self.pipeline_failed(f"{d.name} daemon was not ready within {self.cfg.timeout:.0f} s")
                return
        self.check_liveness(time.monotonic())


def daemon_order(plan: Plan) -> list[str]:
    """The daemons a plan needs, in bring-up order: compute (it makes the device slots), dma when
    a layer streams (it opens them, makes the host slots), the reader when a layer is on storage
    (it opens the host slots)."""
    order = ["compute"]
    if plan.streamed_layers:
        order.append("dma")
    if plan.layers_on(STORAGE):
        order.append("reader")
    return order


class GatewayProcess:
    """The HTTP gateway (``ntx.ctl.gateway``, with ``--http``): a plain protocol client of the
    supervisor, spawned beside the pipeline and restarted when it dies after running a while
    (one that dies sooner cannot start: a port taken; retrying will not help). Its API key goes by
    a file it takes (reads once and deletes): ``--api-key-file``, never its environment."""

    def __init__(self, cfg: InstanceConfig, paths: InstancePaths, foreground: bool, say: Callable[[str], None],
                 api_key: str | None = None) -> None:
        self.cfg = cfg
        self.paths = paths
        self.foreground = foreground
        self.say = say
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0

    @property
    def running(self) -> bool:
        return self.proc is not None

    def command(self) -> list[str]:
        """The gateway's command line; with a key, the key handed over in its file first."""
        argv = [sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", self.cfg.listen, "--http", self.cfg.http,
                "--log-level", self.cfg.log_level]
        if self.api_key:
            key_file = self.paths.secret_file("gateway")
            hand_over_secret(key_file, self.api_key)
            argv += ["--api-key-file", str(key_file)]
        return argv

    def spawn(self) -> None:
        logf = sys.stderr if self.foreground else open_private(self.paths.log_dir / "gateway.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
        if not self.foreground:
            logf.close()
        self.started_s = time.monotonic()
        self.say(f"started the HTTP gateway on {self.cfg.http} (pid {self.proc.pid})")

    def watch(self) -> None:
        code = self.proc.poll() if self.proc else None
        if code is None:
            return
        ran_s = time.monotonic() - self.started_s
        if ran_s < GATEWAY_MIN_RUN_S:
            self.say(f"the HTTP gateway {exit_description(code)} after {ran_s:.1f} s; not restarting it "
                     f"(its reason: {self.paths.log_dir / 'gateway.log'})")
            self.proc = None
            return
        self.say(f"the HTTP gateway {exit_description(code)}; restarting it")
        self.spawn()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
