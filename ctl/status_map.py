"""The instance's status map: what ``ntxctl status``, the ``status`` op and the gateway show.

It is built on demand from what the other roles hold — the plan, the pipeline's generation and
its daemons' last ``Stats`` (``ctl/generations.py``), the requests in flight and queued
(``ctl/admission.py``) — so nothing keeps a second copy of it. Connections from elsewhere than
this machine get it without what only operators see (paths, pids, the listen and HTTP
addresses, the log folder, the reason of a failure): ``OPERATOR_STATUS_FIELDS``, and each daemon's ``pid``. docs/PROTOCOL.md
(status) describes every field.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ntx.ctl.admission import Admission
from ntx.ctl.generations import GatewayProcess, Generations
from ntx.shared.config import InstanceConfig, InstancePaths
from ntx.shared.plan import RAM, Plan
from ntx.shared.stats import bottleneck

# Status fields only operators see (connections from this machine; ntxctl status)
OPERATOR_STATUS_FIELDS = ("model", "listen", "supervisor_pid", "reason", "log_dir", "http")
# The status lists at most this many requests in flight, the oldest first (``requests.in_flight``
# counts them all), so that a map stays small while a thousand wait in the queue.
LISTED_REQUESTS = 64
# A status map is built again at most this often: a flood of status requests costs a copy each,
# not a build (about 0.3 ms) each. Daemons report every 0.5 s, so it is no staler than they are;
# what the supervisor holds itself (the state, the requests in flight) is never stale: a change
# of either builds a new map (``InstanceStatus.build``).
STATUS_REUSE_S = 0.1


@dataclass(eq=False)
class InstanceStatus:
    """The status map of one instance (``build``), from the roles that hold its parts."""

    cfg: InstanceConfig
    plan: Plan
    paths: InstancePaths
    gens: Generations
    admission: Admission
    gateway: GatewayProcess
    started_s: float = field(default_factory=time.monotonic)
    # operator -> (when, the state, generation and admission changes then, the map)
    built: dict[bool, tuple[float, tuple[str, int, int], dict[str, Any]]] = field(default_factory=dict)

    def build(self, operator: bool = True) -> dict[str, Any]:
        """The status map; without ``operator``, less what only operators see (paths, pids).
        The map built less than ``STATUS_REUSE_S`` ago is reused while the state, the generation
        and the requests in flight are the same (callers must not change it)."""
        now = time.monotonic()
        life = (self.gens.state, self.gens.gen, self.admission.changes)
        when_s, was, st = self.built.get(operator, (float("-inf"), life, {}))
        if now - when_s < STATUS_REUSE_S and was == life:
            return st
        st = self._build(now, operator)
        self.built[operator] = (now, life, st)
        return st

    def _build(self, now: float, operator: bool) -> dict[str, Any]:
        gens, stats = self.gens, self.gens.stage_stats
        compute = stats.get("compute", {})
        stages = {n: s for n, s in stats.items() if "total" in s}
        st = {
            "instance": self.cfg.name, "state": gens.state, "reason": gens.reason, "gen": gens.gen,
            "model": self.cfg.model, "backend": self.cfg.backend, "listen": self.cfg.listen,
            "kernels": self.cfg.kernel_options.describe(),
            "uptime_s": round(now - self.started_s, 3), "restarts": gens.restarts,
            "supervisor_pid": os.getpid(), "log_dir": str(self.paths.log_dir),
            "http": self.cfg.http if self.gateway.running else None,
            "plan": {**self.plan.to_dict(), "lines": self.plan.describe(), "tier_rows": self.plan.tier_rows()},
            "daemons": {
                n: {**({"pid": d.proc.pid} if operator else {}), "state": d.state,
                    "uptime_s": round(now - d.started_s, 3), "restarts": gens.restarts,
                    "silent_s": round(d.silent_s(now), 3) if d.heard_s else None}
                for n, d in gens.daemons.items()
            },
            "stalled": gens.stalled,
            "stages": stages,
            "bottleneck": bottleneck(stages),
            "requests": {
                "active": len(compute.get("active", [])),
                "queued": len(compute.get("queued", [])) + len(self.admission.pending),
                "in_flight": len(self.admission.inflight),
            },
            "requests_in_flight": request_rows(self.admission, set(compute.get("queued", [])), now),
            "tokens_per_s": compute.get("tokens_per_s", 0.0),
            "tokens_generated": compute.get("tokens_generated", 0),
            "speculation": compute.get("speculation"),
            "kv": compute.get("kv"),
            "slots": {
                "n_slots": self.plan.n_slots, "slot_bytes": self.plan.slot_bytes,
                "host": stats.get("dma", {}).get("host_slots"),
                "device_free_at_dma": stats.get("dma", {}).get("device_slots_free_seen"),
            },
            "io": {k: stats.get("reader", {}).get(k) for k in ("io_mode", "io_fallback")},
            "ram_tier_layers": len(self.plan.layers_on(RAM)),
        }
        if not operator:
            for key in OPERATOR_STATUS_FIELDS:
                del st[key]
        return st


def request_rows(admission: Admission, compute_queued: set[str], now_s: float) -> list[dict[str, Any]]:
    """The oldest ``LISTED_REQUESTS`` requests in flight, each as its internal id, its state,
    its prompt and generated token counts so far, its ``max_tokens`` and its age. The state is
    ``queued`` (at the supervisor, or at compute waiting for a row or KV pages: compute's last
    ``Stats`` say which), ``cancelling``, ``decoding`` (tokens came back) or else ``prefill``."""
    rows = []
    for rid, flight in itertools.islice(admission.inflight.items(), LISTED_REQUESTS):
        n_tokens = len(flight.out.tokens)
        if rid in admission.pending or rid in compute_queued:
            state = "queued"
        elif rid in admission.cancel_sent:
            state = "cancelling"
        else:
            state = "decoding" if n_tokens else "prefill"
        rows.append({"id": rid, "state": state, "prompt_tokens": len(flight.out.req.prompt_tokens),
                     "tokens": n_tokens, "max_tokens": flight.out.req.params.max_tokens,
                     "age_s": round(now_s - flight.admitted_s, 3)})
    return rows
