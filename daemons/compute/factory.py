"""The one way an engine is assembled: model file, backend, layer source, drafter, engine core.

``ntxctl generate --local``, the compute daemon, the in-process benchmarks and the tests all
build their engines here, so a model is sized, loaded and wired the same way everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Sequence

from ntx.daemons.compute.backend import Backend, WarmUp, make_backend
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.model import FileLayerStream, LayerStream, LlamaModel
from ntx.daemons.compute.replay import ReplayDrafter, load_references
from ntx.daemons.compute.speculation import Drafter, ModelDrafter, SelfDrafter, check_same_vocabulary
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.gguf_index import ModelIndex, open_model
from ntx.shared.vocab import end_of_generation_ids

DEFAULT_CONTEXT = 4096  # positions per sequence when the caller names none (the model may allow more)


def build_engine(
    model: ModelIndex | str | os.PathLike,
    backend: Backend | str = "cpu",
    *,
    resident_layers: Iterable[int] | None = None,
    skip_layers: Sequence[int] = (),
    stream: LayerStream | None = None,
    max_batch: int = 16,
    max_context: int | None = None,
    prefill_chunk_tokens: int = 512,
    progress: Callable[[int], None] | None = None,
    self_draft: bool | Sequence[int] = False,
    self_draft_skip: Sequence[int] = (),
    draft_model: str | os.PathLike | None = None,
    draft_tokens: int = 4,
    draft_width: int | None = None,
    draft_replay: str | os.PathLike | None = None,
    draft_replay_p_wrong: float = 0.0,
    warm_up: bool = True,
    log: Callable[[str], None] | None = None,
) -> EngineCore:
    """An engine for ``model`` (an index or a GGUF path) on ``backend`` (a name, or a backend
    already made — the compute daemon makes its own first, to allocate the ring's slots).

    ``resident_layers`` None keeps every layer resident; the others come from ``stream``, or are
    re-read from the file every pass when no stream is given; ``skip_layers`` never run. Contexts hold ``max_context``
    positions (default 4096, at most what the model was trained for), for up to ``max_batch``
    sequences at once. ``progress(i)`` is called as resident layer i is loaded.

    Speculative decoding (``speculation.py``): ``self_draft`` drafts with the resident layers
    (True) or the given resident layers, less ``self_draft_skip``; ``draft_model`` with a small model of the same
    vocabulary, all resident on the same backend; ``draft_tokens`` per sequence and pass, as a
    tree of ``draft_width`` (None: chosen from measured acceptance; 1: a chain).
    ``draft_replay`` (benchmarks only, ``replay.py``): a file of recorded greedy continuations
    proposed (as chains) with each token made wrong with probability ``draft_replay_p_wrong``;
    the drafter chosen by the other keywords, if any, still runs first and its proposals are
    discarded.

    Before it returns, the engine is warmed up (``warm_up_engine``) unless ``warm_up`` is False
    (the caller then does it, timed): every kernel and CUDA graph its passes can need is built,
    so no request pays for it; ``log`` gets one line per stage."""
    index = model if isinstance(model, ModelIndex) else open_model(model)
    max_context = min(max_context or DEFAULT_CONTEXT, index.hparams.n_ctx_train)
    if isinstance(backend, str):
        backend = make_backend(backend, index, max_seqs=max_batch, max_ctx=max_context)
    kept = set(range(index.hparams.n_layers)) - set(skip_layers)
    if stream is None and resident_layers is not None and set(resident_layers) != kept:
        stream = FileLayerStream(index)
    llama = LlamaModel(index, backend, resident_layers=resident_layers, stream=stream, progress=progress,
                       skip_layers=skip_layers)
    drafter = _drafter(llama, backend.name, self_draft, self_draft_skip, draft_model, max_batch, max_context)
    if draft_replay is not None:
        drafter = ReplayDrafter(load_references(draft_replay), draft_replay_p_wrong, index.hparams.n_vocab,
                                inner=drafter)
    engine = EngineCore(llama, stop_token_ids=end_of_generation_ids(index.metadata), max_batch=max_batch,
                        prefill_chunk_tokens=prefill_chunk_tokens, max_context=max_context,
                        drafter=drafter, draft_tokens=draft_tokens, draft_width=draft_width)
    if warm_up:
        warm_up_engine(engine, log or (lambda line: None))
    return engine


def warm_up_engine(engine: EngineCore, log: Callable[[str], None]) -> float:
    """Build every kernel and graph ``engine``'s passes can need (``LlamaModel.warm_up``), its
    drafter's too; returns the seconds it took. The largest pass: a prompt chunk beside every
    other sequence's decode row and draft tree. A failure raises ``NtxError`` with one line."""
    t0 = time.monotonic()
    drafter = engine.drafter.inner if isinstance(engine.drafter, ReplayDrafter) else engine.drafter
    spec_rows = 1 + engine.draft_tokens if engine.drafter is not None else 1  # a decode row and its tree
    spec = WarmUp(max_rows=engine.prefill_chunk_tokens + engine.max_batch * spec_rows,
                  # a chain needs no tree mask: only trees wider than one take the masked kernel
                  trees=engine.drafter is not None and engine.draft_tokens > 1 and engine.shape.width != 1,
                  eager_rows=_prompt_chunk_sizes(engine.prefill_chunk_tokens))
    try:
        engine.model.warm_up(spec, log, draft_layers=drafter.layers if isinstance(drafter, SelfDrafter) else (),
                             draft_rows=engine.max_batch)
        if isinstance(drafter, ModelDrafter):  # its prompt chunks are whatever it has not seen: any length
            drafter.model.warm_up(WarmUp(max_rows=engine.max_context,
                                         eager_rows=_prompt_chunk_sizes(engine.prefill_chunk_tokens)), log)
    except Exception as e:
        raise NtxError(f"warm-up failed: {type(e).__name__}: {e}") from e
    seconds = time.monotonic() - t0
    log(f"warm-up done in {seconds:.2f} s")
    return seconds


def _prompt_chunk_sizes(prefill_chunk_tokens: int) -> tuple[int, ...]:
    """Prompt chunk sizes to warm the eager path with: the full chunk and the powers of two from
    128 below it (a prompt's last chunk is any size; cuBLAS picks its kernels by size)."""
    return (prefill_chunk_tokens, *(n for n in (128 << k for k in range(20)) if n < prefill_chunk_tokens))


def _drafter(target: LlamaModel, backend: str, self_draft: bool | Sequence[int], self_draft_skip: Sequence[int],
             draft_model, max_batch: int, max_context: int) -> Drafter | None:
    if self_draft is not False and draft_model is not None:
        raise ConfigError("choose one drafter: --self-draft or --draft-model, not both")
    if self_draft is not False:
        return SelfDrafter(target, None if self_draft is True else list(self_draft), self_draft_skip)
    if draft_model is None:
        return None
    index = open_model(draft_model)
    check_same_vocabulary(target.index, index)
    draft = LlamaModel(index, make_backend(backend, index, max_seqs=max_batch, max_ctx=max_context))
    return ModelDrafter(draft)
