"""The reader daemon: turns "layer L into host slot s" into aligned reads of the layer's span.

It owns no model logic and no slots: the dma daemon hands it a FREE host slot with a job
(``Read``), it fills the slot straight from storage (O_DIRECT where the file system allows) and
answers ``Filled`` — or ``ReadFailed``, after which it goes on serving the next job.

Time accounting: waiting for a job counts as *blocked* when the dma daemon said more storage
layers were waiting for a host slot (``backlog`` > 0: the ring is full downstream), otherwise as
*starved*; nothing requested at all is *idle*.
"""

from __future__ import annotations

from typing import Any

import zmq

from ntx.daemons.reader.io import SpanReader
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig
from ntx.shared.daemon import Daemon, daemon_main
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import open_model
from ntx.shared.shm import ShmSegment
from ntx.shared.stats import StageClock


class ReaderDaemon(Daemon):
    name = "reader"

    def setup(self, config: m.Config) -> m.Ready:
        cfg = InstanceConfig.from_dict(config.instance)
        self.index = open_model(cfg.model)
        self.slots = [ShmSegment.open(name) for name in config.host_slots]
        self.slot_arrays = [s.array() for s in self.slots]
        self.readers = {
            p: SpanReader(p, mode=cfg.io, chunk_bytes=cfg.read_chunk_bytes, queue_depth=cfg.read_queue_depth)
            for p in self.index.paths
        }
        first = next(iter(self.readers.values()))
        self.clock = StageClock("reader")
        self.clock.extra = {"io_mode": first.mode_in_use, "io_fallback": first.fallback_reason}
        self.ring = self.ctx.socket(zmq.PAIR)
        self.ring.setsockopt(zmq.LINGER, 0)
        self.ring.connect(config.host_ring)
        return m.Ready()  # the io mode in use reaches status through the clock's extra fields

    def read_layer(self, layer_idx: int, dest) -> int:
        """Read every span of the layer into ``dest`` (image layout); returns bytes read."""
        layer = self.index.layers[layer_idx]
        for span in layer.spans:
            self.readers[span.path].read_span(span, dest)
        return layer.nbytes

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ring, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(int(m.STATS_INTERVAL_S * 1000)))
            if self.control in events:
                self.poll_control()
            # Jobs can arrive back to back for a whole generation (the disk is the slow stage):
            # report and heed shutdown between jobs, not only when the ring falls quiet.
            while self.ring.poll(0) and not self.stopping:
                self.handle_job(m.DMA_TO_READER.decode(self.ring.recv()))
                self.maybe_send_stats()
                self.poll_control()
            self.maybe_send_stats()

    def handle_job(self, job: m.Read | m.Activity) -> None:
        if isinstance(job, m.Activity):
            if not job.active:
                self.clock.enter("idle")
            elif self.clock.state == "idle":
                self.clock.enter("starved")
            return
        slot, layer, pass_id = job.slot, job.layer, job.pass_id
        self.clock.enter("busy", pass_id)
        try:
            nbytes = self.read_layer(layer, self.slot_arrays[slot])
        except NtxError as e:
            self.send(self.ring, m.ReadFailed(slot=slot, layer=layer, pass_id=pass_id, message=str(e)))
        else:
            # bytes and read time are the reader's own clock's; dma needs only the slot back
            self.clock.add_bytes(nbytes, pass_id, layer=layer)
            self.send(self.ring, m.Filled(slot=slot, layer=layer, pass_id=pass_id))
        # What the wait for the next job means depends on whether work is queued behind the ring.
        self.clock.enter("blocked" if job.backlog > 0 else ("starved" if job.active else "idle"), pass_id)

    def stats(self) -> dict[str, Any]:
        return self.clock.snapshot()

    def close(self) -> None:
        for r in getattr(self, "readers", {}).values():
            r.close()
        self.slot_arrays = []
        for s in getattr(self, "slots", []):
            s.close()
        if hasattr(self, "ring"):
            self.ring.close(linger=0)


if __name__ == "__main__":
    daemon_main(ReaderDaemon)
