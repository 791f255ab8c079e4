"""How an instance's processes live and die (issue 12, items 6, 10, 11, 12): a killed supervisor
takes its daemons and its shared memory with it and its clients hear of it; a model file changed
under the pipeline stops it with the reason; restarts back off; two instances of one name under
two run folders leave each other alone; the run folder is private and its files are opened
without following links."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ntx.ctl import instance
from ntx.ctl.client import ClientError
from ntx.ctl.generations import GatewayProcess
from ntx.ctl.restart_policy import ModelFiles, RestartPolicy
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig, InstancePaths
from ntx.shared.errors import NtxError
from ntx.shared.run_files import hand_over_secret, open_private, private_dir, take_secret, write_private
from ntx.shared.shm import ShmSegment, list_segments

from .pipeline_util import free_port, ntxctl, running_pipeline, wait_for


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


def test_restart_policy_backs_off_and_gives_up():
    policy = RestartPolicy(max_restarts=4, window_s=100.0, first_delay_s=0.5, max_delay_s=3.0)
    assert [policy.after_failure(t) for t in (0.0, 1.0, 2.0, 3.0)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.after_failure(4.0) is None  # the fifth failure within the window
    assert policy.after_failure(200.0) == 0.5  # the window forgot the old ones


def test_model_files_name_each_kind_of_change(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    files = ModelFiles(str(model))
    assert files.change() is None
    with open(model, "r+b") as f:
        f.truncate(400)
    assert "truncated from 1000 to 400 bytes" in files.change()
    files = ModelFiles(str(model))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"y" * 400)
    os.replace(other, model)
    assert "replaced by another file" in files.change()
    files = ModelFiles(str(model))
    os.utime(model, ns=(1, 1))
    assert "rewritten" in files.change()
    # rewritten in place with its mtime restored (before: not noticed, every request failed)
    model.write_bytes(bytes(range(256)) * 4096)
    files = ModelFiles(str(model))
    mtime_ns = model.stat().st_mtime_ns
    with open(model, "r+b") as f:
        f.seek(300_000)
        f.write(b"\xff" * 200_000)
    os.utime(model, ns=(mtime_ns, mtime_ns))
    assert "its content changed; its size and modification time were kept" in files.change()
    model.unlink()
    assert str(model) in files.change() and "removed" in files.change()


def test_a_file_truncated_while_its_blocks_are_read_is_reported_truncated(tmp_path, monkeypatch):
    """CI once saw the race: the check stat'ed the file, the test truncated it, then the check
    read its blocks; the old size and mtime with the new content's digest read as "rewritten, its
    size and modification time kept". Here the truncation comes exactly in that gap."""
    from ntx.ctl import restart_policy

    model = tmp_path / "m.gguf"
    model.write_bytes(bytes(range(256)) * 64)
    files = ModelFiles(str(model))
    real_digest = restart_policy._sample_digest
    calls = []

    def truncate_then_read(path, size_bytes):
        if not calls:
            with open(path, "r+b") as f:
                f.truncate(4096)
        calls.append(size_bytes)
        return real_digest(path, size_bytes)

    monkeypatch.setattr(restart_policy, "_sample_digest", truncate_then_read)
    assert "truncated from 16384 to 4096 bytes" in files.change()
    assert calls == [16384, 4096]  # read again at the size the second stat gave


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "replace"])
def test_model_file_changed_under_the_pipeline_stops_it_with_the_reason(smollm2_path, tmp_path, how):
    """Before: a truncated file gave ``layer_unavailable`` for ever while status said ready, a
    replaced one sent dma into a crash loop. Now the supervisor stops, saying what changed."""
    model = tmp_path / "model.gguf"
    model.write_bytes(smollm2_path.read_bytes())
    run_dir = tmp_path / "run"
    with running_pipeline(str(model), run_dir, "--gpu-layers", "0", "--ram-budget", "0", name=f"chg-{how}") as p:
        assert "Paris" in p.generate_greedy("The capital of France is", 2)["text"]
        if how == "truncate":
            with open(model, "r+b") as f:
                f.truncate(model.stat().st_size // 2)  # the later layers are past the end now
            with p.client() as c, pytest.raises(ClientError) as err:  # a short read, or the stop
                c.complete("The capital of France is", raw=True, temperature=0.0, max_tokens=2)
            assert err.value.code in ("layer_unavailable", "model_changed", "pipeline_lost"), err.value
            assert err.value.code == "pipeline_lost" or "model.gguf" in str(err.value)
        else:
            tmp = tmp_path / "new.gguf"
            tmp.write_bytes(smollm2_path.read_bytes()[: 1 << 20])
            os.replace(tmp, model)
        wait_for(lambda: instance.get_status(p.name, 1.0) is None, 30, "the supervisor to stop")
        r = ntxctl("status", "--name", p.name)
        assert r.returncode != 0
        word = "truncated" if how == "truncate" else "replaced"
        assert f"model file {model} was {word}" in r.stderr, r.stderr


def test_one_name_under_two_run_folders_leaves_the_other_alone(tmp_path, monkeypatch):
    """Shared memory lives in one namespace for the machine; an instance's names carry its run
    folder's digest, so cleaning up after ``twin`` under one run folder (what start and stop do)
    leaves the segments of ``twin`` under another alone. (Before, two test runs deleted each
    other's segments.)"""
    segments = {}
    for run in ("a", "b"):
        monkeypatch.setenv("NTX_RUN_DIR", str(tmp_path / run))
        paths = InstancePaths("twin")
        segments[run] = ShmSegment.create(paths.shm_name(0, "dslot0"), 4096)
    assert segments["a"].name != segments["b"].name
    try:
        assert instance.cleanup_leftovers(InstancePaths("twin")) >= 1  # b's, as NTX_RUN_DIR is b now
        assert not os.path.exists(segments["b"].path)
        assert os.path.exists(segments["a"].path)
        monkeypatch.setenv("NTX_RUN_DIR", str(tmp_path / "a"))
        assert instance.leftovers("twin") == [f"shm:{segments['a'].name}"]
        instance.cleanup_leftovers(InstancePaths("twin"))
        assert not os.path.exists(segments["a"].path)
    finally:
        for seg in segments.values():
            seg.close()
            seg.unlink()


def test_run_folder_files_are_private_and_never_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("NTX_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o777)
    os.chmod(tmp_path / "run", 0o777)
    logs = private_dir(InstancePaths("x").log_dir)
    for folder in (tmp_path / "run", tmp_path / "run" / "logs", logs):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    with open_private(logs / "a.log") as f:
        f.write("line\n")
    assert stat.S_IMODE((logs / "a.log").stat().st_mode) == 0o600
    target = tmp_path / "target"
    target.write_text("precious\n")
    (logs / "b.log").symlink_to(target)
    with pytest.raises(NtxError, match="b.log is a symbolic link; refusing to follow it"):
        open_private(logs / "b.log")
    with pytest.raises(NtxError, match="symbolic link"):
        write_private(logs / "b.log", "x")
    assert target.read_text() == "precious\n"
    other = tmp_path / "run" / "others"
    other.mkdir()
    if os.getuid() == 0:  # as root, make it someone else's
        os.chown(other, 65534, 65534)
        with pytest.raises(NtxError, match="belongs to uid 65534, not to you"):
            private_dir(other / "logs")


@pytest.mark.parametrize("planted", ["supervisor.log", "compute.log", "supervisor.out"])
def test_start_refuses_a_link_planted_among_the_logs(smollm2_path, tmp_path, planted):
    """Before, an instance (run by root) followed a link another user placed among the run
    folder's logs and appended its log lines to the link's target."""
    run_dir = tmp_path / "run"
    target = tmp_path / "target"
    target.write_text("precious\n")
    logs = run_dir / "logs" / "linked"
    logs.mkdir(parents=True)
    (logs / planted).symlink_to(target)
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "linked", "--backend", "cpu",
               "--listen", f"tcp://127.0.0.1:{free_port()}", env={"NTX_RUN_DIR": str(run_dir)})
    assert r.returncode != 0
    assert f"{logs / planted} is a symbolic link; refusing to follow it" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert target.read_text() == "precious\n"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


def test_a_send_to_a_vanished_peer_gives_up_once_the_daemon_must_stop(tmp_path):
    """What kept compute alive after its supervisor died: a ring send to a peer that is gone
    blocks for ever. ``send_patiently`` waits in slices and asks between them."""
    import zmq

    from ntx.shared.daemon import Daemon, StopRequested, send_patiently

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)  # nobody connects: every send would block
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{tmp_path}/ring.sock")
    asked = []

    def between() -> None:
        asked.append(time.monotonic())
        if len(asked) == 3:
            raise StopRequested("stop")

    try:
        with pytest.raises(StopRequested):
            send_patiently(sock, b"want", between)
        assert len(asked) == 3

        daemon = Daemon(f"ipc://{tmp_path}/ctl.sock", gen=0, supervisor_pid=os.getppid())
        assert not daemon.stopping
        daemon.supervisor_pid += 1  # as after the supervisor died and this process was reparented
        with pytest.raises(StopRequested, match="the supervisor .* is gone"):
            daemon.send(sock, m.Want(pass_id=0, layers=[1]))
        daemon.control.close(linger=0)
    finally:
        sock.close(linger=0)


