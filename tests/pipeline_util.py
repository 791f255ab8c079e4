"""Helpers for tests that run the real daemon pipeline (real processes, shm, sockets, files)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ntx.ctl import instance
from ntx.ctl.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ntxctl(*args: str, env: dict | None = None, timeout: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


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

    def wait_state(self, state: str, timeout_s: float = 120.0, min_gen: int = 0) -> dict:
        deadline = time.monotonic() + timeout_s
        st = None
        while time.monotonic() < deadline:
            st = instance.get_status(self.name, timeout_s=2.0)
            if st and st["state"] == state and st["gen"] >= min_gen:
                return st
            time.sleep(0.1)
        raise AssertionError(f"pipeline did not reach {state!r} (gen >= {min_gen}) in {timeout_s} s; last status: {st}")

    def generate_greedy(self, prompt: str, max_tokens: int = 8, **kw) -> dict:
        with self.client() as c:
            return c.complete(prompt, raw=True, temperature=0.0, max_tokens=max_tokens, **kw)


@contextmanager
def running_pipeline(model: str, run_dir: Path, *args: str, name: str = "t", backend: str = "cpu"):
    """Start an instance with ``ntxctl start`` (a real detached supervisor); always stop it."""
    os.environ["NTX_RUN_DIR"] = str(run_dir)
    listen = f"tcp://127.0.0.1:{free_port()}"
    r = ntxctl("start", "--model", model, "--name", name, "--backend", backend, "--listen", listen, *args)
    assert r.returncode == 0, f"start failed: {r.stdout}\n{r.stderr}"
    p = Pipeline(name, listen, run_dir)
    try:
        yield p
    finally:
        ntxctl("stop", "--name", name, "--force")
        left = instance.leftovers(name)
        assert not left, f"left behind after stop: {left}"
