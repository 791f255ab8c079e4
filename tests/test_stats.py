"""The stage clocks and the bottleneck rule."""

from __future__ import annotations

from ntx.shared.stats import StageClock, bottleneck, summarize


class FakeClock:
    """A clock (seconds) that moves only when the test says so, so charged times are exact."""

    def __init__(self, start_s: float = 100.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def _snap(busy: float, starved: float, blocked: float, nbytes: float) -> dict:
    return {"total": summarize({"busy": busy, "starved": starved, "blocked": blocked, "idle": 0.0, "bytes": nbytes})}


def test_clock_charges_time_to_states_and_passes():
    clock = FakeClock()
    c = StageClock("x", now=clock)
    clock.advance(1.0)  # idle before the first pass
    c.enter("busy", 1)
    clock.advance(0.5)
    c.add_bytes(10**9, 1)
    c.enter("starved", 1)
    clock.advance(0.25)
    c.enter("idle")
    clock.advance(0.125)
    snap = c.snapshot()
    assert snap["state"] == "idle" and snap["uptime_s"] == 1.875
    t = snap["total"]
    assert (t["busy"], t["starved"], t["blocked"], t["idle"]) == (0.5, 0.25, 0.0, 1.125)
    assert (t["busy_share"], t["starved_share"]) == (0.6667, 0.3333)  # idle is not active time
    assert t["busy_gbps"] == 2.0 and t["active_gbps"] == 1.333  # 1 GB in 0.5 s busy, 0.75 s active
    p1 = snap["passes"]["1"]
    assert (p1["busy"], p1["starved"], p1["idle"], p1["bytes"]) == (0.5, 0.25, 0.0, 10**9)


def test_a_pass_renamed_keeps_what_was_charged_to_it():
    """A stream that gave up the pass id it had asked for runs the pass under a fresh one
    (``rename_pass``): the time charged so far and what follows are the new id's, none the old's."""
    clock = FakeClock()
    c = StageClock("compute", now=clock)
    c.enter("busy", 4)
    clock.advance(0.25)
    c.rename_pass(4, 6)
    clock.advance(0.5)
    c.enter("starved", 6)
    clock.advance(0.125)
    c.add_rows(6, 9, 0)
    c.enter("idle")
    passes = c.snapshot()["passes"]
    assert "4" not in passes and (passes["6"]["busy"], passes["6"]["starved"], passes["6"]["rows"]) == (0.75, 0.125, 9)
    c.rename_pass(7, 8)  # a pass nothing was charged to: nothing to move
    assert "8" not in c.snapshot()["passes"]


def test_recent_passes_exclude_the_running_one_and_drive_the_bottleneck():
    clock = FakeClock()
    c = StageClock("x", now=clock)
    for p in range(3):
        c.enter("busy", p)
        clock.advance(0.25)
        c.add_bytes(100, p)
        c.enter("starved", p)
        clock.advance(0.75)
    rec = c.snapshot()["recent"]
    assert rec["n_passes"] == 2 and rec["bytes"] == 200  # pass 2 is still running
    assert (rec["busy"], rec["starved"], rec["busy_share"], rec["starved_share"]) == (0.5, 1.5, 0.25, 0.75)
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
