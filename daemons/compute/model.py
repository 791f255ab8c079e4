"""The Llama model as an order of work: embed, each layer from wherever it lives, logits.

Layers come from two places. Resident layers are prepared once and kept by the backend. Streamed
layers arrive as slot buffers from a ``LayerStream`` (the token ring in the pipeline), are run,
and handed straight back. One ``forward`` call is one *pass*: every layer once, for every
sequence chunk in the batch.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import numpy as np

from ntx.daemons.compute.backend import Backend, Pick
from ntx.daemons.compute.batch import StepBatch
from ntx.shared.gguf_index import ModelIndex
from ntx.shared.layer_bytes import read_layer, read_layer_into, read_tensor


class LayerStream(Protocol):
    """Where non-resident layers come from, one pass at a time, in layer order."""

    def begin_pass(self, pass_id: int) -> None: ...

    def acquire(self, layer_idx: int, pass_id: int) -> Any:
        """Block until the layer's slot buffer is ready; return it."""

    def release(self, layer_idx: int, pass_id: int) -> None:
        """The layer has run: its slot may be refilled."""

    def end_pass(self, pass_id: int) -> None: ...


class FileLayerStream:
    """Reads each streamed layer from the file every pass (in-process; tests and --io mmap-like
    use). The pipeline replaces this with the ring of the reader and dma daemons."""

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        self.buf = np.empty(index.max_layer_slot_bytes, dtype=np.uint8)

    def begin_pass(self, pass_id: int) -> None:
        pass

    def acquire(self, layer_idx: int, pass_id: int) -> np.ndarray:
        return read_layer_into(self.index.layers[layer_idx], self.buf)

    def release(self, layer_idx: int, pass_id: int) -> None:
        pass

    def end_pass(self, pass_id: int) -> None:
        pass


class LlamaModel:
    def __init__(
        self,
        index: ModelIndex,
        backend: Backend,
        resident_layers: Iterable[int] | None = None,
        stream: LayerStream | None = None,
        progress=None,
    ) -> None:
        self.index = index
        self.hp = index.hparams
        self.backend = backend
        resident = set(range(self.hp.n_layers) if resident_layers is None else resident_layers)
        self.streamed_layers = [i for i in range(self.hp.n_layers) if i not in resident]
        if self.streamed_layers and stream is None:
            raise ValueError("streamed layers need a LayerStream")
        self.stream = stream
        backend.load_globals({name: read_tensor(t) for name, t in index.globals.items()})
        self.resident: dict[int, Any] = {}
        for i in sorted(resident):
            self.resident[i] = backend.prepare_layer(index.layers[i], read_layer(index.layers[i]), keep=True)
            if progress:
                progress(i)
        self.passes_run = 0

    def forward(self, batch: StepBatch, pass_id: int | None = None, picks: list[Pick] | None = None):
        """Run one pass; returns logits [N_out, V] for ``batch.logit_rows``, or with ``picks``
        (one per logit row) what each row was asked for (``Backend.pick``)."""
        pass_id = self.passes_run if pass_id is None else pass_id
        stream = self.stream if self.streamed_layers else None
        if stream:
            stream.begin_pass(pass_id)
        x = self.backend.embed(batch)  # x: [T, D]
        for i in range(self.hp.n_layers):
            if i in self.resident:
                x = self.backend.layer_forward(i, self.resident[i], x, batch)
                continue
            buf = stream.acquire(i, pass_id)
            try:
                w = self.backend.prepare_layer(self.index.layers[i], buf, keep=False)
                x = self.backend.layer_forward(i, w, x, batch)
            finally:
                stream.release(i, pass_id)
        if stream:
            stream.end_pass(pass_id)
        self.passes_run += 1
        if picks is not None:
            return self.backend.pick(x, batch, picks)
        return self.backend.logits(x, batch)
