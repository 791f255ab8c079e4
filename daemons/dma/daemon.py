"""The dma daemon: owns the host staging ring and the pinned-RAM tier; feeds compute's device slots.

Slot state machine (one ring per side; a token is ``(slot, layer, pass)``; ``RingState`` in
ring_state.py holds both sides' state, draws it and checks its invariants at every step)::

    host slot:   FREE --Read(job)--> [reader fills] --Filled--> FILLED --copy--> FREE
    device slot: FREE --copy of a FILLED host slot or a RAM-tier layer--> SlotReady --(compute runs it)--> SlotFree

Compute sends ``Want(pass, layers)`` ahead of time; the daemon keeps the wanted (pass, layer)
pairs in order. Reads for storage-tier layers are issued as soon as a host slot is free — ahead of
device slots, so the reader runs up to N layers ahead — while device slots are filled strictly in
wanted order, so compute receives the layers of a pass in the order it runs them. A host slot
returns to FREE the moment its copy is done, so the reader can refill it while compute works.

Time accounting: *busy* copying; *blocked* when the next layer is available but every device slot
is taken (compute is behind); *starved* when the next layer is a storage layer still being read;
*idle* when nothing is wanted.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import zmq

from ntx.daemons.dma.copier import make_copier
from ntx.daemons.dma.ring_state import RingState, RingViolation
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig
from ntx.shared.daemon import Daemon, daemon_main
from ntx.shared.gguf_index import open_model
from ntx.shared.layer_bytes import read_layer_into
from ntx.shared.plan import RAM, STORAGE, Plan
from ntx.shared.shm import ShmSegment
from ntx.shared.stats import StageClock


class DmaDaemon(Daemon):
    name = "dma"

    def setup(self, config: m.Config) -> m.Ready:
        cfg = InstanceConfig.from_dict(config.instance)
        self.index = open_model(cfg.model)
        self.plan = Plan.from_dict(config.plan)
        names = config.shm_names
        self.owned: list[ShmSegment] = []
        self.copier = make_copier(cfg.backend, config.device_slots)
        self.n_dev_slots = len(config.device_slots)

        # pinned-RAM tier: every RAM layer's image, loaded once; image_bytes is whole
        # DIRECT_ALIGN_BYTES units, so packed one after another each layer starts aligned. The
        # cpu tier's layers too where wide passes stream them (Plan.wide_streamed_layers): the
        # host's cores compute them from compute's own packed copy, the GPU from these bytes
        self.wide_layers = set(self.plan.wide_streamed_layers)
        ram_layers = sorted(self.plan.layers_on(RAM) + list(self.wide_layers))
        self.ram_offsets: dict[int, int] = {}
        total = 0
        for i in ram_layers:
            self.ram_offsets[i] = total
            total += self.index.layers[i].image_bytes
        self.ram_seg = None
        if ram_layers:
            t0 = time.monotonic()
            self.ram_seg = self._create(names["ram"], total)
            arr = self.ram_seg.array()
            for i in ram_layers:
                read_layer_into(self.index.layers[i], arr[self.ram_offsets[i] : self.ram_offsets[i] + self.index.layers[i].image_bytes])
            t1 = time.monotonic()
            self.copier.register_host(self.ram_seg)
            self.ram_array = arr
            wide = f", {len(self.wide_layers)} of them the cpu tier's for wide passes" if self.wide_layers else ""
            self.say(f"RAM tier: {len(ram_layers)} layers{wide} ({total / 2**30:.2f} GiB) read in {t1 - t0:.2f} s "
                     f"({total / max(t1 - t0, 1e-9) / 1e9:.2f} GB/s), pinned in {time.monotonic() - t1:.2f} s")

        # host staging ring for storage-tier layers
        self.host_slots: list[ShmSegment] = []
        if self.plan.layers_on(STORAGE):
            for s in range(self.plan.n_slots):
                seg = self._create(f"{names['host_slot']}{s}", self.plan.slot_bytes)
                self.copier.register_host(seg)
                self.host_slots.append(seg)
        self.host_arrays = [s.array() for s in self.host_slots]

        # standby copies of resident layers (plan.standby_layers), loaded after ready by a thread so
        # the ring never waits for them; compute may demote a layer once its copy is announced
        self.standby_segs: dict[int, ShmSegment] = {
            i: self._create(f"{names['ram']}-sb{i}", self.index.layers[i].image_bytes) for i in self.plan.standby_layers}
        self.standby_arrays: dict[int, Any] = {}  # loaded and pinned: layer -> its bytes
        # layer bytes delivered, by where they came from (stats; "cpu": the cpu tier's, in wide passes)
        self.tier_bytes = {"storage": 0, "ram": 0, "cpu": 0}
        self.standby_loaded: queue.SimpleQueue = queue.SimpleQueue()  # layer ids from the loader (or an error text)
        self.standby_stop = threading.Event()
        # the loader reads while compute is idle, or at any time once compute asked (StandbyWanted)
        self.standby_go = threading.Event()
        self.standby_go.set()
        self.standby_thread: threading.Thread | None = None
        self.standby_wanted = False

        self.clock = StageClock("dma")
        self.host_ring = self.ctx.socket(zmq.PAIR)
        self.host_ring.setsockopt(zmq.LINGER, 0)
        self.host_ring.bind(config.host_ring)
        self.dev_ring = self.ctx.socket(zmq.PAIR)
        self.dev_ring.setsockopt(zmq.LINGER, 0)
        self.dev_ring.connect(config.device_ring)

        self.ring = RingState(len(self.host_slots), self.n_dev_slots, lambda layer: self.plan.tiers[layer] == STORAGE)
        self.active = False  # compute has requests in flight
        self.dropped_keys = 0  # (pass, layer) copies not made: their passes were given up (Drop)
        self.clock.extra["limit_gbps"] = self._measure_copy_gbps()
        if self.standby_segs:
            self.standby_thread = threading.Thread(target=self._load_standby, name="dma-standby", daemon=True)
            self.standby_thread.start()
        return m.Ready(host_slots=[s.name for s in self.host_slots])

    def _load_standby(self) -> None:
        """The loader thread: read each standby layer into its segment, in demotion order, and pin
        it (file reads and the pinning release the GIL, so the ring's loop keeps turning); the
        main loop tells compute. A read that fails ends the loading with one line in the log, never the daemon:
        the layers not loaded simply stay resident."""
        for i, seg in self.standby_segs.items():
            while not self.standby_go.wait(0.2):  # compute is busy and did not ask: its copies come first
                if self.standby_stop.is_set():
                    return
            if self.standby_stop.is_set():
                return
            try:
                read_layer_into(self.index.layers[i], seg.array())
                self.copier.register_host(seg)  # pinned here too: the ring's loop never waits for it
            except Exception as e:  # noqa: BLE001 (any failure: that layer and the rest stay without copies)
                self.standby_loaded.put(f"standby copy of layer {i} not loaded ({type(e).__name__}: {e}); "
                                        "the layers left stay resident for good")
                return
            self.standby_loaded.put(i)

    def _announce_standby(self) -> None:
        """Tell compute which standby copies the loader finished: those layers can be demoted."""
        ready: list[int] = []
        while True:
            try:
                item = self.standby_loaded.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, str):
                self.say(item)
                continue
            self.standby_arrays[item] = self.standby_segs[item].array()
            ready.append(item)
        if ready:
            self.send(self.dev_ring, m.Standby(layers=ready))

    def _measure_copy_gbps(self) -> float | None:
        """This link's speed now: the best of three copies of a slot's worth of host memory into
        device slot 0 (the same path as every layer; about 10 ms for a 70B layer at 55 GB/s)."""
        src = self.ram_array if self.ram_seg is not None else (self.host_arrays[0] if self.host_arrays else None)
        if src is None or not self.n_dev_slots:
            return None
        src = src[: min(self.plan.slot_bytes, src.shape[0])]
        best_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            self.copier.copy(src, 0)
            best_s = min(best_s, time.perf_counter() - t0)
        return round(src.shape[0] / best_s / 1e9, 3)

    def _create(self, name: str, nbytes: int) -> ShmSegment:
        seg = ShmSegment.create(name, nbytes)
        self.owned.append(seg)
        return seg

    # -- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        for s in (self.control, self.host_ring, self.dev_ring):
            poller.register(s, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(int(m.STATS_INTERVAL_S * 1000)))
            if self.control in events:
                self.poll_control()
            while self.dev_ring.poll(0):
                self.on_device_msg(m.COMPUTE_TO_DMA.decode(self.dev_ring.recv()))
            while self.host_ring.poll(0):
                self.on_host_msg(m.READER_TO_DMA.decode(self.host_ring.recv()))
            self.issue_reads()
            self.deliver()
            if self.standby_segs:
                self._announce_standby()
            self.maybe_send_stats()

    def on_device_msg(self, msg: m.Want | m.SlotFree | m.Activity | m.StandbyWanted | m.Drop) -> None:
        if isinstance(msg, m.Want):
            for layer in msg.layers:
                if self.plan.tiers[layer] not in (RAM, STORAGE) and layer not in self.standby_arrays \
                        and layer not in self.wide_layers:
                    raise RingViolation(f"compute wants layer {layer}, which is resident and has no standby copy here")
            self.ring.want(msg.pass_id, msg.layers)
        elif isinstance(msg, m.SlotFree):
            self.ring.device_slot_freed(msg.slot, (msg.pass_id, msg.layer))
        elif isinstance(msg, m.Drop):
            self.dropped_keys += self.ring.drop(msg.first_pass, msg.last_pass)
        elif isinstance(msg, m.StandbyWanted):
            self.standby_wanted = True
            self.standby_go.set()
        else:
            self.active = msg.active
            if not self.standby_wanted:
                (self.standby_go.clear if msg.active else self.standby_go.set)()
            if self.host_slots:  # a reader exists only when some layer lives on storage
                self.send(self.host_ring, msg)

    def on_host_msg(self, msg: m.Filled | m.ReadFailed) -> None:
        key = (msg.pass_id, msg.layer)
        if isinstance(msg, m.Filled):
            self.ring.read_filled(key, msg.slot)
        else:
            self.ring.read_failed(key, msg.slot, msg.message)

    def issue_reads(self) -> None:
        while (job := self.ring.start_read()) is not None:
            (pass_id, layer), slot = job
            read = m.Read(slot=slot, layer=layer, pass_id=pass_id, backlog=len(self.ring.to_read), active=self.active)
            self.send(self.host_ring, read)

    def deliver(self) -> None:
        """Fill device slots with wanted layers, strictly in order."""
        ring = self.ring
        while ring.head is not None:
            pass_id, layer = ring.head
            failure = ring.pop_failed_head()
            if failure is not None:
                self.send(self.dev_ring, m.LayerError(layer=layer, pass_id=pass_id, message=failure))
                continue
            waits_for = ring.head_waits_for()
            if waits_for == "read":
                self.clock.enter("starved" if self.active else "idle", pass_id)
                return
            if waits_for == "device_slot":
                self.clock.enter("blocked" if self.active else "idle", pass_id)
                return
            dslot, hslot = ring.next_delivery()
            self.clock.enter("busy", pass_id)
            nbytes = self.index.layers[layer].image_bytes
            # which tier the layer came from: through a host slot the reader filled (storage),
            # or from this daemon's pinned copy (the RAM tier, or a demoted layer's standby)
            self.tier_bytes["storage" if hslot is not None else "cpu" if layer in self.wide_layers else "ram"] += \
                self.index.layers[layer].nbytes
            if hslot is not None:
                self.copier.copy(self.host_arrays[hslot][:nbytes], dslot)
            elif layer in self.ram_offsets:
                off = self.ram_offsets[layer]
                self.copier.copy(self.ram_array[off : off + nbytes], dslot)
            else:  # a demoted layer, from its standby copy
                self.copier.copy(self.standby_arrays[layer][:nbytes], dslot)
            ring.delivered()
            self.issue_reads()  # the host slot just freed can take the next read at once
            self.clock.add_bytes(self.index.layers[layer].nbytes, pass_id, layer=layer)
            self.send(self.dev_ring, m.SlotReady(slot=dslot, layer=layer, pass_id=pass_id))
        self.clock.enter("idle")

    def stats(self) -> dict[str, Any]:
        snap = self.clock.snapshot()
        ring = self.ring
        snap["host_slots"] = {"free": len(ring.free_host), "reading": len(ring.reading), "filled": len(ring.filled)}
        snap["device_slots_free_seen"] = len(ring.free_dev)
        snap["wanted"] = len(ring.wanted)
        snap["dropped"] = self.dropped_keys
        snap["tier_bytes"] = dict(self.tier_bytes)  # layer bytes copied to the device, by the tier they came from
        if self.standby_segs:
            snap["standby"] = {"loaded": len(self.standby_arrays), "layers": len(self.standby_segs)}
        return snap

    def close(self) -> None:
        loader_busy = False
        if getattr(self, "standby_thread", None) is not None:
            self.standby_stop.set()
            self.standby_thread.join(timeout=1.0)  # it stops between layers; a read in flight may take longer
            loader_busy = self.standby_thread.is_alive()
        self.standby_arrays = {}
        self.host_arrays = []
        self.ram_array = None
        if hasattr(self, "copier"):
            self.copier.close()
        for seg in getattr(self, "owned", []):
            if not loader_busy:  # (a loader still reading keeps its mappings until the process ends)
                seg.close()
            seg.unlink()
        for name in ("host_ring", "dev_ring"):
            if hasattr(self, name):
                getattr(self, name).close(linger=0)


if __name__ == "__main__":
    daemon_main(DmaDaemon)