@pytest.mark.slow
def test_a_stalled_daemon_is_reported_within_5_s_and_restarted_after_the_stall_timeout(smollm2_path, tmp_path):
    """Before: compute stopped (SIGSTOP) for 25 s left the state ``ready`` and ``/health`` 200
    while requests waited. Now a daemon silent for 3 s makes the state ``stalled`` with the
    stage named (a short stall ends by itself, same generation, the request served), and one
    silent for ``--stall-timeout`` is killed and the pipeline restarted."""
    http = f"127.0.0.1:{free_port()}"
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "0", "--ram-budget", "0",
                          "--stall-timeout", "10", "--http", http, name="stall") as p:
        st = p.wait_state("ready")
        gen, pid = st["gen"], st["daemons"]["compute"]["pid"]
        wait_for(lambda: httpx.get(f"http://{http}/health").status_code == 200, 30, "the gateway's /health 200")
        try:
            # a short stall: reported within 5 s (status and the gateway's /health), over when
            # compute runs again
            with p.client() as c:
                os.kill(pid, signal.SIGSTOP)
                t0 = time.monotonic()
                rid = c.submit("The capital of France is", raw=True, temperature=0.0, max_tokens=2)
                wait_for(lambda: httpx.get(f"http://{http}/health").status_code == 503, 10, "/health 503")
                assert time.monotonic() - t0 < 5.0
                assert httpx.get(f"http://{http}/health").json() == {"status": "stalled"}
                st = p.status()
                assert st["state"] == "stalled" and st["stalled"] == ["compute"]
                assert st["daemons"]["compute"]["state"] == "stalled" and st["daemons"]["compute"]["silent_s"] > 3.0
                assert st["daemons"]["dma"]["state"] == st["daemons"]["reader"]["state"] == "ready"
                os.kill(pid, signal.SIGCONT)
                st = p.wait_state("ready", timeout_s=10.0)
                assert st["gen"] == gen and st["stalled"] == []
                assert "Paris" in [e for e in c.events(rid)][-1]["text"]
            # a long one: killed after --stall-timeout, the request in flight fails, the next
            # generation serves
            with p.client() as c:
                os.kill(pid, signal.SIGSTOP)
                t0 = time.monotonic()
                rid = c.submit("Once upon a time", raw=True, temperature=0.0, max_tokens=4)
                with pytest.raises(ClientError) as err:
                    for _ in c.events(rid):
                        pass
                assert err.value.code == "pipeline_failure" and "stalled" in str(err.value), err.value
                # silence counts from its last stats, sent every 0.5 s (later on a loaded machine)
                assert 8.0 <= time.monotonic() - t0 < 20.0
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        st = p.wait_state("ready", min_gen=gen + 1)
        assert not _alive(pid)
        assert "Paris" in p.generate_greedy("The capital of France is", 2)["text"]


