"""ntxctl's side of an instance: start a supervisor that outlives the shell, ask it for status,
stop it — and clean up after one that died without doing so itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import psutil
import zmq

from ntx.shared import messages as m
from ntx.shared.config import API_KEY_ENV, InstanceConfig, InstancePaths, run_root
from ntx.shared.errors import NtxError
from ntx.shared.plan import Plan
from ntx.shared.run_files import hand_over_secret, open_private, private_dir, write_private
from ntx.shared.shm import list_segments, unlink_all

SUPERVISOR_EXIT_S = 15.0  # how long a stopping supervisor, or a killed daemon, may take to be gone


def supervisor_pid(paths: InstancePaths) -> int | None:
    """The live supervisor's pid, or None: a stale pid file does not count, nor a pid reused by
    a process that is not this instance's supervisor (its command line names its config file)."""
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
        if (p.status() == psutil.STATUS_ZOMBIE or "ntx.ctl.supervisor" not in cmd
                or str(paths.config_file) not in cmd):
            return None
    except psutil.Error:
        return None
    return pid


def list_instances() -> list[str]:
    """The instances whose supervisor runs (a run folder a dead one left is not one)."""
    root = run_root()
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name != "logs" and supervisor_pid(InstancePaths(p.name)) is not None)


def control_request(paths: InstancePaths, msg: m.CtlStatus | m.CtlStop, timeout_s: float = 5.0,
                    while_waiting: Callable[[], None] | None = None) -> m.Message | None:
    """One request/reply with the supervisor over its control socket; None if it does not answer.
    ``while_waiting`` is called about once a second until the reply comes."""
    if not (paths.root / "ctl.sock").exists():
        return None
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"ctl-{os.getpid()}-{time.monotonic_ns()}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(paths.control)
        sock.send(msg.encode())
        deadline = time.monotonic() + timeout_s
        while not sock.poll(int(min(1.0, max(0.0, deadline - time.monotonic())) * 1000)):
            if time.monotonic() >= deadline:
                return None
            if while_waiting is not None:
                while_waiting()
        return m.SUPERVISOR_TO_CTL.decode(sock.recv())
    finally:
        sock.close(linger=0)


def get_status(name: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    reply = control_request(InstancePaths(name), m.CtlStatus(), timeout_s)
    return reply.status if isinstance(reply, m.StatusReport) else None


def refuse_running(name: str) -> None:
    """Raise NtxError if instance ``name`` runs (before anything else about a start is checked)."""
    pid = supervisor_pid(InstancePaths(name))
    if pid:
        raise NtxError(f"instance {name!r} is already running (supervisor pid {pid}); stop it first or pick --name")


class Owner:
    """The process an instance lives for (``start(..., owner_pid=)``: ``ntxctl bench``'s own
    instances), named by its pid and its start time so that a reused pid is not taken for it.
    The supervisor stops the instance once its owner is gone: a bench killed mid-run (a time
    limit's kill -9) used to leave its instance holding the GPU's memory and the name ``bench``,
    and the next bench refused to start."""

    def __init__(self, pid: int, started_s: float) -> None:
        self.pid = pid
        self.started_s = started_s

    @classmethod
    def of(cls, pid: int) -> Owner:
        return cls(pid, psutil.Process(pid).create_time())

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "started_s": self.started_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Owner:
        return cls(int(d["pid"]), float(d["started_s"]))

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.pid)
            # the same start time, read by another process (a clock tick's rounding apart)
            return abs(p.create_time() - self.started_s) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def prepare_run(cfg: InstanceConfig, plan: Plan, api_key: str | None = None, owner: Owner | None = None) -> Path:
    """Make an instance's run folder ready for a supervisor (``start`` detached, ``ntxctl serve``
    in the foreground): refuse a running one, free a dead one's leftovers, write the config the
    supervisor reads (with the ``owner`` it lives for, if any) and the API key it takes
    (``secret_file``); returns the config file. A run folder that cannot be written (read-only,
    full) is one NtxError line, and nothing is left."""
    paths = InstancePaths(cfg.name)
    refuse_running(cfg.name)
    cleanup_leftovers(paths)
    with run_folder_writes(paths):
        private_dir(paths.root)
        private_dir(paths.log_dir)
        (paths.log_dir / "last_failure").unlink(missing_ok=True)
        record = {"instance": cfg.to_dict(), "plan": plan.to_dict()}
        if owner is not None:
            record["owner"] = owner.to_dict()
        write_private(paths.config_file, json.dumps(record))
        if api_key:
            hand_over_secret(paths.secret_file("supervisor"), api_key)
    return paths.config_file


