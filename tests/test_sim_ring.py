"""dev/pipeline/sim_ring.py, the lab's model of one streamed pass through the ring's slots, on
passes whose time is known by hand (its replays of the H200's runs are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("sim_ring", Path(__file__).parents[1] / "dev" / "pipeline" / "sim_ring.py")
sim_ring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_ring)


def test_resident_and_host_layers_add_up():
    assert sim_ring.pass_ms(["vram", "cpu", "vram"], set(), 2, host_ms=5.0, gpu_ms=1.0, copy_ms=9.0) == 7.0


def test_streamed_layers_are_bound_by_the_link_with_enough_slots():
    # four copies of 9 ms back to back; the last layer runs 1 ms after its copy
    assert sim_ring.pass_ms(["ram"] * 4, set(), 4, 0.0, 1.0, 9.0) == pytest.approx(37.0)


def test_a_long_host_layer_leaves_the_link_waiting_for_a_slot():
    """host, then three streamed layers: with two slots the third copy waits for the first
    streamed layer to run (after the 25 ms host layer), so the link idles 7 ms."""
    tiers = ["cpu", "ram", "ram", "ram"]
    two = sim_ring.pass_ms(tiers, set(), 2, host_ms=25.0, gpu_ms=1.0, copy_ms=9.0)
    three = sim_ring.pass_ms(tiers, set(), 3, host_ms=25.0, gpu_ms=1.0, copy_ms=9.0)
    assert three == pytest.approx(28.0) and two == pytest.approx(26.0 + 9.0 + 1.0)
    # the cpu layer streamed instead: four copies, the link never waits
    assert sim_ring.pass_ms(tiers, {0}, 2, 25.0, 1.0, 9.0) == pytest.approx(37.0)
