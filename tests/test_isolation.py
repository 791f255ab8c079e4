"""The tests leave a user's instances alone (tests/conftest.py): the test run holds the default
client address as a user's default instance would, counts who connects there, and keeps every
instance's run folder under the test run's own."""

from __future__ import annotations

import os
import socket

from ntx.shared.config import DEFAULT_LISTEN, run_root

from .conftest import DefaultPortWatch
from .pipeline_util import free_port, wait_for


def test_the_default_address_is_taken_while_the_tests_run():
    host, _, port = DEFAULT_LISTEN[len("tcp://"):].rpartition(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return  # taken: by this run's watch, or by an instance the user runs
        raise AssertionError(f"{DEFAULT_LISTEN} was free during the test run")


def test_the_watch_counts_a_connection_to_the_address_it_holds():
    port = free_port()
    watch = DefaultPortWatch(f"tcp://127.0.0.1:{port}")
    try:
        assert watch.sock is not None
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        wait_for(lambda: watch.connections == 1, 5.0, lambda: f"one connection counted, not {watch.connections}")
    finally:
        watch.close()


def test_the_run_folder_is_the_test_runs_own():
    assert os.environ["NTX_RUN_DIR"] and not str(run_root()).startswith(f"/tmp/ntx-{os.getuid()}")
    assert "NTX_LISTEN" not in os.environ and "NTX_NAME" not in os.environ