@contextmanager
def run_folder_writes(paths: InstancePaths):
    """Writes to the run folder: an OSError (read-only, full, not a folder) or a refusal is one
    NtxError line, and the run folder is removed so that nothing lists the instance."""
    try:
        yield
    except (OSError, NtxError) as e:
        paths.remove_runtime()
        if isinstance(e, NtxError):
            raise
        where = e.filename or paths.root
        raise NtxError(f"cannot write the run folder ({where}: {e.strerror or e}); free space there or choose "
                       f"another folder with NTX_RUN_DIR") from None


def supervisor_env() -> dict[str, str]:
    """The supervisor's environment: this one without the API key (it has it by file)."""
    return {k: v for k, v in os.environ.items() if k != API_KEY_ENV}


def instance_listen(name: str) -> str | None:
    """The client address of instance ``name`` while it runs (from its run folder), else None."""
    if supervisor_pid(InstancePaths(name)) is None:
        return None
    try:
        return json.loads((InstancePaths(name).root / "config.json").read_text())["instance"]["listen"]
    except (OSError, ValueError, KeyError):
        return None


def running_models() -> dict[str, list[str]]:
    """The model files (model, draft model) each running instance holds, from its run folder:
    what ``ntxctl rm`` must not delete."""
    out = {}
    for name in list_instances():
        try:
            inst = json.loads(InstancePaths(name).config_file.read_text())["instance"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[name] = [p for p in (inst.get("model"), inst.get("draft_model")) if isinstance(p, str)]
    return out


def start(cfg: InstanceConfig, plan: Plan, wait_s: float | None = None, on_progress=None,
          api_key: str | None = None, owner_pid: int | None = None) -> dict[str, Any]:
    """Launch the supervisor detached, wait until the pipeline is ready; return its status.
    With ``owner_pid`` the instance lives only as long as that process (``Owner``); without,
    until it is stopped.

    Raises NtxError with the failing daemon's own reason if the pipeline cannot start."""
    paths = InstancePaths(cfg.name)
    cfg_file = prepare_run(cfg, plan, api_key, Owner.of(owner_pid) if owner_pid is not None else None)
    with run_folder_writes(paths):
        log = open_private(paths.log_dir / "supervisor.out", "ab")
        try:
            write_private(paths.pid_file, "")  # fails here, before there is a process to stop
        except BaseException:
            log.close()
            raise
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntx.ctl.supervisor", "--config", str(cfg_file)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=supervisor_env(),
    )
    log.close()
    try:
        write_private(paths.pid_file, f"{proc.pid}\n")
    except (OSError, NtxError):
        proc.kill()
        proc.wait()
        with run_folder_writes(paths):
            raise
    wait_s = wait_s if wait_s is not None else cfg.timeout * 3 + 10
    deadline = time.monotonic() + wait_s
    last_state = None
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise NtxError(_failure_reason(paths, code))
        st = get_status(cfg.name, timeout_s=0.5)
        if st:
            if st["state"] == "ready":
                return st
            if on_progress and st["state"] != last_state:
                on_progress(st)
            last_state = st["state"]
        time.sleep(0.1)
    stop(cfg.name, force=True)
    raise NtxError(f"instance {cfg.name!r} was not ready within {wait_s:.0f} s (logs: {paths.log_dir})")


def last_failure(name: str) -> str | None:
    """Why the instance's last run ended, if it ended on a failure (kept until the next start)."""
    try:
        return (InstancePaths(name).log_dir / "last_failure").read_text().strip() or None
    except OSError:
        return None


