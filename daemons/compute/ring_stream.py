"""Compute's end of the device ring: streamed layers arrive as SlotReady tokens, go back as SlotFree.

Compute asks for the streamed layers of a pass ahead of time (``Want``): at the start of pass p
the layers of p and p+1 are wanted, so while the last layers of p run, dma is already copying the
first layers of p+1 and the ring does not run dry between passes. Because every pass wants the
same layers in the same order, a pass that is wanted but not yet run (the engine went idle)
simply waits in its slots until the next request comes.

A layer that cannot be delivered (a read error) arrives as ``LayerError``: ``acquire`` raises
``LayerUnavailable``, the engine fails the requests of that pass, and the rest of the pass's
tokens are handed straight back as they arrive, so the ring keeps turning.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import zmq

from ntx.shared import messages as m
from ntx.shared.daemon import WAIT_SLICE_S, send_patiently
from ntx.shared.errors import NtxError
from ntx.shared.stats import StageClock


class LayerUnavailable(NtxError):
    """A streamed layer could not be brought in for this pass."""


class RingProtocolError(RuntimeError):
    """dma broke the ring's contract (a slot handed out twice, a key delivered twice): a bug,
    so compute stops and the supervisor restarts the pipeline rather than run the wrong bytes."""


class RingStream:
    """Compute's side of the device ring, as the model's ``LayerStream``.

    Each streamed (pass, layer) key is wanted (``Want`` at ``begin_pass``), then ``ready`` (a
    ``SlotReady`` named its device slot), ``held`` (acquired, running), and gone (``SlotFree``
    on release); or in ``errors`` (a ``LayerError``), raised by ``acquire``. Invariants, checked
    as tokens arrive: a key is in at most one of ready / held; a device slot is named by at most
    one key across ready and held. See docs/ARCHITECTURE.md for both sides of the ring."""

    def __init__(
        self,
        sock: zmq.Socket,
        slot_bufs: list[Any],
        streamed_layers: list[int],
        layer_bytes: dict[int, int],
        clock: StageClock,
        on_wait: Callable[[], None] | None = None,
        before_release: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        self.slot_bufs = slot_bufs
        self.n_slots = len(slot_bufs)
        self.layers = list(streamed_layers)  # what the passes from ``layers_from`` on stream
        self.layers_from = 0
        self._earlier: list[tuple[int, list[int]]] = []  # (first pass, layers) of lists still wanted by some pass
        self.standby: set[int] = set()  # resident layers dma holds a copy of (``Standby``): demotable
        self._standby_asked = False
        self.layer_bytes = layer_bytes
        self.clock = clock
        self.on_wait = on_wait  # between the slices of every wait (a layer, room to send); may raise to give up
        self.before_release = before_release  # e.g. wait for the GPU to finish reading the slot
        self.wanted_upto = -1
        # the cpu tier's layers that a pass may stream too (``begin_pass(tier_layers=...)``), and
        # which of them each pass asked of dma was asked with
        self.wide_layers: list[int] = []
        self._tier: dict[int, tuple[int, ...]] = {}
        self.ready: dict[tuple[int, int], int] = {}
        self.errors: dict[tuple[int, int], str] = {}
        self.aborted: set[int] = set()
        self.held: dict[tuple[int, int], int] = {}  # acquired, not yet released

    def _send(self, msg: m.Message) -> None:
        send_patiently(self.sock, msg.encode(), self._waiting)

    def _waiting(self) -> None:
        if self.on_wait:
            self.on_wait()

    def begin_pass(self, pass_id: int, tier_layers: Sequence[int] = ()) -> int:
        """Pass ``pass_id`` begins, streaming ``tier_layers`` (of ``wide_layers``) too; returns
        the id it runs as. The next pass is asked of dma now with the same tier layers as this one
        (a decode stream's passes take none, a batch's or a verify chain's the same share).
        Where that guess was wrong, the passes asked so far are given up (``abort_pass``: their
        slots go back as they come) and this one runs under the first fresh id, asked anew: the
        few layers dma had copied ahead are copied again, once per change of width."""
        tier = tuple(sorted(set(tier_layers) & set(self.wide_layers)))
        if pass_id <= self.wanted_upto and self._tier.get(pass_id, ()) != tier:
            asked, pass_id = pass_id, self.abort_pass(pass_id)
            self.clock.rename_pass(asked, pass_id)  # the step's time so far was charged to the id asked
        while self.wanted_upto < pass_id + 1:
            self.wanted_upto += 1
            self._tier[self.wanted_upto] = tier
            self._send(m.Want(pass_id=self.wanted_upto, layers=self.layers_for(self.wanted_upto)))
        for p in [p for p in self._tier if p < pass_id]:
            del self._tier[p]
        # forget the lists that no pass from this one on streams by
        while self._earlier and (self._earlier[1][0] if len(self._earlier) > 1 else self.layers_from) <= pass_id:
            self._earlier.pop(0)
        return pass_id

    def layers_for(self, pass_id: int) -> list[int]:
        """The layers pass ``pass_id`` streams (in order): the list in force for it, with the
        cpu tier's it was asked with among them in run order."""
        base = self._base_layers(pass_id)
        tier = self._tier.get(pass_id, ())
        if tier:
            return sorted(set(base) | set(tier))
        return base

    def _base_layers(self, pass_id: int) -> list[int]:
        if pass_id >= self.layers_from:
            return self.layers
        for first, layers in reversed(self._earlier):
            if pass_id >= first:
                return layers
        raise ValueError(f"pass {pass_id} is older than every layer list kept")

    def set_layers(self, layers: list[int]) -> int:
        """Stream ``layers`` (in run order) from the first pass not yet wanted from dma on: a
        layer demoted to streamed (dma must hold its standby copy) or promoted back to resident.
        Returns that pass: the passes already wanted keep the list they were wanted with."""
        first = self.wanted_upto + 1
        if first > self.layers_from:
            self._earlier.append((self.layers_from, self.layers))
        self.layers, self.layers_from = list(layers), first
        return first

    def want_standby(self) -> None:
        """Ask dma to load the standby copies it has not loaded yet at once, busy or not (once)."""
        if not self._standby_asked:
            self._standby_asked = True
            self._send(m.StandbyWanted())

    def poll(self) -> None:
        """Take what dma sent without waiting (between passes: ``Standby`` announcements arrive
        whether or not anything is being acquired)."""
        while self.sock.poll(0):
            self._receive(m.DMA_TO_COMPUTE.decode(self.sock.recv()))

    def _receive(self, msg: m.SlotReady | m.LayerError | m.Standby) -> None:
        if isinstance(msg, m.Standby):
            self.standby.update(msg.layers)
            return
        key = (msg.pass_id, msg.layer)
        if isinstance(msg, m.SlotReady):
            if key in self.ready or key in self.held:
                raise RingProtocolError(f"dma delivered layer {msg.layer} of pass {msg.pass_id} twice")
            if msg.slot in self.ready.values() or msg.slot in self.held.values():
                raise RingProtocolError(f"dma handed out device slot {msg.slot} while compute still holds it")
            if key[0] in self.aborted:
                self._send(m.SlotFree(slot=msg.slot, layer=msg.layer, pass_id=msg.pass_id))
            else:
                self.ready[key] = msg.slot
        elif key[0] not in self.aborted:
            self.errors[key] = msg.message

    def acquire(self, layer_idx: int, pass_id: int) -> Any:
        key = (pass_id, layer_idx)
        if key not in self.ready:
            self.clock.enter("starved", pass_id)
            while key not in self.ready:
                if key in self.errors:
                    raise LayerUnavailable(f"layer {layer_idx} could not be loaded: {self.errors.pop(key)}")
                if self.sock.poll(int(WAIT_SLICE_S * 1000)):
                    while self.sock.poll(0):
                        self._receive(m.DMA_TO_COMPUTE.decode(self.sock.recv()))
                else:
                    self._waiting()
            self.clock.enter("busy", pass_id)
        slot = self.ready.pop(key)
        self.held[key] = slot
        self.clock.add_bytes(self.layer_bytes[layer_idx], pass_id, layer=layer_idx)
        return self.slot_bufs[slot]

    def release(self, layer_idx: int, pass_id: int) -> None:
        if self.before_release:
            self.before_release()
        slot = self.held.pop((pass_id, layer_idx))
        self._send(m.SlotFree(slot=slot, layer=layer_idx, pass_id=pass_id))

    def end_pass(self, pass_id: int) -> None:
        pass

    def abort_pass(self, pass_id: int) -> int:
        """Hand back every slot of a failed pass and of the passes already wanted after it, now
        and as the rest arrive; returns the first pass id that is still fresh. The prefetched
        passes are dropped too: their reads happened under the same failure and would fail the
        next requests with a stale error after the storage has recovered. dma is told (``Drop``),
        so it copies none of their layers it has not started."""
        if pass_id <= self.wanted_upto:  # dma copies none of theirs that it has not started
            self._send(m.Drop(first_pass=pass_id, last_pass=self.wanted_upto))
        for p in range(pass_id, self.wanted_upto + 1):
            self.aborted.add(p)
            for key in [k for k in self.held if k[0] == p]:
                self.release(key[1], p)
            for key in [k for k in self.ready if k[0] == p]:
                slot = self.ready.pop(key)
                self._send(m.SlotFree(slot=slot, layer=key[1], pass_id=p))
            for key in [k for k in self.errors if k[0] == p]:
                self.errors.pop(key)
        return self.wanted_upto + 1
