"""An engine in this process: the model, tokenizer and engine core without any daemon.

``ntxctl generate`` falls back to this when no pipeline is running, and tests use it as the
reference the pipeline must agree with.
"""

from __future__ import annotations

import sys

from ntx.daemons.compute.backend import make_backend
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.model import FileLayerStream, LlamaModel
from ntx.daemons.compute.tokenizer import Tokenizer
from ntx.shared.gguf_index import open_model


def build_local_engine(
    model_path: str,
    backend: str = "cpu",
    resident_layers=None,
    progress: bool = False,
    **engine_kw,
) -> EngineCore:
    """Load ``model_path`` in-process. ``resident_layers`` None keeps every layer resident;
    the others are re-read from the file every pass."""
    index = open_model(model_path)
    tok = Tokenizer.from_metadata(index.metadata)
    be = make_backend(backend, index, max_seqs=engine_kw.get("max_batch", 16), max_ctx=engine_kw.get("max_context") or 4096)
    stream = None
    if resident_layers is not None and len(set(resident_layers)) < index.hparams.n_layers:
        stream = FileLayerStream(index)
    report = None
    if progress and sys.stderr.isatty():
        n = index.hparams.n_layers

        def report(i: int) -> None:
            print(f"\rloading layers {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)

    model = LlamaModel(index, be, resident_layers=resident_layers, stream=stream, progress=report)
    return EngineCore(model, tok, **engine_kw)