def test_a_secret_handed_over_by_file_is_private_and_gone_once_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("NTX_RUN_DIR", str(tmp_path / "run"))
    key_file = private_dir(InstancePaths("k").root) / "gateway.secret"
    hand_over_secret(key_file, "s3cret key")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert take_secret(key_file) == "s3cret key" and not key_file.exists()
    key_file.write_text("open")
    os.chmod(key_file, 0o644)
    with pytest.raises(NtxError, match="readable by others"):
        take_secret(key_file)
    assert not key_file.exists()  # refused, and gone all the same
    target = tmp_path / "target"
    target.write_text("precious")
    key_file.symlink_to(target)
    with pytest.raises(NtxError, match="cannot read the secret"):
        take_secret(key_file)
    hand_over_secret(key_file, "new")  # a planted link is removed, never written through
    assert target.read_text() == "precious" and take_secret(key_file) == "new"


@pytest.mark.slow
def test_the_api_key_reaches_no_environment_and_the_gateway_gets_it_by_file(smollm2_path, tmp_path):
    """Before: ``NTX_API_KEY`` sat in the environment of the supervisor and compute (readable in
    /proc/PID/environ). Now ntxctl leaves it in a 0600 file the supervisor takes and deletes, and
    the supervisor hands it to each gateway the same way (``--api-key-file``)."""
    os.environ["NTX_API_KEY"] = "s3cret-key"
    try:
        # no --http here: the gateway's side (reading --api-key-file) is tests/test_gateway.py's
        with running_pipeline(str(smollm2_path), tmp_path, name="keyed") as p:
            st = p.status()
            for pid in (st["supervisor_pid"], st["daemons"]["compute"]["pid"]):
                assert "NTX_API_KEY" not in psutil.Process(pid).environ()
            paths = InstancePaths("keyed")
            assert not paths.secret_file("supervisor").exists()
            gateway = GatewayProcess(instance_config("keyed"), paths, False, lambda _: None, api_key="s3cret-key")
            argv = gateway.command()
            key_file = argv[argv.index("--api-key-file") + 1]
            assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and "s3cret-key" not in argv
            assert take_secret(key_file) == "s3cret-key"
    finally:
        del os.environ["NTX_API_KEY"]


