"""The stage clocks and the bottleneck rule."""

from __future__ import annotations

import time

from ntx.shared.stats import StageClock, bottleneck, summarize


def _snap(busy: float, starved: float, blocked: float, nbytes: float) -> dict:
    return {"total": summarize({"busy": busy, "starved": starved, "blocked": blocked, "idle": 0.0, "bytes": nbytes})}


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


def test_recent_passes_exclude_the_running_one_and_drive_the_bottleneck():
    c = StageClock("x")
    for p in range(3):
        c.enter("busy", p)
        time.sleep(0.01)
        c.add_bytes(100, p)
        c.enter("starved", p)
        time.sleep(0.03)
    rec = c.snapshot()["recent"]
    assert rec["n_passes"] == 2 and rec["bytes"] == 200  # pass 2 is still running
    assert rec["starved_share"] > rec["busy_share"] > 0
    # A stage whose totals are dominated by a slow first pass (compile, graph capture, a long
    # prefill) but that waits in its recent passes is not the bottleneck: the one busy now is.
    stages = {
        "compute": {"total": summarize({"busy": 9.0, "starved": 1.0, "blocked": 0.0, "idle": 0.0, "bytes": 1e9}),
                    "recent": summarize({"busy": 0.1, "starved": 0.9, "blocked": 0.0, "idle": 0.0, "bytes": 1e9})},
        "dma": {"total": summarize({"busy": 4.0, "starved": 0.0, "blocked": 6.0, "idle": 0.0, "bytes": 1e9}),
                "recent": summarize({"busy": 0.95, "starved": 0.0, "blocked": 0.05, "idle": 0.0, "bytes": 1e9})},
    }
    assert bottleneck(stages) == "dma"
    stages["dma"].pop("recent")
    stages["compute"].pop("recent")
    assert bottleneck(stages) == "compute"  # no passes yet: the totals decide


def test_the_busiest_stage_is_the_bottleneck():
    # the cpu backend: compute dequantizes every streamed layer and never waits
    stages = {"reader": _snap(0.05, 0.1, 2.0, 1e8), "dma": _snap(0.02, 0.01, 2.0, 1e8),
              "compute": _snap(2.0, 0.02, 0.0, 1e8)}
    assert bottleneck(stages) == "compute"
    assert bottleneck({}) is None
