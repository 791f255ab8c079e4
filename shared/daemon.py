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
    supervisor's ``Config``, return the ``Ready`` record to send) and ``serve`` (the main loop,
    which checks ``self.stopping``). The generation only names the control socket's identity
    (``<name>-g<gen>``): the supervisor ignores a torn-down generation's messages by it."""

    name = "daemon"

    def __init__(self, control_addr: str, gen: int) -> None:
        self.stopping = False
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, f"{self.name}-g{gen}".encode())
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.connect(control_addr)
        self._last_stats_s = 0.0

    # -- control channel ---------------------------------------------------------------------
    def send_control(self, msg: m.Message) -> None:
        self.control.send(msg.encode())

    def handshake(self, timeout_s: float = 30.0) -> m.Config:
        self.send_control(m.Hello())
        if not self.control.poll(int(timeout_s * 1000)):
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
                self.stopping = True
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

    def close(self) -> None:
        """Release what this daemon holds (segments it created are unlinked by their owner)."""

    def run(self) -> int:
        try:
            config = self.handshake()
            self.send_control(self.setup(config))
            self.serve()
            return 0
        except NtxError as e:
            self.send_control(m.Fatal(message=str(e)))
            print(f"{self.name}: {e}", file=sys.stderr, flush=True)
            return 2
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
            self.send_control(m.Fatal(message=f"{self.name} crashed: {last}"))
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