def instance_config(name: str) -> InstanceConfig:
    return InstanceConfig.from_dict(json.loads(InstancePaths(name).config_file.read_text())["instance"])


def test_a_run_folder_that_cannot_be_written_is_one_line_and_leaves_nothing(smollm2_path, tmp_path):
    """Before: a full or read-only run folder at ``start`` printed a 67-85 line traceback, and a
    full one left files that made ``status`` list the instance as running."""
    run_dir = tmp_path / "run"

    def full_disk():  # every write to a file fails as on a full disk (EFBIG; Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    env = {**os.environ, "NTX_RUN_DIR": str(run_dir)}
    args = [sys.executable, "-m", "ntx.ctl.cli", "start", "--model", str(smollm2_path), "--name", "full",
            "--backend", "cpu", "--listen", f"tcp://127.0.0.1:{free_port()}"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, preexec_fn=full_disk, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("ntxctl: error: cannot write the run folder ("), r.stderr
    assert not (run_dir / "full").exists()
    assert "no instances are running" in ntxctl("ps", env={"NTX_RUN_DIR": str(run_dir)}).stdout
    (tmp_path / "a-file").write_text("")
    r = ntxctl(*args[3:], env={"NTX_RUN_DIR": str(tmp_path / "a-file" / "run")})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("ntxctl: error: cannot write the run folder ("), r.stderr


def test_an_owner_is_its_process_not_a_later_one_under_its_pid():
    me = instance.Owner.of(os.getpid())
    assert me.alive()
    assert instance.Owner.from_dict(me.to_dict()).alive()
    assert not instance.Owner(os.getpid(), me.started_s - 1.0).alive()  # the pid, reused by another process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not instance.Owner(gone.pid, time.time()).alive()


def test_an_instance_started_for_a_process_stops_once_that_process_is_killed(smollm2_path, run_dir):
    """``ntxctl bench`` starts its instances for itself (``instance.start(owner_pid=)``): killed
    mid-run (kill -9, as a time limit does), it used to leave its instance running, holding the
    GPU's memory, and the next bench refused the name. Now the supervisor sees its owner gone
    and stops, leaving nothing behind."""
    from ntx.daemons.compute.backend import plan_for
    from ntx.shared.gguf_index import open_model

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        cfg = InstanceConfig(model=str(smollm2_path), name=f"owned-{os.getpid()}",
                             listen=f"tcp://127.0.0.1:{free_port()}", ram_budget=0).validate()
        st = instance.start(cfg, plan_for(open_model(cfg.model), cfg), owner_pid=owner.pid)
        paths = InstancePaths(cfg.name)
        daemon_pids = [d["pid"] for d in st["daemons"].values()]
        assert json.loads(paths.config_file.read_text())["owner"]["pid"] == owner.pid
        time.sleep(1.5)  # a live owner keeps it
        assert instance.get_status(cfg.name, 5.0)["state"] == "ready"
        owner.kill()
        owner.wait()
        wait_for(lambda: instance.supervisor_pid(paths) is None, 15.0, "the supervisor to stop")
        wait_for(lambda: not any(_alive(pid) for pid in daemon_pids + [st["supervisor_pid"]]), 10.0,
                 "its daemons to exit")
        assert not paths.root.exists() or not any(paths.root.iterdir())
        assert list_segments(paths.shm_prefix) == []
        log = (paths.log_dir / "supervisor.log").read_text()
        assert f"the process this instance was started for (pid {owner.pid}) is gone; stopping" in log
    finally:
        owner.kill()
        owner.wait()


def test_status_and_ps_check_the_pid_they_read(tmp_path, monkeypatch):
    """Before: a run folder with a pid file listed the instance as running, whoever had the pid."""
    monkeypatch.setenv("NTX_RUN_DIR", str(tmp_path / "run"))
    paths = InstancePaths("ghost")
    private_dir(paths.root)
    write_private(paths.pid_file, f"{os.getpid()}\n")  # a live process, but not its supervisor
    assert instance.supervisor_pid(paths) is None and instance.list_instances() == []
    r = ntxctl("ps", env={"NTX_RUN_DIR": str(tmp_path / "run")})
    assert "no instances are running" in r.stdout, r.stdout
    r = ntxctl("status", "--name", "ghost", env={"NTX_RUN_DIR": str(tmp_path / "run")})
    assert r.returncode == 1 and "is not running" in r.stderr and "(running:" not in r.stderr, r.stderr


def test_a_daemon_whose_steps_are_long_is_given_room_before_it_counts_as_stalled():
    """A cpu backend's pass over a big model sends no stats while it runs: the silence that
    means stalled grows to twice the longest step compute reported (plus a stats interval),
    and never shrinks below the fixed bound."""
    from ntx.ctl.generations import DaemonProc
    from ntx.ctl.restart_policy import STALL_REPORT_S

    d = DaemonProc("compute", proc=None, started_s=0.0)
    assert d.stall_after_s(STALL_REPORT_S) == STALL_REPORT_S
    d.longest_step_s = 0.4  # a GPU pass: the fixed bound holds
    assert d.stall_after_s(STALL_REPORT_S) == STALL_REPORT_S
    d.longest_step_s = 4.0  # a CPU pass of an 8B model
    assert d.stall_after_s(STALL_REPORT_S) == 2 * 4.0 + m.STATS_INTERVAL_S
    assert d.stall_after_s(60.0) == 60.0
