"""The dma daemon's view of both rings, in one place, with its invariants checked at every step.

A *key* is ``(pass_id, layer)``: one layer of one pass. Compute wants keys (``Want``), the reader
fills host slots with storage-tier keys (``Read`` → ``Filled`` | ``ReadFailed``), dma copies each
wanted key into a device slot (``SlotReady``) and gets the slot back (``SlotFree``).

Host slot (staging buffer in shared memory, owned by dma)::

    FREE --start_read--> READING --read_filled--> FILLED --delivered (after the copy)--> FREE
                            |
                            +--read_failed (key -> failed, answered by LayerError)--> FREE

Device slot (compute's memory; dma only knows whether it holds it)::

    FREE (dma may fill it) --delivered (SlotReady)--> HANDED OUT (key) --device_slot_freed (SlotFree)--> FREE

A wanted key (in compute's order)::

    wanted --(storage tier)--> to_read --> reading --> filled ----+--> delivered (leaves wanted)
                                                  \\--> failed ---+--> LayerError (leaves wanted)
    wanted --(RAM tier)------------------------------------------+--> delivered

Invariants (``check`` tests them all; each transition tests the ones it can break, in O(slots)):

1. every host slot is in exactly one of free / reading / filled;
2. every device slot is either free (at dma) or handed out to compute with exactly one key, so
   device slots handed out never exceed their number;
3. ``wanted`` is in compute's order: strictly increasing keys (passes ascend, layers ascend
   within a pass), and a key is wanted at most once;
4. every key in to_read, reading, filled or failed is wanted (a key leaves ``wanted`` only when
   delivered or answered by LayerError), and is in at most one of them; to_read keeps
   ``wanted``'s order;
5. only the head of ``wanted`` is delivered, so compute receives a pass's layers in order;
6. a ``Filled``/``ReadFailed`` names the slot its ``Read`` handed out, a ``SlotFree`` names a
   handed-out slot and the key it was handed out with.

A violation is a bug in one of the daemons (or a stray message): ``RingViolation`` ends dma with
a fatal error, the supervisor restarts the pipeline, instead of a layer silently landing in the
wrong slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from ntx.shared.errors import NtxError

Key = tuple[int, int]  # (pass_id, layer)


class RingViolation(NtxError):
    """The ring's state broke one of its invariants."""


