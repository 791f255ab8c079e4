"""The stage clocks and the bottleneck rule."""

from __future__ import annotations

import time

from ntx.shared.stats import StageClock, bottleneck, pressure, summarize


def _snap(busy: float, starved: float, blocked: float, nbytes: float, limit: float | None = None) -> dict:
    snap = {"total": summarize({"busy": busy, "starved": starved, "blocked": blocked, "idle": 0.0, "bytes": nbytes})}
    if limit is not None:
        snap["limit_gbps"] = limit
    return snap


def test_clock_charges_time_to_states_and_passes():
    c = StageClock("x")
    c.enter("busy", 1)
    time.sleep(0.05)
    c.add_bytes(1000, 1)
    c.enter("starved", 1)
    time.sleep(0.03)
    c.enter("idle")
    time.sleep(0.02)
    snap = c.snapshot()
    t = snap["total"]
    assert 0.04 < t["busy"] < 0.2 and 0.02 < t["starved"] < 0.2 and t["idle"] > 0.01
    assert abs(t["busy_share"] + t["starved_share"] - 1.0) < 1e-3  # idle is not active time
    assert snap["passes"]["1"]["bytes"] == 1000 and snap["passes"]["1"]["idle"] == 0.0


def test_bottleneck_is_the_stage_at_its_limit_not_the_one_that_looks_busy():
    # Figures of the H200 run of a 70B with 38 layers in pinned RAM (docs/PERFORMANCE.md): the copy
    # engine ran at 99% of the link while time-slicing made compute look as busy as dma.
    stages = {
        "dma": _snap(1.068, 0.0, 0.739, 58.69e9, limit=55.37),
        "compute": _snap(1.043, 0.764, 0.0, 58.69e9, limit=3917.0),
    }
    assert pressure(stages["dma"]) > 0.5 > pressure(stages["compute"])
    assert bottleneck(stages) == "dma"


def test_without_limits_the_busiest_stage_is_the_bottleneck():
    # the cpu backend: compute dequantizes every streamed layer and never waits
    stages = {"reader": _snap(0.05, 0.1, 2.0, 1e8), "dma": _snap(0.02, 0.01, 2.0, 1e8, limit=7.0),
              "compute": _snap(2.0, 0.02, 0.0, 1e8)}
    assert bottleneck(stages) == "compute"
    assert bottleneck({}) is None
