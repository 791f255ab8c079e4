"""One cluster replica: an ntx instance (``ntxctl serve``, its supervisor a child of the replica's
process) and the replica's methods the ingress calls through Ray (``generate``, ``status``) and
Ray Serve's health check. ``app.py`` makes it a Serve deployment; this module imports no Ray.

The instance is an ordinary named instance with a run folder, a free loopback port and logs
(``ntxctl status --name NAME`` on its node works), started in the foreground mode so that it is
the replica process' child: it gets SIGTERM when the replica's process dies, even by kill -9
(the daemons' own ``die_with_parent``), and an instance left by a replica that died before is
stopped when the replica restarts. The replica reads its instance through the gateway's own
ZeroMQ link (``PipelineLink``: one connection, replies sorted per request, status once a
second), and its health is what the gateway's ``/health`` answers for that status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import AsyncIterator, Sequence

from ntx.ctl import instance
from ntx.ctl.gateway.app import health_of
from ntx.ctl.gateway.limits import REPLY_TIMEOUT_S
from ntx.ctl.gateway.link import FrameRefused, PipelineGone, PipelineLink
from ntx.shared.config import InstancePaths
from ntx.shared.daemon import die_with_parent
from ntx.shared.run_files import open_private, private_dir

START_TIMEOUT_S = 600.0  # an instance not ready by then fails the replica's start (Ray retries it)
NOT_READY_LIMIT_S = 120.0  # an instance not ready for this long (it restarts, or cannot) fails the health check
STOP_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instance_process_setup() -> None:
    """In the instance's process before it runs: the signals Ray's worker thread blocks or
    ignores (a child inherits both) are delivered again, and the replica's death is SIGTERM."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent()


class NtxReplica:
    """One replica's instance and what the ingress asks of it (module docstring)."""

    def __init__(self, model: str, name: str, backend: str = "cpu", instance_args: Sequence[str] = (),
                 run_dir: str | None = None) -> None:
        """Start instance ``name`` of ``model`` on ``backend`` (``instance_args``: more of
        ``ntxctl start``'s options) and wait until it is ready. ``run_dir``: its NTX_RUN_DIR."""
        if run_dir:
            os.environ["NTX_RUN_DIR"] = run_dir  # this process' instance functions and the instance's
        self.name = name
        self.paths = InstancePaths(name)
        if instance.supervisor_pid(self.paths) is not None:  # this replica's previous life left it running
            instance.stop(name, force=True)
        self.listen = f"tcp://127.0.0.1:{_free_port()}"
        private_dir(self.paths.log_dir)
        self.log_file = self.paths.log_dir / "replica.out"
        with open_private(self.log_file, "ab") as log:
            # Started from this thread (the replica's own, alive as long as it is): the parent-death
            # signal follows the thread that forked.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ntx.ctl.cli", "serve", "--model", model, "--name", name, "--backend", backend,
                 "--listen", self.listen, *instance_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_instance_process_setup)
        self.started_s = time.monotonic()
        self.link: PipelineLink | None = None
        self.not_ready_since_s: float | None = None
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"instance {self.name} exited with status {self.proc.returncode} while starting: "
                                   f"{self._log_tail()}")
            st = instance.get_status(self.name, timeout_s=1.0)
            if st is not None and st.get("state") == "ready":
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"instance {self.name} was not ready within {START_TIMEOUT_S:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) + f" (log: {self.log_file})"

    async def _ensure_link(self) -> PipelineLink:
        """The link to the instance, made in the replica's event loop on first use."""
        if self.link is None:
            self.link = PipelineLink(self.listen, REPLY_TIMEOUT_S)
            self.link.start()
        return self.link

    async def generate(self, wire: dict) -> AsyncIterator[list[dict]]:
        """The instance's replies to one ``generate`` request (``wire``: the gateway's map), in
        lists: each holds the replies that had arrived when the last was sent, so a busy
        replica sends fewer Ray messages (one reply each while the caller keeps up).
        Cancelling the caller's stream ends this generator, which cancels the request."""
        link = await self._ensure_link()
        try:
            stream = link.submit(wire)
        except PipelineGone as e:
            yield [{"type": "error", "code": "pipeline_lost", "message": f"replica {self.name}: {e}"}]
            return
        except FrameRefused as e:  # the ingress checks frames first: not reached
            yield [{"type": "error", "code": "bad_frame", "message": str(e)}]
            return
        replies = aiter(stream)
        try:
            async for ev in replies:
                batch = [ev]
                while not stream.finished and not stream.queue.empty():
                    batch.append(await anext(replies))
                yield batch
        finally:
            stream.cancel()
            link.forget(stream)

    async def status(self) -> dict:
        """The instance's status (None while it does not answer), where this replica runs and
        its instance's ZeroMQ address (loopback: an ingress on the same node reads the replies
        there itself, ``link.ClusterLink``)."""
        link = await self._ensure_link()
        return {"instance": self.name, "node": socket.gethostname(), "pid": os.getpid(), "listen": self.listen,
                "instance_running": self.proc.poll() is None, "status": link.fresh_status}

    async def check_health(self) -> None:
        """Ray Serve's health check: the instance's process must run, and its status (the
        gateway's /health rule) be ready, or have been ready within ``NOT_READY_LIMIT_S`` (its
        supervisor restarts a failed pipeline by itself). Raising makes Serve restart this
        replica, and with it the instance."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"instance {self.name} exited with status {self.proc.returncode}: {self._log_tail()}")
        link = await self._ensure_link()
        code, body = health_of(link.fresh_status)
        now = time.monotonic()
        if code == 200:
            self.not_ready_since_s = None
            return
        if self.not_ready_since_s is None:
            self.not_ready_since_s = now
        if now - self.not_ready_since_s > NOT_READY_LIMIT_S:
            raise RuntimeError(f"instance {self.name} not ready for {now - self.not_ready_since_s:.0f} s: {body}")

    def stop(self) -> None:
        """Stop the instance (gracefully, then by force); its run folder is cleaned up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # ntxctl serve's Ctrl-C: requests in flight are cancelled
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        instance.cleanup_leftovers(self.paths)

    def __del__(self) -> None:  # Ray Serve calls it when the replica is removed
        if getattr(self, "proc", None) is not None:
            self.stop()