class RingState:
    """The seven collections of dma's side of the rings and the transitions between them."""

    def __init__(self, n_host_slots: int, n_device_slots: int, is_storage: Callable[[int], bool]) -> None:
        self.n_host = n_host_slots
        self.n_dev = n_device_slots
        self.is_storage = is_storage  # layer -> True when it comes from storage through the reader
        self.free_host: deque[int] = deque(range(n_host_slots))
        self.reading: dict[Key, int] = {}  # key -> host slot being filled by the reader
        self.filled: dict[Key, int] = {}  # key -> FILLED host slot
        self.free_dev: deque[int] = deque(range(n_device_slots))
        self.handed_out: dict[int, Key] = {}  # device slot -> key compute holds it for
        self.wanted: deque[Key] = deque()  # in compute's order
        self.to_read: deque[Key] = deque()  # storage keys wanted, not yet given to the reader
        self.failed: dict[Key, str] = {}  # key -> why its read failed (until it reaches the head)
        self.last_wanted: Key = (-1, -1)

    # -- compute's side -----------------------------------------------------------------------
    def want(self, pass_id: int, layers: Iterable[int]) -> None:
        """``Want``: queue the layers of a pass, in the order compute will run them."""
        for layer in layers:
            key = (pass_id, layer)
            if key <= self.last_wanted:
                raise RingViolation(f"want {key} after {self.last_wanted}: not in compute's order")
            self.last_wanted = key
            self.wanted.append(key)
            if self.is_storage(layer):
                self.to_read.append(key)

    def drop(self, first_pass: int, last_pass: int) -> int:
        """``Drop``: the keys of passes ``first_pass``..``last_pass`` leave ``wanted`` (and
        ``to_read``, ``failed``), except those in a host slot (reading or filled), which keep
        their place and are delivered as usual. Returns how many were dropped."""
        def gone(key: Key) -> bool:
            return first_pass <= key[0] <= last_pass and key not in self.reading and key not in self.filled

        before = len(self.wanted)
        self.wanted = deque(k for k in self.wanted if not gone(k))
        self.to_read = deque(k for k in self.to_read if not gone(k))
        for key in [k for k in self.failed if gone(k)]:
            del self.failed[key]
        return before - len(self.wanted)

    def device_slot_freed(self, slot: int, key: Key) -> None:
        """``SlotFree``: compute is done with ``slot``, which it held for ``key``."""
        held = self.handed_out.pop(slot, None) if 0 <= slot < self.n_dev else None
        if held != key:
            if held is not None:
                self.handed_out[slot] = held
            raise RingViolation(f"slot_free of device slot {slot} for {key}, but dma handed it out for {held}")
        self.free_dev.append(slot)
        self._check_device_slots()

    # -- the reader's side --------------------------------------------------------------------
    def start_read(self) -> tuple[Key, int] | None:
        """The next storage key and the FREE host slot to read it into (now READING), if both."""
        if not (self.to_read and self.free_host):
            return None
        key, slot = self.to_read.popleft(), self.free_host.popleft()
        self.reading[key] = slot
        self._check_host_slots()
        return key, slot

    def read_filled(self, key: Key, slot: int) -> None:
        """``Filled``: READING -> FILLED."""
        self.filled[key] = self._end_read(key, slot)
        self._check_host_slots()

    def read_failed(self, key: Key, slot: int, message: str) -> None:
        """``ReadFailed``: READING -> FREE; the key is answered by LayerError at the head."""
        self.free_host.append(self._end_read(key, slot))
        self.failed[key] = message
        self._check_host_slots()

    def _end_read(self, key: Key, slot: int) -> int:
        if self.reading.get(key) != slot:
            raise RingViolation(f"reader answered {key} in host slot {slot}, but dma gave it host slot {self.reading.get(key)}")
        return self.reading.pop(key)

    # -- delivery, strictly in wanted order ---------------------------------------------------
    @property
    def head(self) -> Key | None:
        return self.wanted[0] if self.wanted else None

    def pop_failed_head(self) -> str | None:
        """If the head's read failed: drop it from ``wanted`` and return why."""
        key = self.head
        if key is None or key not in self.failed:
            return None
        self.wanted.popleft()
        return self.failed.pop(key)

    def head_waits_for(self) -> str | None:
        """What the head waits for: ``"read"`` (a storage layer not filled yet),
        ``"device_slot"`` (every device slot is with compute), or None (deliver it now)."""
        key = self.head
        if key is not None and self.is_storage(key[1]) and key not in self.filled:
            return "read"
        if not self.free_dev:
            return "device_slot"
        return None

    def next_delivery(self) -> tuple[int, int | None]:
        """Where the head goes and comes from: (free device slot, its FILLED host slot or None
        for a RAM-tier layer). Nothing changes until ``delivered``: the copy runs between."""
        if self.head is None or self.head_waits_for() is not None:
            raise RingViolation(f"delivery of {self.head} while it waits for {self.head_waits_for()}")
        return self.free_dev[0], self.filled.get(self.head)

    def delivered(self) -> tuple[Key, int]:
        """The head's copy is done: the device slot goes to compute, the host slot is FREE.
        Returns (key, device slot) for the ``SlotReady``."""
        dslot, hslot = self.next_delivery()
        key = self.wanted.popleft()
        self.free_dev.popleft()
        self.handed_out[dslot] = key
        if hslot is not None:
            del self.filled[key]
            self.free_host.append(hslot)
            self._check_host_slots()
        self._check_device_slots()
        return key, dslot

    # -- invariants ---------------------------------------------------------------------------
    def _check_host_slots(self) -> None:
        """Invariant 1, in O(host slots)."""
        slots = [*self.free_host, *self.reading.values(), *self.filled.values()]
        if len(slots) != self.n_host or set(slots) != set(range(self.n_host)):
            raise RingViolation(
                f"host slots out of place: free {list(self.free_host)}, reading {self.reading}, filled {self.filled}"
            )

    def _check_device_slots(self) -> None:
        """Invariant 2, in O(device slots)."""
        slots = [*self.free_dev, *self.handed_out]
        if len(slots) != self.n_dev or set(slots) != set(range(self.n_dev)):
            raise RingViolation(f"device slots out of place: free {list(self.free_dev)}, handed out {self.handed_out}")

    def check(self) -> None:
        """Every invariant, in O(wanted) (tests; each transition checks what it can break)."""
        self._check_host_slots()
        self._check_device_slots()
        wanted = list(self.wanted)
        if any(a >= b for a, b in zip(wanted, wanted[1:])):
            raise RingViolation(f"wanted is not in compute's order: {wanted}")
        places = [list(self.to_read), list(self.reading), list(self.filled), list(self.failed)]
        seen = [k for place in places for k in place]
        if len(seen) != len(set(seen)) or not set(seen) <= set(wanted):
            raise RingViolation(f"a key is in two places or not wanted: {places}, wanted {wanted}")
        if list(self.to_read) != sorted(self.to_read):
            raise RingViolation(f"to_read is not in wanted order: {list(self.to_read)}")
