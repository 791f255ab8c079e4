"""The model of one streamed pass through the ring's slots (``plan.ring_pass_s``, which the cpu
tier's share is chosen by) on passes whose time is known by hand, and the lab tool that replays
the H200's runs through it (dev/pipeline/sim_ring.py; the replays are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ntx.shared.plan import GPU, STREAMED, TIER, ring_pass_s

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("sim_ring", ROOT / "dev" / "pipeline" / "sim_ring.py")
sim_ring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_ring)


def test_resident_and_host_layers_add_up():
    assert ring_pass_s([GPU, TIER, GPU], [1.0, 5.0, 1.0], [9.0] * 3, 2) == 7.0


def test_streamed_layers_are_bound_by_the_link_with_enough_slots():
    # four copies of 9 ms back to back; the last layer runs 1 ms after its copy
    assert ring_pass_s([STREAMED] * 4, [1.0] * 4, [9.0] * 4, 4) == pytest.approx(37.0)


def test_a_long_host_layer_leaves_the_link_waiting_for_a_slot():
    """host, then three streamed layers: with two slots the third copy waits for the first
    streamed layer to run (after the 25 ms host layer), so the link idles 7 ms."""
    kinds = [TIER, STREAMED, STREAMED, STREAMED]
    run = [25.0, 1.0, 1.0, 1.0]
    assert ring_pass_s(kinds, run, [9.0] * 4, 3) == pytest.approx(28.0)
    assert ring_pass_s(kinds, run, [9.0] * 4, 2) == pytest.approx(26.0 + 9.0 + 1.0)
    # the cpu layer streamed instead: four copies, the link never waits
    assert ring_pass_s([STREAMED] * 4, [1.0] * 4, [9.0] * 4, 2) == pytest.approx(37.0)


def test_one_slot_copies_each_layer_after_the_last_one_ran():
    # the file stream (one layer read at a time) and a ring said to have none alike
    for slots in (1, 0):
        assert ring_pass_s([STREAMED] * 3, [1.0] * 3, [9.0] * 3, slots) == pytest.approx(30.0)


def test_each_layer_has_its_own_times():
    # a 4 ms copy lands while the 5 ms host layer runs; the second copy (6 ms) waits for no slot
    assert ring_pass_s([TIER, STREAMED, STREAMED], [5.0, 1.0, 2.0], [0.0, 4.0, 6.0], 2) == pytest.approx(12.0)


def test_the_lab_tool_replays_a_runs_plan(capsys):
    """The batch-8 run whose share was learnt (7 of 16 tier layers streamed): 357.3 ms predicted
    for the 368.0 it measured (docs/PERFORMANCE.md)."""
    sim_ring.main(str(ROOT / "docs" / "results" / "bench-70b-tier-share-learnt-b8-h200.json"), 7)
    out = capsys.readouterr().out
    assert "predicted 357.3 ms a pass at 2 slots, measured 368.0" in out
    tiers = ["cpu", "ram", "ram", "ram"]
    assert sim_ring.pass_ms(tiers, set(), 2, host_ms=25.0, gpu_ms=1.0, copy_ms=9.0) == pytest.approx(36.0)
