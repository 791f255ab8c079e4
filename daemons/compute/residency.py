"""Which layers stay resident while the KV cache grows and shrinks: the trade of a streaming
engine between keys and values and the layers they would displace (docs/ARCHITECTURE.md, "KV
memory").

When the engine needs KV pages the pool does not have (``EngineCore`` asks ``make_room``), a
resident layer whose bytes dma holds in pinned RAM (its *standby* copy, ``Standby`` on the
device ring) is *demoted*: streamed from the next pass on, its weights dropped and their memory
turned into KV chunks. Layers go in the plan's demotion order (``plan.standby_layers``: every
other resident layer first, so those left stay spread over the model); a self-draft's layers
never go. When the pool has long had more free pages than a demoted layer's memory, the layer
is *promoted* back: chunks given back, its bytes read from the model file, resident again once
the passes already asked of dma have run. Both happen between passes, never inside one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ntx.daemons.compute.model import LlamaModel
from ntx.shared.layer_bytes import read_layer

PROMOTE_AFTER_PASSES = 16  # passes of plenty (and none since the last demotion) before a layer comes back


@dataclass
class ResidencyLog:
    """What status shows of it: the layers demoted now, and every change with its reason."""

    demoted: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # the most recent first, at most 20

    def add(self, text: str) -> None:
        self.events.insert(0, text)
        del self.events[20:]


class Residency:
    """Demotes and promotes the model's layers for its KV cache (the engine's ``KvRoom``).
    ``standby_order``: the plan's standby layers in demotion order; ``layer_bytes``: what each
    layer holds when resident (the backend's ``MemoryCosts.layer_bytes``); ``keep``: layers never
    demoted (a self-draft's)."""

    def __init__(self, model: LlamaModel, standby_order: list[int], layer_bytes: tuple[int, ...],
                 keep: frozenset[int] = frozenset()) -> None:
        if model.stream is None:
            raise ValueError("residency changes need a layer stream")
        self.model = model
        self.backend = model.backend
        self.order = [i for i in standby_order if i not in keep]
        self.layer_bytes = layer_bytes
        self.chunk_bytes = self.backend.kv_sizing.chunk_pages * self.backend.kv_page_bytes()
        self.spare_bytes = 0  # memory demotions freed that is no whole chunk (promotions give it back)
        self.demoted: list[int] = []  # in the order they went
        self.last_change_pass = -PROMOTE_AFTER_PASSES
        self.plenty_since: int | None = None
        self.log = ResidencyLog()

    def _ready(self) -> list[int]:
        """Layers that may be demoted now: resident, their standby copy announced, in order."""
        self.model.stream.poll()
        standby = self.model.stream.standby
        return [i for i in self.order if i in self.model.resident and i in standby]

    def may_grow(self) -> bool:
        """Whether more pages may come without a sequence ending: a demotable layer (maybe with its
        standby copy still loading) and room in the device's chunk table."""
        self.model.stream.poll()
        return self.backend.kv_can_grow and any(i in self.model.resident for i in self.order)

    def make_room(self, n_pages: int) -> int:
        """Demote as few layers as give ``n_pages`` more pages (all at once: one pass given up);
        returns the pages added (0: none can go now)."""
        be = self.backend
        pages_per_chunk = be.kv_sizing.chunk_pages
        need_chunks = -(-n_pages // pages_per_chunk)
        room = be.kv_sizing.max_chunks - be.kv_pool.n_chunks
        chosen, spare, chunks = [], self.spare_bytes, 0
        ready = self._ready()
        if len(ready) < len([i for i in self.order if i in self.model.resident]):
            self.model.stream.want_standby()  # short of pages: the copies still missing are wanted now
        for i in ready:
            if chunks >= min(need_chunks, room):
                break
            chosen.append(i)
            spare += self.layer_bytes[i]
            chunks = min(room, spare // self.chunk_bytes)
        if chunks == 0:  # nothing to demote now, no room in the chunk table, or too little freed
            return 0
        first = self.model.demote(chosen)
        self.spare_bytes = spare - chunks * self.chunk_bytes
        for _ in range(chunks):
            be.grow_kv()
        self.demoted += chosen
        self.last_change_pass = first
        self.plenty_since = None
        self.log.demoted = list(self.demoted)
        self.log.add(f"pass {first}: layers {chosen} demoted to streamed for {n_pages} KV pages "
                     f"(+{chunks * pages_per_chunk} pages)")
        return chunks * pages_per_chunk

    def maybe_promote(self, busy: bool) -> bool:
        """Between passes: bring the last demoted layer back when the pool has had, for
        PROMOTE_AFTER_PASSES passes and with ``busy`` false (nobody waits for pages), enough
        wholly free chunks at its top to give the layer its memory back and still hold a quarter
        more than the pages in use. Whether one came back."""
        if not self.demoted:
            return False
        be, layer = self.backend, self.demoted[-1]
        # the chunks whose memory the layer takes back, less what demotions left over
        need = max(0, -(-(self.layer_bytes[layer] - self.spare_bytes) // self.chunk_bytes))
        stats = be.kv_stats()
        after = stats.pages_free + stats.pages_cached - need * be.kv_sizing.chunk_pages
        plenty = (not busy and len(be.kv_pool.releasable_chunks()) >= need
                  and after >= stats.pages_in_use // 4 + be.kv_sizing.chunk_pages)
        now = self.model.next_pass_id
        if not plenty:
            self.plenty_since = None
            return False
        if self.plenty_since is None:
            self.plenty_since = now
        if now - self.plenty_since < PROMOTE_AFTER_PASSES or now - self.last_change_pass < PROMOTE_AFTER_PASSES:
            return False
        for _ in range(need):
            if be.shrink_kv() is None:
                return False
        first = self.model.promote(layer, read_layer(self.model.index.layers[layer]))
        self.spare_bytes += need * self.chunk_bytes - self.layer_bytes[layer]
        self.demoted.pop()
        self.last_change_pass = first
        self.plenty_since = None
        self.log.demoted = list(self.demoted)
        self.log.add(f"pass {first}: layer {layer} resident again (-{need * be.kv_sizing.chunk_pages} pages)")
        return True
