"""Compute's end of the device ring against a scripted dma on a real ZeroMQ pair: layers arrive
in order, go back as SlotFree, a failed pass is aborted, and a broken contract stops compute."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import zmq

from ntx.daemons.compute.ring_stream import LayerUnavailable, RingProtocolError, RingStream
from ntx.shared import messages as m
from ntx.shared.stats import StageClock


@pytest.fixture
def ring():
    ctx = zmq.Context.instance()
    addr = f"inproc://ring-{uuid.uuid4().hex}"
    compute, dma = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    compute.bind(addr)
    dma.connect(addr)
    slots = [np.full(16, i, dtype=np.uint8) for i in range(2)]
    stream = RingStream(compute, slots, [2, 3], {i: 16 for i in range(5)}, StageClock("compute"))
    yield stream, dma
    compute.close(linger=0)
    dma.close(linger=0)


def _from_compute(dma) -> list[m.Message]:
    out = []
    while dma.poll(200):
        out.append(m.COMPUTE_TO_DMA.decode(dma.recv()))
    return out


def test_a_pass_wants_ahead_receives_in_order_and_frees(ring):
    stream, dma = ring
    assert stream.n_slots == 2  # what the cpu tier's share is weighed with (plan.ring_pass_s)
    stream.begin_pass(0)
    assert _from_compute(dma) == [m.Want(pass_id=0, layers=[2, 3]), m.Want(pass_id=1, layers=[2, 3])]
    dma.send(m.SlotReady(slot=1, layer=2, pass_id=0).encode())
    assert stream.acquire(2, 0)[0] == 1  # slot 1's buffer
    stream.release(2, 0)
    assert _from_compute(dma) == [m.SlotFree(slot=1, layer=2, pass_id=0)]


def test_a_failed_layer_aborts_the_pass_and_its_prefetch(ring):
    stream, dma = ring
    stream.begin_pass(0)
    _from_compute(dma)
    dma.send(m.LayerError(layer=2, pass_id=0, message="read failed").encode())
    dma.send(m.SlotReady(slot=0, layer=3, pass_id=0).encode())
    with pytest.raises(LayerUnavailable, match="layer 2 could not be loaded: read failed"):
        stream.acquire(2, 0)
    assert stream.abort_pass(0) == 2  # passes 0 and 1 were wanted: 2 is the first fresh one
    # dma copies no more of theirs, and the ready slot went back at once
    assert _from_compute(dma) == [m.Drop(first_pass=0, last_pass=1), m.SlotFree(slot=0, layer=3, pass_id=0)]
    stream.begin_pass(2)
    dma.send(m.SlotReady(slot=1, layer=2, pass_id=1).encode())  # an aborted pass's late token
    dma.send(m.SlotReady(slot=0, layer=2, pass_id=2).encode())
    assert stream.acquire(2, 2)[0] == 0
    got = _from_compute(dma)
    assert m.SlotFree(slot=1, layer=2, pass_id=1) in got and m.Want(pass_id=3, layers=[2, 3]) in got


@pytest.mark.parametrize("second", [m.SlotReady(slot=0, layer=3, pass_id=0), m.SlotReady(slot=1, layer=2, pass_id=0)])
def test_a_slot_or_key_handed_out_twice_stops_compute(ring, second):
    stream, dma = ring
    stream.begin_pass(0)
    dma.send(m.SlotReady(slot=0, layer=2, pass_id=0).encode())
    dma.send(second.encode())
    with pytest.raises(RingProtocolError):
        stream.acquire(3, 0)


def test_a_changed_layer_list_applies_from_the_first_pass_not_yet_wanted(ring):
    """A demotion (or promotion) changes what is streamed only for passes dma has not been asked
    for yet: passes 0 and 1 keep [2, 3], pass 2 on streams [1, 2, 3]."""
    stream, dma = ring
    stream.begin_pass(0)
    assert stream.set_layers([1, 2, 3]) == 2
    assert stream.layers_for(0) == stream.layers_for(1) == [2, 3]
    assert stream.layers_for(2) == [1, 2, 3]
    stream.begin_pass(1)
    assert _from_compute(dma) == [m.Want(pass_id=0, layers=[2, 3]), m.Want(pass_id=1, layers=[2, 3]),
                                  m.Want(pass_id=2, layers=[1, 2, 3])]
    assert stream.set_layers([2, 3]) == 3  # promoted back: from pass 3 on
    stream.begin_pass(2)
    assert stream.layers_for(2) == [1, 2, 3] and stream.layers_for(3) == [2, 3]
    stream.begin_pass(3)
    assert _from_compute(dma) == [m.Want(pass_id=3, layers=[2, 3]), m.Want(pass_id=4, layers=[2, 3])]
    with pytest.raises(ValueError, match="older than every layer list"):
        stream.layers_for(2)  # forgotten: passes run one after another, and pass 3 has begun


def test_a_wide_pass_streams_the_cpu_tiers_layers_and_a_change_of_width_is_asked_anew(ring):
    """The next pass is asked with the tier layers of the one beginning; where the guess was
    wrong, the passes asked are given up (their slots go back as they arrive) and the pass runs
    under the first fresh id, asked anew with its own list: the cpu tier's layers it takes (1, 4,
    or one of them) among the streamed ones in layer order."""
    stream, dma = ring
    stream.wide_layers = [1, 4]
    assert stream.begin_pass(0) == 0  # narrow, and 1 asked as narrow
    assert _from_compute(dma) == [m.Want(pass_id=0, layers=[2, 3]), m.Want(pass_id=1, layers=[2, 3])]
    dma.send(m.SlotReady(slot=0, layer=2, pass_id=1).encode())  # dma copied ahead for pass 1
    assert stream.begin_pass(1, tier_layers=[1, 4]) == 2  # a prompt arrived: 1 given up, 2 asked wide, 3 too
    assert stream.layers_for(2) == [1, 2, 3, 4] and stream.layers_for(3) == [1, 2, 3, 4]
    assert _from_compute(dma) == [m.Drop(first_pass=1, last_pass=1), m.Want(pass_id=2, layers=[1, 2, 3, 4]),
                                  m.Want(pass_id=3, layers=[1, 2, 3, 4])]
    stream.poll()  # the late token of pass 1 goes straight back
    assert _from_compute(dma) == [m.SlotFree(slot=0, layer=2, pass_id=1)]
    dma.send(m.SlotReady(slot=1, layer=1, pass_id=2).encode())
    assert stream.acquire(1, 2)[0] == 1
    stream.release(1, 2)
    assert stream.begin_pass(3, tier_layers=[1, 4]) == 3  # guessed right: nothing given up
    assert _from_compute(dma) == [m.SlotFree(slot=1, layer=1, pass_id=2), m.Want(pass_id=4, layers=[1, 2, 3, 4])]
    assert stream.begin_pass(4) == 5  # decode again: narrow from 5 on
    assert stream.layers_for(5) == [2, 3]
    # a pass that streams part of the tier (HostTier.streamed_in: a pass of a few rows) is asked
    # with that part; the next with another part is asked anew
    assert stream.begin_pass(6, tier_layers=[4]) == 7 and stream.layers_for(7) == [2, 3, 4]
    assert stream.layers_for(8) == [2, 3, 4]
    assert stream.begin_pass(8, tier_layers=[1]) == 9 and stream.layers_for(9) == [1, 2, 3]
    stream.wide_layers = []  # no tier (or one that never leaves the host): a share asks nothing more
    assert stream.begin_pass(10, tier_layers=[1, 4]) == 11 and stream.layers_for(11) == [2, 3]


def test_standby_announcements_are_taken_between_passes(ring):
    stream, dma = ring
    dma.send(m.Standby(layers=[0, 4]).encode())
    dma.send(m.Standby(layers=[1]).encode())
    for _ in range(50):
        stream.poll()
        if stream.standby == {0, 1, 4}:
            break
        zmq.Context.instance()  # (the messages cross an inproc pair: a moment at most)
    assert stream.standby == {0, 1, 4}


def test_want_standby_asks_dma_once(ring):
    stream, dma = ring
    stream.want_standby()
    stream.want_standby()
    assert _from_compute(dma) == [m.StandbyWanted()]
