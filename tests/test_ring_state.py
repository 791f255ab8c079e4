"""dma's ring state (daemons/dma/ring_state.py) driven through a pass by hand, as the dma daemon
drives it from its messages: wants, reads (one of them failing), copies into device slots,
slots coming back; the invariants hold after every step, and a broken step is caught."""

from __future__ import annotations

import pytest

from ntx.daemons.dma.ring_state import RingState, RingViolation

STORAGE_LAYERS = {2, 3, 4}  # layers 0-1 resident (not streamed), 5 in the pinned-RAM tier


def new_ring(n_host: int = 2, n_dev: int = 2) -> RingState:
    return RingState(n_host, n_dev, lambda layer: layer in STORAGE_LAYERS)


def deliver_all(ring: RingState) -> list[tuple]:
    """What dma's ``deliver`` sends, without the copies: ("ready", key, slot) / ("error", key, why)."""
    sent = []
    while ring.head is not None:
        key = ring.head
        failure = ring.pop_failed_head()
        if failure is not None:
            sent.append(("error", key, failure))
            continue
        if ring.head_waits_for() is not None:
            break
        ring.next_delivery()  # (the copy runs here)
        sent.append(("ready", *ring.delivered()))
        ring.check()
    return sent


def test_a_pass_with_a_read_error_keeps_every_invariant():
    ring = new_ring()
    ring.want(0, [2, 3, 4, 5])
    ring.check()
    # dma hands both host slots to the reader; the third storage layer waits for one
    assert ring.start_read() == ((0, 2), 0)
    assert ring.start_read() == ((0, 3), 1)
    assert ring.start_read() is None
    ring.check()
    assert ring.head_waits_for() == "read"  # starved: layer 2 is still being read

    ring.read_filled((0, 2), 0)
    ring.read_failed((0, 3), 1, "EIO")  # the slot comes back unfilled
    ring.check()
    assert ring.start_read() == ((0, 4), 1)
    sent = deliver_all(ring)
    # layer 2 goes to device slot 0, layer 3 is answered by an error, layer 4 is not read yet
    assert sent == [("ready", (0, 2), 0), ("error", (0, 3), "EIO")]
    assert ring.head == (0, 4) and ring.head_waits_for() == "read"
    ring.read_filled((0, 4), 1)
    assert deliver_all(ring) == [("ready", (0, 4), 1)]
    # layer 5 (pinned RAM) needs no read, but both device slots are with compute: blocked
    assert ring.head == (0, 5) and ring.head_waits_for() == "device_slot"

    ring.device_slot_freed(0, (0, 2))
    assert deliver_all(ring) == [("ready", (0, 5), 0)]
    ring.device_slot_freed(1, (0, 4))
    ring.device_slot_freed(0, (0, 5))
    ring.check()
    assert not ring.wanted and not ring.failed
    assert sorted(ring.free_host) == [0, 1] and sorted(ring.free_dev) == [0, 1]


def test_the_next_pass_is_read_ahead_while_this_one_runs():
    ring = new_ring(n_host=2, n_dev=1)
    ring.want(0, [2, 3])
    ring.want(1, [2, 3])
    while ring.start_read():
        pass
    ring.read_filled((0, 2), 0)
    ring.read_filled((0, 3), 1)
    assert deliver_all(ring) == [("ready", (0, 2), 0)]
    assert ring.head_waits_for() == "device_slot"
    ring.device_slot_freed(0, (0, 2))
    assert deliver_all(ring) == [("ready", (0, 3), 0)]
    # each host slot went back to FREE when its copy was done: pass 1's reads start
    assert ring.start_read() == ((1, 2), 0)
    assert ring.start_read() == ((1, 3), 1)
    ring.check()


def test_a_dropped_pass_is_not_copied_but_what_sits_in_host_slots_is_delivered():
    """``Drop`` (compute gave passes up): their keys leave the queue, except one being read or
    read already, which holds a host slot and is delivered as usual (compute frees it at once);
    the passes asked after it come next, and every invariant holds."""
    ring = new_ring(n_host=2, n_dev=1)
    ring.want(0, [2, 3, 4, 5])
    ring.want(1, [2, 3, 4, 5])
    assert ring.start_read() == ((0, 2), 0) and ring.start_read() == ((0, 3), 1)
    ring.read_filled((0, 2), 0)
    assert deliver_all(ring) == [("ready", (0, 2), 0)]
    ring.read_filled((0, 3), 1)
    assert ring.drop(0, 1) == 6  # (0, 4) (0, 5) and pass 1's four; (0, 3) is in a host slot
    ring.check()
    assert list(ring.wanted) == [(0, 3)] and not ring.to_read
    ring.want(2, [5])
    ring.device_slot_freed(0, (0, 2))
    assert deliver_all(ring) == [("ready", (0, 3), 0)]
    ring.device_slot_freed(0, (0, 3))
    assert deliver_all(ring) == [("ready", (2, 5), 0)]
    assert sorted(ring.free_host) == [0, 1]
    ring.check()


@pytest.mark.parametrize(
    "break_it, needle",
    [
        # compute wants a pass again, or out of order
        (lambda r: r.want(0, [2]), "not in compute's order"),
        (lambda r: r.want(1, [4, 3]), "not in compute's order"),
        # the reader answers with a slot it was not given, or for a key it was not asked for
        (lambda r: r.read_filled((0, 2), 1), "host slot 1"),
        (lambda r: r.read_failed((0, 5), 0, "x"), "host slot 0"),
        # compute frees a slot it does not hold, or names another layer than it was given
        (lambda r: r.device_slot_freed(1, (0, 2)), "device slot 1"),
        (lambda r: r.device_slot_freed(0, (0, 3)), "device slot 0"),
        (lambda r: r.device_slot_freed(7, (0, 2)), "device slot 7"),
        # delivery of a layer that is not read yet
        (lambda r: (r.device_slot_freed(0, (0, 2)), r.delivered()), "waits for read"),
    ],
)
def test_a_violation_is_caught(break_it, needle):
    ring = new_ring()
    ring.want(0, [2, 3])
    ring.start_read()
    ring.start_read()
    ring.read_filled((0, 2), 0)
    assert deliver_all(ring) == [("ready", (0, 2), 0)]  # device slot 0 holds (0, 2); (0, 3) is reading
    with pytest.raises(RingViolation) as err:
        break_it(ring)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_check_finds_a_slot_out_of_place():
    ring = new_ring()
    ring.want(0, [2])
    ring.start_read()
    ring.free_host.append(0)  # slot 0 is READING and FREE at once
    with pytest.raises(RingViolation, match="host slots out of place"):
        ring.check()
