"""The Ray Serve application: replica deployments each running one ntx instance, and an
OpenAI-compatible ingress that routes to them (docs/CLUSTER.md).

``build_app`` makes it for ``ntxctl cluster up``; ``build`` is the import path for people who
deploy Ray their way (``serve run docs/ray-serve.yaml``, or ``serve run
ntx.ctl.cluster.app:build model=... replicas=2``).

Each replica is a deployment of its own (``NAME-replica-I``, one Serve replica each) so that the
ingress holds a handle per replica and chooses the replica itself (``router``): Ray Serve's
handle routing picks among the replicas of *one* deployment by its own rule, and its pluggable
request routers (``ray.serve.request_router``, from Ray 2.46, an alpha API) are not in every
Ray this supports. Serve still places each replica (one GPU each with ``--backend cuda``),
restarts it when it dies or fails its health check, and spreads them over the cluster's nodes.

The ingress is the gateway's own Starlette app (ctl/gateway/app.py) with a ``ClusterLink``
instead of one pipeline's link: the same routes, request checks, errors, streaming and cancel
on disconnect, plus ``/api/cluster`` (what ``ntxctl cluster status`` shows).
"""

from __future__ import annotations

from typing import Any, Sequence

from ray import serve
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ntx.ctl.cluster.link import ClusterLink
from ntx.ctl.cluster.replica import STOP_TIMEOUT_S, NtxReplica
from ntx.ctl.gateway.app import create_app
from ntx.ctl.gateway.limits import GatewayLimits

REPLICA_MAX_ONGOING = 1024  # Ray's own bound per replica: above what an instance queues (ntx bounds it)
INGRESS_MAX_ONGOING = 4096  # the gateway's bounds (limits) refuse before this is reached
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0

NtxReplicaDeployment = serve.deployment(
    NtxReplica, name="ntx-replica", max_ongoing_requests=REPLICA_MAX_ONGOING,
    health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    graceful_shutdown_timeout_s=STOP_TIMEOUT_S + 5.0)

# The ingress' construction arguments, which its app reads at startup (Serve builds an ingress'
# ASGI app before its first request, and the app object is fixed when the class is decorated).
_ingress_args: dict[str, Any] = {}


async def api_cluster(request: HttpRequest) -> Response:
    """The cluster's replicas and the router (``ClusterLink.cluster_status``); the key as for /metrics."""
    gw = request.app.state.gateway
    gw.check_key(request)
    return JSONResponse(gw.link.cluster_status())


def _cluster_link(gw) -> ClusterLink:
    """The ingress gateway's link (its app's startup): the replicas' handles, and its API key."""
    gw.api_key = _ingress_args["api_key"]
    return ClusterLink(list(zip(_ingress_args["names"], _ingress_args["replicas"])), gw.limits.reply_timeout_s,
                       registry=gw.metrics.registry, direct=_ingress_args.get("direct_replies", True))


INGRESS_APP = create_app("ray-serve", None, GatewayLimits(), make_link=_cluster_link,
                         extra_routes=(Route("/api/cluster", api_cluster, methods=["GET"]),))


@serve.deployment(name="ntx-ingress", max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
@serve.ingress(INGRESS_APP)
class NtxIngress:
    """The HTTP entry of the cluster: the gateway's routes over the replicas' handles."""

    def __init__(self, replicas: list, names: list[str], api_key: str | None = None,
                 direct_replies: bool = True) -> None:
        # through the module: Ray ships this class by value, with a copy of the module's globals
        from ntx.ctl.cluster import app as this_module

        this_module._ingress_args.update(replicas=replicas, names=names, api_key=api_key,
                                         direct_replies=direct_replies)


def build_app(model: str, replicas: int = 2, backend: str = "cpu", name: str = "ntx",
              instance_args: Sequence[str] = (), run_dir: str | None = None, api_key: str | None = None,
              replica_cpus: float = 1.0, direct_replies: bool = True) -> serve.Application:
    """The application: ``replicas`` instances of ``model`` named ``NAME-rI`` (one GPU each on
    cuda; ``replica_cpus`` logical CPUs each on cpu) behind one ingress, which reads the replies
    of the replicas on its node from their instances themselves unless not ``direct_replies``
    (``link.ClusterLink``)."""
    if replicas < 1:
        raise ValueError(f"replicas {replicas}: give 1 or more")
    resources = {"num_gpus": 1, "num_cpus": 1} if backend == "cuda" else {"num_cpus": replica_cpus}
    names = [f"{name}-r{i}" for i in range(replicas)]
    bound = [NtxReplicaDeployment.options(name=f"{name}-replica-{i}", ray_actor_options=resources)
             .bind(model, names[i], backend, list(instance_args), run_dir) for i in range(replicas)]
    return NtxIngress.options(name=f"{name}-ingress").bind(bound, names, api_key, direct_replies)


def build(args: dict) -> serve.Application:
    """``serve run``'s application builder: ``args`` are build_app's (``instance_args`` a list
    of ``ntxctl start`` options, e.g. ``["--max-batch", "32"]``)."""
    known = {"model", "replicas", "backend", "name", "instance_args", "run_dir", "api_key", "replica_cpus",
             "direct_replies"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "model" not in args:
        raise ValueError("model: give the GGUF file (the same path on every node) or a local model's name")
    from ntx.ctl.model_store import resolve_model

    typed = dict(args)
    typed["model"] = resolve_model(str(args["model"]), "model")
    for key, kind in (("replicas", int), ("replica_cpus", float)):
        if key in typed:
            typed[key] = kind(typed[key])
    if isinstance(typed.get("direct_replies"), str):  # serve run's key=value arguments are strings
        text = typed["direct_replies"].strip().lower()
        if text not in ("true", "false", "1", "0"):
            raise ValueError(f"direct_replies {typed['direct_replies']!r}: give true or false")
        typed["direct_replies"] = text in ("true", "1")
    return build_app(**typed)
