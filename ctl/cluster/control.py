"""``ntxctl cluster up|status|down``: bring the Ray Serve application up on a Ray cluster (a
local one this command starts, or the one ``--address`` names), show its replicas, take it down.

What ``up`` made is kept in the run folder (``cluster-NAME.json``: the Ray address, the HTTP
address, the pid of the Ray head it started if it started one), so that ``status`` and ``down``
find it. A local head is ``ray start --head --block`` in a session of its own, on free ports:
``down`` stops it by its pid (and with it every Ray process it started), never other Ray
processes of the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from ntx.shared.config import run_root
from ntx.shared.errors import NtxError
from ntx.shared.run_files import open_private, private_dir, write_private

HEAD_START_TIMEOUT_S = 120.0
APP_START_TIMEOUT_S = 900.0  # replicas start their instances (and a model's first start compiles kernels)
HEAD_STOP_TIMEOUT_S = 30.0
# The local head's object store: the cluster passes small replies, never tensors, so it needs
# little (Ray's default reserves 30% of the machine's memory in /dev/shm).
HEAD_OBJECT_STORE_BYTES = 256 << 20


def state_file(name: str) -> Path:
    return run_root() / f"cluster-{name}.json"


def read_state(name: str) -> dict[str, Any]:
    try:
        return json.loads(state_file(name).read_text())
    except (OSError, ValueError):
        raise NtxError(f"cluster {name!r} is not up (no {state_file(name)}); bring it up with "
                       f"`ntxctl cluster up --name {name}`") from None


def require_ray() -> None:
    """Ray Serve is installed (one NtxError line if not); the auth mode is set before Ray is imported."""
    align_ray_auth_mode()
    from importlib.util import find_spec

    if find_spec("ray") is None or find_spec("ray.serve") is None:
        raise NtxError("ntxctl cluster needs Ray Serve: pip install 'ntransformer[ray]'")


def align_ray_auth_mode() -> None:
    """Ray (2.5x on) turns token authentication on for a head started where a token exists
    (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) and ``RAY_AUTH_MODE`` is
    unset, but a driver connecting to it keeps it off and is refused. ntxctl sets the mode the
    head will take for itself and for the head it starts (its child): the same on both ends."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(name: str, num_cpus: int, num_gpus: int | None, say: Callable[[str], None]) -> tuple[str, int]:
    """A local Ray head on free ports (``ray start --head --block`` in its own session); its
    address and pid once it takes connections."""
    log_dir = run_root() / "logs"
    private_dir(run_root())
    private_dir(log_dir)
    port = _free_port()
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(num_cpus),
           "--include-dashboard", "false", "--object-store-memory", str(HEAD_OBJECT_STORE_BYTES),
           "--ray-client-server-port", str(_free_port()),
           "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())]
    if num_gpus is not None:
        cmd += ["--num-gpus", str(num_gpus)]
    with open_private(log_dir / f"cluster-{name}-ray.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    say(f"starting a local Ray head on {address} (pid {proc.pid}; log {log_dir / f'cluster-{name}-ray.log'})")
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NtxError(f"the Ray head exited with status {proc.returncode} (log: "
                           f"{log_dir / f'cluster-{name}-ray.log'})")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return address, proc.pid
        time.sleep(0.3)
    stop_head(proc.pid)
    raise NtxError(f"the Ray head did not listen on {address} within {HEAD_START_TIMEOUT_S:g} s")


def stop_head(pid: int) -> None:
    """SIGTERM to ``ray start --block`` (it stops the processes it started), then SIGKILL to its
    session's processes that are left."""
    try:
        head = psutil.Process(pid)
        group = os.getpgid(pid)
    except (psutil.Error, ProcessLookupError):
        return
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(HEAD_STOP_TIMEOUT_S)
    except psutil.TimeoutExpired:
        pass
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def forget_current_cluster(address: str) -> None:
    """Ray records the newest local head in ``ray_current_cluster`` under its temp folder (what a
    plain ``ray.init()`` or ``serve run`` connects to); a head that ``down`` stopped is removed
    from there, as ``ray stop`` would do, when it is the one recorded."""
    current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    try:
        recorded = current.read_text().strip()
    except OSError:
        return
    if recorded.rpartition(":")[2] == address.rpartition(":")[2]:
        current.unlink(missing_ok=True)


def serve_has_direct_ingress() -> bool:
    """Whether the installed Ray Serve can serve an ingress replica's HTTP on a port of its own
    (``RAY_SERVE_ENABLE_DIRECT_INGRESS``, with per-node port ranges: Ray 2.5x and later)."""
    try:
        from ray.serve._private import constants
        from ray.serve._private import node_port_manager  # noqa: F401 - the owner of the port ranges
    except ImportError:
        return False
    return hasattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT")


def up(model: str, replicas: int, backend: str, address: str | None, http: str, name: str,
       instance_args: Sequence[str], api_key: str | None, replica_cpus: float,
       say: Callable[[str], None], direct_replies: bool = True, serve_proxy: bool = False) -> dict[str, Any]:
    """Deploy the application and wait until every replica's instance is ready; returns the
    state written to ``state_file(name)``. ``direct_replies``: ``app.build_app``'s.

    On a local head (no ``address``) whose Ray Serve has direct ingress
    (``serve_has_direct_ingress``), and unless ``serve_proxy``, the ingress replica itself
    listens on ``http``: the flag and a port range of that one port are in the head's
    environment, which every Ray process of it inherits. Serve's HTTP proxy, a hop of its own
    (7 ms a request on the 2-core VM), then gets a free port nobody is sent to. On a cluster
    given by ``address`` the proxy serves, as that cluster's ``ray start`` set it up."""
    require_ray()
    from ntx.ctl.gateway.address import parse_http_address

    host, port = parse_http_address(http)
    if state_file(name).exists():
        raise NtxError(f"cluster {name!r} is up already ({state_file(name)}); `ntxctl cluster down --name {name}` "
                       "first, or pick another --name")
    head_pid = None
    proxy_port = port
    direct_ingress = address is None and not serve_proxy and serve_has_direct_ingress()
    if direct_ingress:
        proxy_port = _free_port()
        os.environ.update({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
                           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1)})  # the range [port, port + 1)
    if address is None:
        cpus = max(os.cpu_count() or 1, int(replicas * replica_cpus + 0.999))
        address, head_pid = start_head(name, cpus, None, say)
    state = {"name": name, "address": address, "http": f"{host}:{port}", "head_pid": head_pid,
             "replicas": replicas, "model": model, "backend": backend,
             "http_by": "the ingress replica (Serve's direct ingress)" if direct_ingress else "Serve's HTTP proxy"}
    private_dir(run_root())
    write_private(state_file(name), json.dumps(state))
    try:
        import ray
        from ray import serve

        from ntx.ctl.cluster.app import build_app

        ray.init(address=address, log_to_driver=False, logging_level="warning")
        serve.start(http_options={"host": host, "port": proxy_port})
        say(f"deploying {replicas} replica(s) of {os.path.basename(model)} on {backend}; each starts its instance")
        app = build_app(model, replicas, backend, name, instance_args, os.environ.get("NTX_RUN_DIR"), api_key,
                        replica_cpus, direct_replies)
        serve.run(app, name=name, route_prefix="/", blocking=False)
        wait_ready(state, APP_START_TIMEOUT_S, api_key)
    except BaseException as e:
        say(f"the cluster did not come up ({type(e).__name__}: {str(e)[:2000]}); taking down what started")
        down(name, say)
        raise
    return state


