"""An engine in this process: the model, tokenizer and engine core without any daemon.

``ntxctl generate`` falls back to this when no pipeline is running, and tests use it as the
reference the pipeline must agree with. The engine is assembled by the one factory
(``ntx.daemons.compute.factory``); this adds the loading progress a terminal user sees.
"""

from __future__ import annotations

import sys

from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.factory import build_engine
from ntx.shared.gguf_index import open_model


def build_local_engine(model_path: str, backend: str = "cpu", resident_layers=None, progress: bool = False,
                       **engine_kw) -> EngineCore:
    """Load ``model_path`` in-process (``build_engine``'s keywords pass through) and warm it up,
    printing "loading layers i/n" and the warm-up's stages on a terminal when ``progress``."""
    index = open_model(model_path)
    report = log = None
    if progress and sys.stderr.isatty():

        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        n = index.hparams.n_layers

        def report(i: int) -> None:
            print(f"\rloading layers {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)

    return build_engine(index, backend, resident_layers=resident_layers, progress=report, log=log, **engine_kw)
