"""The cluster ingress' link to its replicas: what the gateway's routes (ctl/gateway/app.py) call
a link, over Ray Serve deployment handles instead of one ZeroMQ connection.

``ClusterLink`` has ``PipelineLink``'s interface (``submit``, ``forget``, ``fresh_status``,
``history``, ``in_flight``, ``end_all``), so the gateway's routes, request checks, errors and
streaming serve a cluster unchanged. Each request is routed by the ingress itself
(``router.PrefixRouter``) to one replica and read as its instance's own replies (``token``,
``done``, ``error``): from the instance itself, over its ZeroMQ socket, when the replica runs on
the ingress' node (``ReplicaView.direct``: the token path crosses no Ray hop, as with a single
gateway), else as a Ray stream through the replica deployment's handle. Ray carries the rest
either way: the replicas' status (and so their health and load), placement and restarts.

Faults. A request that has given its client nothing yet is sent again to another replica when
its replica fails it: the replica's process died (Ray's error), its instance's pipeline failed
or restarts (the instance's ``pipeline_failure``, ``pipeline_lost``, ``overloaded``, ...: the
codes whose HTTP answer says retry), or another request failed there by a fault since it was
sent (``ReplicaView.lost_since``). A request that has
already streamed tokens gets one ``pipeline_lost`` error naming the replica, never a hang, and
never a silent end. Ray Serve restarts the dead replica (``check_health`` in ``replica``); the
router leaves it out until its status says ready again and forgets its prefixes (its KV cache
is gone).

One ingress replica holds the exact in-flight count of every replica; with several ingress
replicas, each balances its own share (load reports from the replicas' status fill the rest).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections import Counter, deque
from typing import Any, AsyncIterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ntx.ctl.cluster.router import Candidate, PrefixRouter, answered_key, request_key
from ntx.ctl.gateway.link import (HISTORY_S, STATUS_INTERVAL_S, PipelineGone, PipelineLink, StreamTable,
                                  connect_address, generate_frame)
from ntx.ctl.gateway.openai_schema import WIRE_ERRORS

log = logging.getLogger("ray.serve")

STATUS_CALL_TIMEOUT_S = 5.0  # a status call unanswered by then is no answer (on a busy machine, not a failure)
# A replica whose instance's status has not been seen for this long is left out as not ready. A
# slow answer is no evidence of a fault (a replica relaying tokens on busy cores answers late);
# a failed request, a status saying so, or this long a silence is.
STATUS_LOST_S = 30.0
# pipeline error codes after which a request that streamed nothing yet goes to another replica:
# those whose HTTP answer says "retry" (the instance as a whole could not serve it now); all but
# "overloaded" (load, not a fault) also take the replica out until its next status
RETRY_CODES = frozenset(code for code, (_, _, retry) in WIRE_ERRORS.items() if retry) - {"reply_timeout"}
LOAD_CODES = frozenset({"overloaded"})
LOST_CHECK_S = 0.25  # how often a request waiting for its first reply looks for evidence its replica is lost


class ReplicaView:
    """What the ingress knows of one replica: its handle, its last status, the requests it sent
    there and is still reading, and what it routed there.

    It is ready while its instance's last status says ready, that status is at most
    ``STATUS_LOST_S`` old, and no request failed there since that status came."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle
        self.report: dict | None = None  # the replica's last answer to ``status`` (replica.NtxReplica.status)
        self.instance_status: dict | None = None  # the last instance status it held
        self.status_at_s = -float("inf")  # when that came
        self.failed_at_s = -float("inf")  # when a request last failed here
        self.epoch: tuple | None = None  # (supervisor pid, pipeline generation): a new one empties its cache
        self.in_flight = 0
        self.routed: Counter[str] = Counter()  # by reason: prefix, least_loaded, retry
        self.failed = 0  # requests that failed here (retried elsewhere, or ended with an error)
        self.restarts = 0  # instance restarts seen (a new supervisor; its pipeline's restarts are its status')
        # the instance's own ZeroMQ link, where it runs on the ingress' node (ClusterLink.direct)
        self.direct: PipelineLink | None = None

    def observe(self, report: dict) -> None:
        """A status answer of the replica: its instance's status, if it has one now (an
        instance that exited is a status of its own; one that did not answer keeps the last)."""
        self.report = report
        if not report.get("instance_running", True):
            self.instance_status, self.status_at_s = {"state": "exited"}, time.monotonic()
        elif report.get("status") is not None:
            self.instance_status, self.status_at_s = report["status"], time.monotonic()

    def mark_failed(self, fault: bool = True) -> None:
        """A request failed here; by a ``fault`` (not load): not ready until a status comes
        after this, and the requests still waiting for their first reply here go elsewhere."""
        self.failed += 1
        if fault:
            self.failed_at_s = time.monotonic()

    def lost_since(self, since_s: float) -> bool:
        """Evidence since ``since_s`` that requests sent here will not be answered: a request
        failed here by a fault, or the instance exited. (A stalled or late status is not: the
        instance queues what it has and answers when it can, as a single gateway's would.)"""
        exited = (self.instance_status or {}).get("state") == "exited" and self.status_at_s > since_s
        return self.failed_at_s > since_s or exited

    @property
    def status(self) -> dict | None:
        """The instance's last status, if at most ``STATUS_LOST_S`` old."""
        if time.monotonic() - self.status_at_s > STATUS_LOST_S:
            return None
        return self.instance_status

    @property
    def ready(self) -> bool:
        st = self.status
        return st is not None and st.get("state") == "ready" and self.status_at_s > self.failed_at_s

    def summary(self) -> dict:
        """This replica in ``ntxctl cluster status`` and /api/cluster."""
        st = self.status or {}
        kv = st.get("kv") or {}
        looked = kv.get("prefix_hit_tokens", 0) + kv.get("prefix_miss_tokens", 0)
        return {
            "name": self.name, "ready": self.ready, "state": st.get("state", "not answering"),
            "instance": (self.report or {}).get("instance"), "node": (self.report or {}).get("node"),
            "pid": (self.report or {}).get("pid"),
            "tokens_per_s": st.get("tokens_per_s", 0.0), "tokens_generated": st.get("tokens_generated", 0),
            "in_flight": self.in_flight, "queued": st.get("requests", {}).get("queued", 0),
            "active": st.get("requests", {}).get("active", 0),
            "prefix_hit_rate": round(kv.get("prefix_hit_tokens", 0) / looked, 4) if looked else None,
            "bottleneck": st.get("bottleneck"), "routed": dict(self.routed), "failed": self.failed,
            "restarts": self.restarts + st.get("restarts", 0),
            # how its replies reach the ingress: from its instance itself (same node), or through Ray
            "replies": "direct" if self.direct is not None and self.direct.connected else "ray",
        }


