"""How an instance's processes live and die (issue 12, items 6, 10, 11, 12): a killed supervisor
takes its daemons and its shared memory with it and its clients hear of it; a model file changed
under the pipeline stops it with the reason; restarts back off; two instances of one name under
two run folders leave each other alone; the run folder is private and its files are opened
without following links."""

from __future__ import annotations

import os
import signal
import stat
import time

import psutil
import pytest

from ntx.ctl import instance
from ntx.ctl.client import ClientError
from ntx.shared.config import InstancePaths
from ntx.shared.shm import ShmSegment, list_segments

from .pipeline_util import Pipeline, free_port, ntxctl, running_pipeline, wait_for


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_supervisor_death_takes_its_daemons_and_fails_the_waiting_client(smollm2_path, tmp_path):
    """kill -9 of the supervisor mid-generation: the client's wait ends with ``pipeline_lost``
    within seconds, every daemon exits within seconds (compute was blocked in a ring send or a
    ring wait before), and the daemons unlink their own shared memory on the way out."""
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "0", "--ram-budget", "0", name="orphan") as p:
        st = p.status()
        daemon_pids = [d["pid"] for d in st["daemons"].values()]
        assert len(daemon_pids) == 3
        prefix = InstancePaths("orphan").shm_prefix
        assert list_segments(prefix)
        with p.client() as c:
            rid = c.submit("Once upon a time", raw=True, temperature=0.0, max_tokens=2000)
            assert c.next_event(rid, 120)["type"] == "token"  # it is generating
            os.kill(st["supervisor_pid"], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(ClientError) as err:
                for _ in c.events(rid):
                    pass
            assert err.value.code == "pipeline_lost", err.value
            assert time.monotonic() - t0 < 10.0
        wait_for(lambda: not any(_alive(pid) for pid in daemon_pids), 10.0,
                 lambda: f"the daemons to exit; alive: {[pid for pid in daemon_pids if _alive(pid)]}")
        assert list_segments(prefix) == []  # unlinked by their owners, not by a later sweep