def cluster_status(state: dict[str, Any], api_key: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The ingress' /api/cluster."""
    req = urllib.request.Request(f"http://{state['http']}/api/cluster",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_ready(state: dict[str, Any], timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
    """Wait until every replica is ready (as the ingress sees it)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = cluster_status(state, api_key)
            if last["replicas"] and all(r["ready"] for r in last["replicas"]):
                return last
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(1.0)
    raise NtxError(f"cluster {state['name']!r} was not ready within {timeout_s:g} s (last: {last})")


def down(name: str, say: Callable[[str], None]) -> None:
    """Delete the application (its replicas stop their instances) and stop the Ray head ``up``
    started; the state file goes last."""
    state = read_state(name)
    align_ray_auth_mode()  # before Ray is imported: it reads the mode once
    try:
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=state["address"], log_to_driver=False, logging_level="warning")
        serve.delete(name)
        say(f"deleted the application {name!r} (its replicas stopped their instances)")
        if state.get("head_pid"):
            serve.shutdown()
        ray.shutdown()
    except Exception as e:  # noqa: BLE001 - the head may be gone already: what is left is still stopped
        say(f"the Ray cluster did not answer ({type(e).__name__}: {e}); stopping what is left")
    if state.get("head_pid"):
        stop_head(state["head_pid"])
        forget_current_cluster(state["address"])
        say(f"stopped the local Ray head (pid {state['head_pid']})")
    state_file(name).unlink(missing_ok=True)


def render(report: dict[str, Any]) -> str:
    """``ntxctl cluster status``'s table: one row per replica."""
    st = report.get("status") or {}
    lines = [f"cluster: {st.get('replicas_ready', 0)} of {len(report['replicas'])} replicas ready, "
             f"{st.get('tokens_per_s', 0.0):.1f} tokens/s, {report.get('in_flight', 0)} requests in flight, "
             f"model {os.path.basename(st.get('model', '') or '?')}"]
    rows = [("REPLICA", "STATE", "TOK/S", "IN FLIGHT", "QUEUED", "PREFIX HIT", "BOTTLENECK", "ROUTED p/l/r", "FAILED",
             "RESTARTS", "NODE")]
    for r in report["replicas"]:
        routed = r.get("routed", {})
        hit = r.get("prefix_hit_rate")
        rows.append((r["name"], r["state"], f"{r['tokens_per_s']:.1f}", str(r["in_flight"]), str(r["queued"]),
                     "-" if hit is None else f"{100 * hit:.0f}%", r.get("bottleneck") or "-",
                     f"{routed.get('prefix', 0)}/{routed.get('least_loaded', 0)}/{routed.get('retry', 0)}",
                     str(r.get("failed", 0)), str(r.get("restarts", 0)), r.get("node") or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