class _Retry(Exception):
    """The replica failed the request before it streamed anything: route it again."""

    def __init__(self, reason: str, fault: bool = True) -> None:
        super().__init__(reason)
        self.fault = fault  # False: the replica refused it for load


class ClusterStream:
    """One request's replies, read from the replica the router chose (and, if that one fails
    it before any reply, from the next); iterate with ``async for``. The gateway's
    ``RequestStream`` interface: ``rid``, ``finished``, ``cancel``."""

    def __init__(self, link: ClusterLink, rid: str, wire: dict) -> None:
        self.link = link
        self.rid = rid
        self.wire = wire
        self.key = request_key(wire)
        self.finished = False
        self.cancel_sent = False
        self.replica: ReplicaView | None = None
        self._call = None  # the Ray stream of the replica's replies, or
        self._direct = None  # (link, RequestStream) read from its instance itself
        self._ended: asyncio.Queue[dict] = asyncio.Queue()  # end_all's errors

    async def __aiter__(self) -> AsyncIterator[dict]:
        tried: set[str] = set()
        reason = None
        while not self.finished:
            replica = self.link.route(self.key, tried, reason)
            if replica is None:
                self.finished = True
                yield self._error("pipeline_lost", "no replica of the cluster is ready" + (
                    f" (tried {', '.join(sorted(tried))})" if tried else "") + "; retry later")
                return
            tried.add(replica.name)
            self.replica = replica
            replica.in_flight += 1
            streamed = False
            try:
                async for ev in self._replies(replica):
                    if ev["type"] == "error" and ev.get("code") in RETRY_CODES and not self.cancel_sent:
                        fault = ev.get("code") not in LOAD_CODES
                        if not streamed:
                            raise _Retry(f"{ev.get('code')}: {ev.get('message')}", fault)
                        replica.mark_failed(fault)
                    streamed = True
                    if ev["type"] in ("done", "error"):
                        self.finished = True
                        if ev["type"] == "done" and ev.get("finish_reason") != "cancelled":
                            self.link.router.record(answered_key(self.wire, ev.get("text", "")), replica.name)
                            ev = {**ev, "replica": replica.name}  # the response's ntx.replica
                    yield ev
                    if self.finished:
                        return
                raise _Retry("the replica's reply stream ended without an answer")
            except _Retry as e:
                replica.mark_failed(e.fault)
                if streamed:  # (a stream that ended without an answer): its client has part of one
                    self.finished = True
                    yield self._error("pipeline_lost", f"replica {replica.name} ended the request without an "
                                                       "answer; it was not finished")
                    return
                log.warning("request %s: replica %s failed it before any reply (%s); routing it again",
                            self.rid, replica.name, e)
                reason = "retry"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Ray's errors for a replica that died or was cancelled
                if self.cancel_sent:
                    self.finished = True
                    yield {"type": "done", "id": self.rid, "finish_reason": "cancelled", "text": "", "usage": {}}
                    return
                replica.mark_failed()
                if streamed:
                    self.finished = True
                    yield self._error("pipeline_lost", f"replica {replica.name} was lost during the request "
                                                       f"({type(e).__name__}); the request was not finished")
                    return
                log.warning("request %s: replica %s failed before any reply (%s: %.200s); routing it again",
                            self.rid, replica.name, type(e).__name__, e)
                reason = "retry"
            finally:
                replica.in_flight -= 1
                self._cancel_call()

    def _open(self, replica: ReplicaView) -> AsyncIterator[list[dict]]:
        """The replica's replies, in lists: from its instance itself where the ingress has a
        connected link to it (one reply a list), else through Ray (``NtxReplica.generate``'s
        lists: the replies that had arrived together)."""
        direct = replica.direct
        if direct is not None and direct.connected:
            try:
                stream = direct.submit(self.wire)
            except PipelineGone:  # the connection dropped just now: Ray's road
                pass
            else:
                self._direct = (direct, stream)

                async def one_by_one() -> AsyncIterator[list[dict]]:
                    async for ev in stream:
                        yield [ev]

                return one_by_one()
        self._call = replica.handle.options(stream=True).generate.remote(self.wire)
        return aiter(self._call)

    async def _replies(self, replica: ReplicaView) -> AsyncIterator[dict]:
        """The replica's replies, each raced by ``end_all``'s error and the reply timeout; the
        first one also by evidence that the replica is lost (``ReplicaView.lost_since``): a
        request waiting for its first reply there goes elsewhere (``_Retry``) instead of waiting
        for Serve to restart it. (After the first reply a replica's death is Ray's error on the
        stream, or the ``pipeline_lost`` its instance's dropped connection gives a direct read;
        its pipeline's failure an error reply; a stalled or late status ends nothing.)"""
        sent_s = time.monotonic()
        replies = self._open(replica)
        first = True
        while True:
            nxt = asyncio.ensure_future(anext(replies))
            ended = asyncio.ensure_future(self._ended.get())
            racing = {nxt, ended}
            lost = asyncio.ensure_future(self.link.replica_lost(replica, sent_s)) if first else None
            if lost is not None:
                racing.add(lost)
            try:
                done, _ = await asyncio.wait(racing, timeout=self.link.reply_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for f in racing - {nxt}:
                    f.cancel()
                if not nxt.done():
                    nxt.cancel()
            if ended in done:
                yield ended.result()
                return
            if nxt in done:
                try:
                    batch = nxt.result()
                except StopAsyncIteration:
                    return
                first = False
                for ev in batch:
                    yield ev
                continue
            if lost in done:
                raise _Retry(f"replica {replica.name} failed other requests or its instance exited", fault=False)
            yield self._error("reply_timeout", f"no reply from replica {replica.name} for "
                                               f"{self.link.reply_timeout_s:g} s; the request was cancelled")
            return

    def _error(self, code: str, message: str) -> dict:
        return {"type": "error", "id": self.rid, "code": code, "message": message}

    def _cancel_call(self) -> None:
        """Stop reading the replica: its request is cancelled at its instance if it still runs."""
        if self._call is not None:
            self._call.cancel()  # the replica's generator ends: it cancels the request at its instance
            self._call = None
        if self._direct is not None:
            link, stream = self._direct
            stream.cancel()  # nothing once it has ended
            link.forget(stream)
            self._direct = None

    def cancel(self) -> None:
        """Stop this request at its replica (once); a ``done`` with ``cancelled`` follows (read
        directly, the instance's own; through Ray, made here when the stream ends)."""
        if not self.finished and not self.cancel_sent:
            self.cancel_sent = True
            if self._direct is not None:
                self._direct[1].cancel()  # the instance answers with its ``done``
            else:
                self._cancel_call()

    def end(self, code: str, message: str) -> None:
        self._ended.put_nowait(self._error(code, message))


class ClusterLink(StreamTable):
    """The gateway link of a cluster ingress: its replicas, their status (polled each
    ``STATUS_INTERVAL_S``), the router, and the requests being read."""

    def __init__(self, replicas: Sequence[tuple[str, Any]], reply_timeout_s: float,
                 router: PrefixRouter | None = None, registry=None, direct: bool = True) -> None:
        """``direct``: read the replies of the replicas on this node from their instances
        themselves (``ReplicaView.direct``); False: every reply through Ray."""
        self.replicas = {name: ReplicaView(name, handle) for name, handle in replicas}
        self.reply_timeout_s = reply_timeout_s
        self.direct = direct
        self.node = socket.gethostname()
        self.router = router or PrefixRouter()
        self.history: deque[dict] = deque(maxlen=HISTORY_S)
        self.started_s = time.monotonic()
        self._ids = itertools.count()
        self._streams: dict[str, ClusterStream] = {}
        self._tasks: list[asyncio.Task] = []
        if registry is not None:
            registry.register(ClusterCollector(self))

    def start(self) -> None:
        """One status poll per replica (a slow or dead one delays no other), and the history."""
        self._tasks = [asyncio.create_task(self._poll(r)) for r in self.replicas.values()]
        self._tasks.append(asyncio.create_task(self._keep_history()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for stream in list(self._streams.values()):
            stream.cancel()
        for r in self.replicas.values():
            await self._set_direct(r, None)

    # -- requests --------------------------------------------------------------------------
    def submit(self, request: dict) -> ClusterStream:
        """Checks the frame as ``PipelineLink.submit`` does (FrameRefused, FrameTooLarge), and
        PipelineGone when no replica is ready; the replica is chosen when the stream is read."""
        rid = f"cl-{next(self._ids)}"
        generate_frame(rid, request)
        if not any(r.ready for r in self.replicas.values()):
            raise PipelineGone("no replica of the cluster is ready (`ntxctl cluster status` shows why)")
        stream = self._streams[rid] = ClusterStream(self, rid, request)
        return stream

    def route(self, key: str, exclude: set[str], reason: str | None = None) -> ReplicaView | None:
        """The replica for a request of ``key``, not one of ``exclude``; None if none is ready."""
        candidates = [Candidate(r.name, r.in_flight) for r in self.replicas.values()
                      if r.ready and r.name not in exclude]
        choice = self.router.choose(key, candidates)
        if choice is None:
            return None
        replica = self.replicas[choice.name]
        replica.routed[reason or choice.reason] += 1
        return replica

    def end_all(self, code: str, message: str, cancel: bool = True) -> None:
        for stream in list(self._streams.values()):
            if not stream.finished:
                if cancel:
                    stream.cancel()
                stream.end(code, message)

    @staticmethod
    async def replica_lost(replica: ReplicaView, since_s: float) -> None:
        """Returns once there is evidence since ``since_s`` that ``replica`` will not answer
        (``ReplicaView.lost_since``), looked at every ``LOST_CHECK_S``."""
        while not replica.lost_since(since_s):
            await asyncio.sleep(LOST_CHECK_S)

    # -- status ----------------------------------------------------------------------------
    async def _ask(self, replica: ReplicaView) -> None:
        try:
            report = await asyncio.wait_for(replica.handle.status.remote(), STATUS_CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - dead, restarting or slow: no answer this time
            return
        replica.observe(report)
        on_this_node = report.get("node") == self.node and report.get("instance_running", True)
        await self._set_direct(replica, report.get("listen") if self.direct and on_this_node else None)
        st = report.get("status") or {}
        epoch = (st.get("supervisor_pid"), st.get("gen")) if st else None
        if epoch is not None and epoch != replica.epoch:
            if replica.epoch is not None:
                replica.restarts += epoch[0] != replica.epoch[0]
                self.router.forget_replica(replica.name)
            replica.epoch = epoch

    async def _set_direct(self, replica: ReplicaView, listen: str | None) -> None:
        """Read ``replica``'s replies from its instance at ``listen`` from now on (None: through
        Ray). A replica restarted by Serve has a new instance on a new port: the old link goes
        (its requests got ``pipeline_lost`` when its connection dropped)."""
        old = replica.direct
        if old is not None and listen and old.address == connect_address(listen):
            return
        replica.direct = None
        if old is not None:  # its readers get their error now, whether or not the drop was seen yet
            old.end_all("pipeline_lost", f"the connection to replica {replica.name}'s instance was closed (it "
                                         "exited or was restarted); the request was not finished", cancel=False)
            await old.close()
        if listen:
            replica.direct = PipelineLink(listen, self.reply_timeout_s)
            replica.direct.start(poll_status=False)

    async def _poll(self, replica: ReplicaView) -> None:
        while True:
            await self._ask(replica)
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def _keep_history(self) -> None:
        """The status page's last minute, one sample per interval."""
        while True:
            st = self.fresh_status
            if st is not None:
                self.history.append({"t": round(time.time(), 3), "tokens_per_s": st.get("tokens_per_s", 0.0),
                                     "in_flight": self.in_flight, "stages": {}})
            await asyncio.sleep(STATUS_INTERVAL_S)

    @property
    def fresh_status(self) -> dict | None:
        """The cluster as one pipeline's status for the gateway's routes: ready when any replica
        is, the model, tokens/s and requests summed; None when no replica answers."""
        statuses = [st for st in (r.status for r in self.replicas.values()) if st is not None]
        if not statuses:
            return None
        requests: Counter[str] = Counter()
        for st in statuses:
            requests.update(st.get("requests", {}))
        state = "ready" if any(r.ready for r in self.replicas.values()) else "starting"
        return {"state": state, "model": statuses[0].get("model", ""), "backend": statuses[0].get("backend"),
                "uptime_s": round(time.monotonic() - self.started_s, 3),
                "tokens_per_s": round(sum(st.get("tokens_per_s", 0.0) for st in statuses), 3),
                "tokens_generated": sum(st.get("tokens_generated", 0) for st in statuses),
                "requests": dict(requests), "restarts": sum(st.get("restarts", 0) for st in statuses),
                "replicas": len(self.replicas), "replicas_ready": sum(r.ready for r in self.replicas.values())}

    def cluster_status(self) -> dict:
        """/api/cluster: the cluster, each replica (``ReplicaView.summary``) and the router."""
        return {"status": self.fresh_status, "in_flight": self.in_flight,
                "replicas": [r.summary() for r in self.replicas.values()],
                "router": {"blocks": len(self.router.holders)}}


class ClusterCollector(Collector):
    """Per-replica families for /metrics, beside the gateway's own (ntx_http_*) and the summed
    pipeline ones: what ``ntxctl cluster status`` shows, as Prometheus reads it."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    def collect(self):
        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["replica", *extra])

        ready = gauge("ntx_cluster_replica_ready", "1 when the replica's instance is ready")
        tps = gauge("ntx_cluster_replica_tokens_per_second", "tokens per second the replica's instance generates")
        in_flight = gauge("ntx_cluster_replica_in_flight", "requests the ingress has in flight on the replica")
        queued = gauge("ntx_cluster_replica_queued", "requests queued in the replica's instance")
        hit = gauge("ntx_cluster_replica_prefix_hit_rate", "prompt tokens found in the instance's prefix cache, "
                                                           "of those looked up")
        bottleneck = gauge("ntx_cluster_replica_bottleneck", "1 for the stage the replica's status names the "
                                                             "bottleneck", ["stage"])
        routed = CounterMetricFamily("ntx_cluster_routed_requests", "requests routed to a replica, by reason "
                                     "(prefix, least_loaded, retry)", labels=["replica", "reason"])
        failed = CounterMetricFamily("ntx_cluster_replica_failed_requests", "requests a replica failed (retried "
                                     "elsewhere or ended with an error)", labels=["replica"])
        restarts = CounterMetricFamily("ntx_cluster_replica_restarts", "restarts of the replica's instance or "
                                       "pipeline seen by the ingress", labels=["replica"])
        for r in self.link.replicas.values():
            s = r.summary()
            ready.add_metric([r.name], float(s["ready"]))
            tps.add_metric([r.name], float(s["tokens_per_s"]))
            in_flight.add_metric([r.name], float(s["in_flight"]))
            queued.add_metric([r.name], float(s["queued"]))
            if s["prefix_hit_rate"] is not None:
                hit.add_metric([r.name], float(s["prefix_hit_rate"]))
            if s["bottleneck"]:
                bottleneck.add_metric([r.name, str(s["bottleneck"])], 1.0)
            for reason in ("prefix", "least_loaded", "retry"):
                routed.add_metric([r.name, reason], float(r.routed.get(reason, 0)))
            failed.add_metric([r.name], float(r.failed))
            restarts.add_metric([r.name], float(s["restarts"]))
        yield from (ready, tps, in_flight, queued, hit, bottleneck, routed, failed, restarts)
