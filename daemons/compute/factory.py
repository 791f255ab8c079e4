"""The one way an engine is assembled: model file, backend, layer source, tokenizer, engine core.

``ntxctl generate --local``, the compute daemon, the in-process benchmarks and the tests all
build their engines here, so a model is sized, loaded and wired the same way everywhere.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from ntx.daemons.compute.backend import Backend, make_backend
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.model import FileLayerStream, LayerStream, LlamaModel
from ntx.daemons.compute.tokenizer import Tokenizer
from ntx.shared.gguf_index import ModelIndex, open_model

DEFAULT_CONTEXT = 4096  # positions per sequence when the caller names none (the model may allow more)


def build_engine(
    model: ModelIndex | str | os.PathLike,
    backend: Backend | str = "cpu",
    *,
    resident_layers: Iterable[int] | None = None,
    stream: LayerStream | None = None,
    max_batch: int = 16,
    max_context: int | None = None,
    prefill_chunk_tokens: int = 512,
    progress: Callable[[int], None] | None = None,
) -> EngineCore:
    """An engine for ``model`` (an index or a GGUF path) on ``backend`` (a name, or a backend
    already made — the compute daemon makes its own first, to allocate the ring's slots).

    ``resident_layers`` None keeps every layer resident; the others come from ``stream``, or are
    re-read from the file every pass when no stream is given. Contexts hold ``max_context``
    positions (default 4096, at most what the model was trained for), for up to ``max_batch``
    sequences at once. ``progress(i)`` is called as resident layer i is loaded."""
    index = model if isinstance(model, ModelIndex) else open_model(model)
    max_context = min(max_context or DEFAULT_CONTEXT, index.hparams.n_ctx_train)
    if isinstance(backend, str):
        backend = make_backend(backend, index, max_seqs=max_batch, max_ctx=max_context)
    if stream is None and resident_layers is not None and set(resident_layers) != set(range(index.hparams.n_layers)):
        stream = FileLayerStream(index)
    llama = LlamaModel(index, backend, resident_layers=resident_layers, stream=stream, progress=progress)
    return EngineCore(llama, Tokenizer.from_metadata(index.metadata), max_batch=max_batch,
                      prefill_chunk_tokens=prefill_chunk_tokens, max_context=max_context)