def _failure_reason(paths: InstancePaths, code: int) -> str:
    reason = last_failure(paths.name)
    if not reason:
        try:
            tail = (paths.log_dir / "supervisor.out").read_text().strip().splitlines()[-1:]
        except OSError:
            tail = []
        reason = f"the supervisor exited with status {code}" + (f": {tail[0]}" if tail else "")
    return reason


def _in_flight(name: str) -> int | None:
    """How many requests instance ``name`` has in flight (None: it does not answer)."""
    st = get_status(name, timeout_s=5.0)  # a busy machine's supervisor may take a second or more to answer
    return st["requests"]["in_flight"] if st else None


def _requests(n: int) -> str:
    return f"{n} request{'s' if n != 1 else ''}"


def stop(name: str, force: bool = False, timeout_s: float = 60.0, on_progress: Callable[[str], None] | None = None) -> str:
    """Stop an instance; returns a line saying what happened. ``on_progress`` is told what the
    stop waits for: the requests in flight a graceful stop lets finish (their count as it falls,
    and that --force cancels them), or the ones a forced stop cancels."""
    paths = InstancePaths(name)
    pid = supervisor_pid(paths)
    if pid is None:
        n = cleanup_leftovers(paths)
        if n:
            return f"instance {name!r} was not running; removed {n} leftover(s)"
        raise NtxError(f"instance {name!r} is not running")
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        proc = None
    say = on_progress or (lambda line: None)
    in_flight = _in_flight(name) if on_progress else None
    if in_flight and force:
        say(f"cancelling {_requests(in_flight)} in flight")
    elif in_flight:
        from ntx.ctl.supervisor import DRAIN_TIMEOUT_S

        say(f"waiting for {_requests(in_flight)} in flight to finish (at most {DRAIN_TIMEOUT_S:g} s); "
            f"`ntxctl stop --name {name} --force` cancels them instead")

    def progress() -> None:
        nonlocal in_flight
        now = _in_flight(name)
        if now is not None and now != in_flight:
            in_flight = now
            say(f"{_requests(now)} still in flight" if now else "no requests in flight; stopping the daemons")

    reply = control_request(paths, m.CtlStop(force=force), timeout_s=timeout_s,
                            while_waiting=progress if in_flight and not force else None)
    if proc is not None:
        # Wait for the process itself, not its pid file: the supervisor removes its run files
        # before its interpreter exits, and a busy machine can take a while over the rest.
        try:
            proc.wait(timeout=SUPERVISOR_EXIT_S if reply else 2.0)
        except psutil.TimeoutExpired:
            # It does not answer or does not finish: take the whole process group down.
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=SUPERVISOR_EXIT_S)
            except psutil.Error:
                pass
        except psutil.Error:
            pass
    cleanup_leftovers(paths)
    reason = reply.reason if isinstance(reply, m.Stopped) else None
    return f"instance {name!r} stopped" + (f" ({reason})" if reason else "")


def cleanup_leftovers(paths: InstancePaths) -> int:
    """Free what a dead instance left: its daemons, shared memory and run folder."""
    n = 0
    killed: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if paths.control in cmd and "ntx.daemons." in cmd:
            try:
                p.kill()
                killed.append(p)
            except psutil.Error:
                pass
    psutil.wait_procs(killed, timeout=SUPERVISOR_EXIT_S)  # SIGKILL is delivered, not done, when kill returns
    n += len(killed)
    n += unlink_all(paths.shm_prefix)
    if paths.root.exists():
        n += len(paths.socket_files())
        paths.remove_runtime()
    return n


def leftovers(name: str) -> list[str]:
    """Everything of an instance still on the machine (for tests and `ntxctl status`)."""
    paths = InstancePaths(name)
    out = [f"shm:{s}" for s in list_segments(paths.shm_prefix)]
    out += [f"socket:{s}" for s in paths.socket_files()]
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if (paths.control in cmd and "ntx.daemons." in cmd) or (str(paths.root / "config.json") in cmd):
            out.append(f"process:{p.pid}")
    return out
