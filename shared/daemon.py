"""What every daemon does the same way: its entry point, its control channel, its handshake.

One shape for all three (a lesson from vLLM's process wrappers): set the process title, enable
faulthandler, die with the parent (the supervisor), turn SIGTERM/SIGINT into a shutdown flag,
talk to the supervisor over one DEALER socket (hello → config → ready | fatal, then stats), and
report a fatal error to the supervisor before exiting, so ``ntxctl start`` can print the
daemon's own one-line reason instead of hanging.
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
from typing import Any

import zmq

from ntx.shared import messages as m
from ntx.shared.errors import NtxError

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


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
    supervisor's config, return what ``ready`` reports) and ``serve`` (the main loop, which
    checks ``self.stopping``)."""

    name = "daemon"

    def __init__(self, control_addr: str, gen: int) -> None:
        self.gen = gen
        self.stopping = False
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, f"{self.name}-g{gen}".encode())
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.connect(control_addr)
        self._last_stats_s = 0.0

    # -- control channel ---------------------------------------------------------------------
    def send_control(self, msg: dict[str, Any]) -> None:
        self.control.send(m.pack(msg))

    def handshake(self, timeout_s: float = 30.0) -> dict[str, Any]:
        self.send_control({"t": m.HELLO, "name": self.name, "pid": os.getpid(), "gen": self.gen})
        if not self.control.poll(int(timeout_s * 1000)):
            raise NtxError(f"{self.name}: no configuration from the supervisor within {timeout_s:.0f} s")
        msg = m.unpack(self.control.recv())
        if msg.get("t") != m.CONFIG:
            raise NtxError(f"{self.name}: expected config from the supervisor, got {msg.get('t')!r}")
        return msg

    def handle_control(self, msg: dict[str, Any]) -> None:
        """Control messages other than shutdown; compute overrides this for requests."""

    def poll_control(self) -> None:
        while self.control.poll(0):
            msg = m.unpack(self.control.recv())
            if msg.get("t") == m.SHUTDOWN:
                self.stopping = True
            else:
                self.handle_control(msg)

    def maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_stats_s >= m.STATS_INTERVAL_S:
            self._last_stats_s = now
            self.send_control({"t": m.STATS, "name": self.name, "pid": os.getpid(), "stats": self.stats()})

    def stats(self) -> dict[str, Any]:
        return {}

    # -- life cycle --------------------------------------------------------------------------
    def setup(self, config: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def serve(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what this daemon holds (segments it created are unlinked by their owner)."""

    def run(self) -> int:
        try:
            config = self.handshake()
            ready = self.setup(config)
            self.send_control({"t": m.READY, "name": self.name, "pid": os.getpid(), **ready})
            self.serve()
            return 0
        except NtxError as e:
            self.send_control({"t": m.FATAL, "name": self.name, "message": str(e)})
            print(f"{self.name}: {e}", file=sys.stderr, flush=True)
            return 2
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
            self.send_control({"t": m.FATAL, "name": self.name, "message": f"{self.name} crashed: {last}"})
            traceback.print_exc()
            return 3
        finally:
            try:
                self.close()
            finally:
                self.control.close(linger=500)


def daemon_main(cls: type[Daemon], argv: list[str] | None = None) -> None:
    """The entry point of ``python -m ntx.daemons.<name>``."""
    ap = argparse.ArgumentParser(prog=f"ntx-{cls.name}")
    ap.add_argument("--control", required=True, help="supervisor's control socket address")
    ap.add_argument("--gen", type=int, default=0, help="pipeline generation (bumped on restart)")
    args = ap.parse_args(argv)
    set_process_name(f"ntx-{cls.name}")
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    faulthandler.enable()
    daemon = cls(args.control, args.gen)

    def on_signal(signum, frame):  # noqa: ARG001
        daemon.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sys.exit(daemon.run())
