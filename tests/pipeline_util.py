"""Helpers for tests that run the real daemon pipeline (real processes, shm, sockets, files), and
the two every test that talks to a process needs: a free port and a poll for a condition."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

from ntx.ctl import instance
from ntx.ctl.client import Client


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
             interval_s: float = 0.05) -> T:
    """Call ``predicate`` until it returns something truthy and return that; after ``timeout_s``
    raise an AssertionError naming ``what`` was awaited (a callable is asked then, to describe the
    last state seen).

    Tests wait for the condition itself rather than sleeping a guessed time: the typical wait is
    as short as the machine allows, and the timeout can be generous for a busy CI machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what() if callable(what) else what}")
        time.sleep(interval_s)


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel picks it, so concurrent
    test runs get different ones), and that this process has not handed out before: two calls
    in a row (an instance's ZeroMQ port, then its HTTP port) once got the same port from the
    kernel, and the gateway could not bind it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def own_instance(name: str) -> list[str]:
    """``--name NAME --listen`` a free port: the options that keep a start, plan-only ones too,
    off the default instance a user may be running (its name and port 5555)."""
    return ["--name", name, "--listen", f"tcp://127.0.0.1:{free_port()}"]


def ntxctl(*args: str, env: dict | None = None, timeout: float = 240.0, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, input=input,
    )


def chat_interrupted(*args: str, env: dict | None = None, after_interrupt: Callable[[], object] = lambda: None
                     ) -> tuple[int, bytes]:
    """``ntxctl chat ARGS`` asked for a long story, Ctrl-C once the reply is being written, then
    (after ``after_interrupt()``) /exit: its exit status and stderr. The story is greedy: the
    model's greedy story runs past 400 tokens, where a sampled one once ended after 24."""
    proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.cli", "chat", "--max-tokens", "3000", "--temperature", "0",
                             *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    try:
        proc.stdin.write(b"Tell me a very long story.\n")
        proc.stdin.flush()
        out = b""
        deadline = time.monotonic() + 120
        while len(out.strip()) < 8 and time.monotonic() < deadline:  # the prompt, then the reply
            if select.select([proc.stdout], [], [], 1.0)[0]:
                out += os.read(proc.stdout.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        after_interrupt()
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


class Pipeline:
    def __init__(self, name: str, listen: str, run_dir: Path) -> None:
        self.name = name
        self.listen = listen
        self.run_dir = run_dir

    def client(self) -> Client:
        return Client(self.listen, event_timeout_s=180.0)

    def status(self) -> dict:
        st = instance.get_status(self.name, timeout_s=10.0)
        assert st is not None, "supervisor does not answer"
        return st

    def wait_status(self, holds: Callable[[dict], bool], what: str, timeout_s: float = 120.0) -> dict:
        """Poll the supervisor's status until ``holds(status)``; return that status."""
        last: list[dict | None] = [None]

        def satisfied() -> dict | None:
            last[0] = st = instance.get_status(self.name, timeout_s=2.0)
            return st if st is not None and holds(st) else None

        return wait_for(satisfied, timeout_s, lambda: f"{what}; last status: {last[0]}")

    def wait_stages_moved_bytes(self, stages: tuple[str, ...] = ("reader", "dma", "compute"),
                                timeout_s: float = 60.0) -> dict:
        """The status once each of ``stages`` has reported bytes moved: daemons send their clocks
        every stats interval, so right after a request the supervisor may not have them yet."""
        return self.wait_status(
            lambda st: all(st["stages"].get(s, {}).get("total", {}).get("bytes", 0) > 0 for s in stages),
            f"stages {', '.join(stages)} to report bytes moved", timeout_s)

    def wait_state(self, state: str, timeout_s: float = 120.0, min_gen: int = 0) -> dict:
        return self.wait_status(lambda st: st["state"] == state and st["gen"] >= min_gen,
                                f"pipeline state {state!r} (gen >= {min_gen})", timeout_s)

    def generate_greedy(self, prompt: str, max_tokens: int = 8, **kw) -> dict:
        with self.client() as c:
            return c.complete(prompt, raw=True, temperature=0.0, max_tokens=max_tokens, **kw)


@contextmanager
def running_pipeline(model: str, run_dir: Path, *args: str, name: str = "t", backend: str = "cpu",
                     listen: str | None = None):
    """Start an instance with ``ntxctl start`` (a real detached supervisor); always stop it.
    It listens on ``listen`` (default: a free loopback port).

    ``run_dir`` becomes ``NTX_RUN_DIR`` while the instance runs: a folder of this test run, so that
    concurrent test runs on one machine never see each other's instances."""
    old_run_dir = os.environ.get("NTX_RUN_DIR")
    os.environ["NTX_RUN_DIR"] = str(run_dir)
    listen = listen or f"tcp://127.0.0.1:{free_port()}"
    r = ntxctl("start", "--model", model, "--name", name, "--backend", backend, "--listen", listen, *args)
    assert r.returncode == 0, f"start failed: {r.stdout}\n{r.stderr}"
    p = Pipeline(name, listen, run_dir)
    try:
        yield p
    finally:
        ntxctl("stop", "--name", name, "--force")
        left = instance.leftovers(name)
        if old_run_dir is None:
            os.environ.pop("NTX_RUN_DIR", None)
        else:
            os.environ["NTX_RUN_DIR"] = old_run_dir
        assert not left, f"left behind after stop: {left}"
