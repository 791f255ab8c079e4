"""Where each stage's time goes: busy, starved (waiting for an input token), blocked (waiting for
a free slot) or idle (nobody asked for anything), per pass and in total, plus bytes moved.

A stage is always in exactly one state; ``enter`` switches state and charges the time since the
last switch to the old state (and to the pass it was for). ``ntxctl status`` names as bottleneck
the stage with the largest busy share of its non-idle time: in a pipeline the slowest stage is
the one that never waits. It judges by the *recent* passes (the completed ones of the last
``KEEP_PASSES``), not the totals since start: a pass that compiled kernels or captured graphs, or
a long prompt's prefill, would otherwise colour the picture of the decode that follows.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

STATES = ("busy", "starved", "blocked", "idle")
KEEP_PASSES = 32


def _zero() -> dict[str, float]:
    # rows: token rows a pass computed (compute only); prefill_rows: those that were prompt
    return {"busy": 0.0, "starved": 0.0, "blocked": 0.0, "idle": 0.0, "bytes": 0.0, "rows": 0.0, "prefill_rows": 0.0}


class StageClock:
    """One stage's time, split by state and by pass.

    ``now`` is the clock it reads, in seconds (``time.monotonic`` in the daemons); a test hands it a
    fake one so that the charged times are exact.
    """

    def __init__(self, stage: str, now: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.now = now
        self.state = "idle"
        self.pass_id: int | None = None
        self.since_s = now()
        self.started_s = self.since_s
        self.total = _zero()
        self.passes: OrderedDict[int, dict[str, float]] = OrderedDict()
        self.extra: dict[str, object] = {}
        self.layer_moves: dict[int, int] = {}  # layer -> times its bytes were moved (read, copied)

    def _charge(self, now_s: float) -> None:
        dt = now_s - self.since_s
        self.total[self.state] += dt
        if self.pass_id is not None and self.state != "idle":
            self._pass(self.pass_id)[self.state] += dt
        self.since_s = now_s

    def _pass(self, pass_id: int) -> dict[str, float]:
        p = self.passes.get(pass_id)
        if p is None:
            p = self.passes[pass_id] = _zero()
            while len(self.passes) > KEEP_PASSES:
                self.passes.popitem(last=False)
        return p

    def enter(self, state: str, pass_id: int | None = None) -> None:
        """Switch to ``state`` (working on / waiting for ``pass_id``)."""
        self._charge(self.now())
        self.state = state
        self.pass_id = pass_id

    def rename_pass(self, old: int, new: int) -> None:
        """Pass ``old`` goes on as ``new`` (a stream gave up the id it had asked for and runs the
        pass under a fresh one): what was charged to it so far is ``new``'s."""
        p = self.passes.pop(old, None)
        if p is not None:
            mine = self._pass(new)
            for k, v in p.items():
                mine[k] += v
        if self.pass_id == old:
            self.pass_id = new

    def add_bytes(self, n: int, pass_id: int | None = None, layer: int | None = None) -> None:
        """``n`` bytes moved for ``pass_id``; naming the ``layer`` counts it in ``layer_moves``
        (what status shows: which layers a stage really read or copied, e.g. none skipped)."""
        if layer is not None:
            self.layer_moves[layer] = self.layer_moves.get(layer, 0) + 1
        self.total["bytes"] += n
        if pass_id is not None:
            self._pass(pass_id)["bytes"] += n

    def add_rows(self, pass_id: int, rows: int, prefill_rows: int) -> None:
        """What the pass computed: ``rows`` token rows, ``prefill_rows`` of them prompt tokens
        (so readers can tell decode passes from prefill ones)."""
        for t in (self.total, self._pass(pass_id)):
            t["rows"] += rows
            t["prefill_rows"] += prefill_rows

    def snapshot(self) -> dict:
        """A msgpack-able summary: totals, shares of non-idle time, GB/s, recent passes."""
        now_s = self.now()
        self._charge(now_s)
        return {
            "stage": self.stage,
            "state": self.state,
            "total": summarize(self.total),
            "passes": {str(k): summarize(v) for k, v in self.passes.items()},
            "recent": self.recent(),
            "uptime_s": now_s - self.started_s,
            "layer_moves": {str(k): v for k, v in sorted(self.layer_moves.items())},
            **self.extra,
        }

    def recent(self) -> dict:
        """Summary over the kept passes except the newest (which may still be running)."""
        done = list(self.passes.values())[:-1]
        out = summarize(combine(done))
        out["n_passes"] = len(done)
        return out


def combine(parts) -> dict[str, float]:
    """Sum per-pass (or summarized) clock dicts into one raw dict for ``summarize``."""
    t = _zero()
    for p in parts:
        for k in t:
            t[k] += p.get(k, 0.0)
    return t


def summarize(t: dict[str, float]) -> dict[str, float]:
    active = t["busy"] + t["starved"] + t["blocked"]
    out = {k: round(t[k], 6) for k in STATES}
    out["bytes"] = int(t["bytes"])
    out["rows"] = int(t.get("rows", 0))
    out["prefill_rows"] = int(t.get("prefill_rows", 0))
    for k in ("busy", "starved", "blocked"):
        out[f"{k}_share"] = round(t[k] / active, 4) if active > 0 else 0.0
    # GB/s while busy (the stage's own speed) and over its active time (what it delivered)
    out["busy_gbps"] = round(t["bytes"] / t["busy"] / 1e9, 3) if t["busy"] > 0 else 0.0
    out["active_gbps"] = round(t["bytes"] / active / 1e9, 3) if active > 0 else 0.0
    return out


def window(snap: dict) -> dict:
    """The summary a stage is judged by: its recent passes when they hold any work, else its
    totals since start (a stage that never worked on a pass, or a snapshot without passes)."""
    rec = snap.get("recent") or {}
    if rec.get("busy", 0.0) > 0:
        return rec
    return snap.get("total", {})


def bottleneck(stages: dict[str, dict]) -> str | None:
    """The stage with the largest busy share of its recent active time (see ``window``), or
    None before any work."""
    best, best_p = None, -1.0
    for name, snap in stages.items():
        w = window(snap)
        if w.get("busy", 0.0) <= 0:
            continue
        if w["busy_share"] > best_p:
            best, best_p = name, w["busy_share"]
    return best
