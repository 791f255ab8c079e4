"""What every daemon does the same way: its entry point, its control channel, its handshake.

One shape for all three (a lesson from vLLM's process wrappers): set the process title, enable
faulthandler, die with the parent (the supervisor), turn SIGTERM/SIGINT into a shutdown flag,
talk to the supervisor over one DEALER socket (hello → config → ready | fatal, then stats), and
report a fatal error to the supervisor before exiting, so ``ntxctl start`` can print the
daemon's own one-line reason instead of hanging.

Dying with the supervisor takes two things: a parent-death signal (``PR_SET_PDEATHSIG``: the
kernel sends SIGTERM when the supervisor exits, however it exits) and no wait that ignores it.
A ZeroMQ send to a peer that is gone blocks for ever, and a signal handler only sets a flag, so
every wait of a daemon is cut into slices of ``WAIT_SLICE_S`` and asks ``stopping`` between
them; ``stopping`` also compares the parent pid with the supervisor's, which covers a
supervisor that died before the signal was armed. A wait that must give up raises
``StopRequested``, which ends the daemon cleanly (its ``close`` unlinks what it created).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from ntx.shared import messages as m
from ntx.shared.errors import NtxError

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1

WAIT_SLICE_S = 0.2
"""The longest a daemon waits (for room to send, for a message) before it checks whether it
must stop: how long a dead supervisor's daemons outlive it, at most, plus their teardown."""


class StopRequested(Exception):
    """A wait gave up because the daemon must stop (Shutdown, SIGTERM, or its supervisor is
    gone). Not an NtxError on purpose: nothing that fails one request may catch it."""


def send_patiently(sock: zmq.Socket, frame: bytes, between: Callable[[], None]) -> None:
    """Send ``frame`` on ``sock``, waiting as long as it takes for room (back-pressure, never a
    drop), but in slices of ``WAIT_SLICE_S`` with ``between()`` called after each: it raises
    (``StopRequested``) to give up. A plain blocking send to a peer that died never returns."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        between()
        sock.poll(int(WAIT_SLICE_S * 1000), zmq.POLLOUT)


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """What ps -o comm and top show (15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


class Daemon:
    """Base of the reader, dma and compute daemons. Subclasses implement ``setup`` (given the
    supervisor's ``Config``, return the ``Ready`` record to send) and ``serve`` (the main loop,
    which checks ``self.stopping``). The generation only names the control socket's identity
    (``<name>-g<gen>``): the supervisor ignores a torn-down generation's messages by it.
    Sends go through ``send`` (or ``send_patiently`` with ``check_stop``), never a blocking
    ``sock.send``, so that no wait outlives the supervisor."""

    name = "daemon"

    def __init__(self, control_addr: str, gen: int, supervisor_pid: int | None = None) -> None:
        self.stop_requested = False  # a Shutdown message or SIGTERM (the supervisor's death, too)
        self.gen = gen
        self.supervisor_pid = supervisor_pid if supervisor_pid is not None else os.getppid()
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, f"{self.name}-g{gen}".encode())
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.connect(control_addr)
        self._last_stats_s = 0.0

    # -- stopping ------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """Whether to stop now: asked to, or the supervisor is gone (reparented away from it)."""
        return self.stop_requested or os.getppid() != self.supervisor_pid

    def check_stop(self) -> None:
        """Between the slices of a wait: give up (``StopRequested``) once the daemon must stop."""
        if self.stopping:
            raise StopRequested(f"{self.name}: stopping" if self.stop_requested
                                else f"{self.name}: the supervisor (pid {self.supervisor_pid}) is gone")

    def send(self, sock: zmq.Socket, msg: m.Message) -> None:
        """Send on a ring or the control socket; waits for room, never past a stop."""
        send_patiently(sock, msg.encode(), self.check_stop)

    # -- control channel ---------------------------------------------------------------------
    def send_control(self, msg: m.Message) -> None:
        self.send(self.control, msg)

    def handshake(self, timeout_s: float = 30.0) -> m.Config:
        self.send_control(m.Hello())
        deadline_s = time.monotonic() + timeout_s
        while not self.control.poll(int(WAIT_SLICE_S * 1000)):
            self.check_stop()
            if time.monotonic() > deadline_s:
                raise NtxError(f"{self.name}: no configuration from the supervisor within {timeout_s:.0f} s")
        msg = m.SUPERVISOR_TO_DAEMON.decode(self.control.recv())
        if not isinstance(msg, m.Config):
            raise NtxError(f"{self.name}: expected config from the supervisor, got {msg.T!r}")
        return msg

    def handle_control(self, msg: m.Message) -> None:
        """Control messages other than shutdown; compute overrides this for requests."""

    def poll_control(self) -> None:
        while self.control.poll(0):
            msg = m.SUPERVISOR_TO_DAEMON.decode(self.control.recv())
            if isinstance(msg, m.Shutdown):
                self.stop_requested = True
            else:
                self.handle_control(msg)

    def maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_stats_s >= m.STATS_INTERVAL_S:
            self._last_stats_s = now
            self.send_control(m.Stats(stats=self.stats()))

    def stats(self) -> dict[str, Any]:
        return {}

    # -- life cycle --------------------------------------------------------------------------
    def setup(self, config: m.Config) -> m.Ready:
        raise NotImplementedError

    def serve(self) -> None:
        raise NotImplementedError

    def ready_note(self) -> str:
        """Words for the ready line on what the setup's time went to (compute: its warm-up)."""
        return ""

    def close(self) -> None:
        """Release what this daemon holds (segments it created are unlinked by their owner)."""

    def run(self) -> int:
        try:
            config = self.handshake()
            t0 = time.monotonic()
            ready = self.setup(config)
            self.say(f"gen {self.gen}: ready after {time.monotonic() - t0:.2f} s of setup{self.ready_note()}")
            self.send_control(ready)
            self.serve()
            self.say(f"gen {self.gen}: stopped")
            return 0
        except StopRequested as e:
            print(e, file=sys.stderr, flush=True)
            return 0
        except NtxError as e:
            self._last_word(m.Fatal(message=str(e)))
            print(f"{self.name}: {e}", file=sys.stderr, flush=True)
            return 2
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
            self._last_word(m.Fatal(message=f"{self.name} crashed: {last}"))
            traceback.print_exc()
            return 3
        finally:
            try:
                self.close()
            finally:
                self.control.close(linger=500)

    def say(self, text: str) -> None:
        """A line in this daemon's log (its stdout: the supervisor's ``NAME.log``), so that a
        healthy run's log shows when the daemon was ready and when it stopped."""
        print(f"{time.strftime('%H:%M:%S')} {self.name} (pid {os.getpid()}): {text}", flush=True)

    def _last_word(self, msg: m.Message) -> None:
        """Tell the supervisor why this daemon ends, if it still listens."""
        try:
            self.send_control(msg)
        except StopRequested:
            pass


def die_with_parent() -> None:
    """SIGTERM this process when its parent (the supervisor) dies, even by kill -9."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def daemon_main(cls: type[Daemon], argv: list[str] | None = None) -> None:
    """The entry point of ``python -m ntx.daemons.<name>``."""
    ap = argparse.ArgumentParser(prog=f"ntx-{cls.name}")
    ap.add_argument("--control", required=True, help="supervisor's control socket address")
    ap.add_argument("--gen", type=int, default=0, help="pipeline generation (bumped on restart)")
    ap.add_argument("--supervisor-pid", type=int, default=None,
                    help="the supervisor's pid: the daemon stops once it is no longer its parent")
    args = ap.parse_args(argv)
    set_process_name(f"ntx-{cls.name}")
    die_with_parent()  # armed now: a supervisor dead before is the pid check's
    faulthandler.enable()
    daemon = cls(args.control, args.gen, args.supervisor_pid)

    def on_signal(signum, frame):  # noqa: ARG001
        daemon.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sys.exit(daemon.run())
