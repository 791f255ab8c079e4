"""The one way an engine is assembled: model file, backend, layer source, drafter, engine core.

``ntxctl generate --local``, the compute daemon, the in-process benchmarks and the tests all
build their engines here, so a model is sized, loaded and wired the same way everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

from ntx.daemons.compute.backend import Backend, WarmUp, make_backend
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.lookahead import LookaheadDrafter
from ntx.daemons.compute.lookup import CombinedDrafter, LookupDrafter
from ntx.daemons.compute.model import FileLayerStream, LayerStream, LlamaModel
from ntx.daemons.compute.replay import ReplayDrafter, load_references, load_trace
from ntx.daemons.compute.speculation import Drafter, ModelDrafter, SelfDrafter, check_same_vocabulary
from ntx.shared.config import EngineOptions
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import ModelIndex, open_model
from ntx.shared.kv_sizing import KvSizing
from ntx.shared.plan import HostRates, Plan
from ntx.shared.vocab import end_of_generation_ids


def build_engine(
    model: ModelIndex | str | os.PathLike,
    backend: Backend | str = "cpu",
    options: EngineOptions = EngineOptions(),
    *,
    resident_layers: Iterable[int] | None = None,
    stream: LayerStream | None = None,
    host_layers: Iterable[int] = (),
    host_wide_rows: int | None = None,
    host_rates: HostRates | None = None,
    progress: Callable[[int], None] | None = None,
    warm_up: bool = True,
    log: Callable[[str], None] | None = None,
) -> EngineCore:
    """An engine for ``model`` (an index or a GGUF path) on ``backend`` (a name, or a backend
    already made — the compute daemon makes its own first, to allocate the ring's slots), shaped
    by ``options`` (validated here; the compute daemon passes its ``InstanceConfig``).

    ``resident_layers`` None keeps every layer resident; ``host_layers`` (the plan's cpu tier)
    are held in host memory and computed by the host's cores whatever the backend (in passes of
    more rows than ``host_wide_rows``, by the backend: ``HostTier``; None: its default; with
    ``host_rates``, the plan's speeds, a pass of several rows moves only part of them); the others come
    from ``stream``, or are re-read from the file every pass when no stream is given;
    ``options.skip_layers`` never run.
    Contexts hold ``options.ctx`` positions (at most what the model was trained for), for up to
    ``options.max_batch`` sequences at once. ``progress(i)`` is called as resident layer i is loaded.

    Speculative decoding (``speculation.py``): ``options.self_draft`` drafts with the resident
    layers (True) or the given resident layers, less ``self_draft_skip``; ``draft_model`` with a
    small model of the same vocabulary, all resident on the same backend; ``draft_tokens`` per
    sequence and pass, as a tree of ``draft_width`` (None: chosen from measured acceptance; 1: a
    chain). ``draft`` (``lookup.py``): drafting without a model, by prompt lookup (``ngram``) or
    also in the recent requests (``suffix``), alone or merged with the drafter above.
    ``draft_replay`` (benchmarks only, ``replay.py``): a file of recorded greedy
    continuations proposed (as chains) with each token made wrong with probability
    ``draft_replay_p``, or drafted and accepted pass by pass as the file's trace says; the
    drafter chosen by the other options, if any, still runs first and its proposals are discarded.

    Before it returns, the engine is warmed up (``warm_up_engine``) unless ``warm_up`` is False
    (the caller then does it, timed): every kernel and CUDA graph its passes can need is built,
    so no request pays for it; ``log`` gets one line per stage."""
    index = model if isinstance(model, ModelIndex) else open_model(model)
    options = options.validate().for_model(index.hparams.n_ctx_train)
    if isinstance(backend, str):
        backend = backend_for(backend, index, options)
    skip_layers = options.skip_layers or ()
    kept = set(range(index.hparams.n_layers)) - set(skip_layers)
    host = set(host_layers)
    if stream is None and resident_layers is not None and set(resident_layers) | host != kept:
        stream = FileLayerStream(index, sorted(kept - set(resident_layers) - host))
    llama = LlamaModel(index, backend, resident_layers=resident_layers, stream=stream, progress=progress,
                       skip_layers=skip_layers, host_layers=host, kernels=options.kernel_options,
                       host_wide_rows=host_wide_rows, host_rates=host_rates)
    drafter = _drafter(llama, backend.name, options)
    if options.draft is not None:
        lookup = LookaheadDrafter() if options.draft == "lookahead" else LookupDrafter(options.draft)
        drafter = CombinedDrafter(drafter, lookup) if drafter is not None else lookup
    if options.draft_replay is not None:
        drafter = ReplayDrafter(load_references(options.draft_replay), options.draft_replay_p, index.hparams.n_vocab,
                                inner=drafter, trace=load_trace(options.draft_replay))
    engine = EngineCore(llama, stop_token_ids=end_of_generation_ids(index.metadata), max_batch=options.max_batch,
                        prefill_chunk_tokens=options.prefill_chunk_tokens, max_context=options.ctx,
                        drafter=drafter, draft_tokens=options.draft_tokens, draft_width=options.draft_width,
                        draft_fixed=options.draft_fixed)
    if warm_up:
        warm_up_engine(engine, log or (lambda line: None))
    return engine


def backend_for(name: str, index: ModelIndex, options: EngineOptions, plan: Plan | None = None) -> Backend:
    """The backend called ``name`` for ``index``, sized and switched by ``options``: the one
    place an engine's options become ``make_backend``'s arguments. ``plan``: the instance's tier
    plan, which sizes the KV page pool (without one: pages for every sequence at full context) and
    says where the token embedding stays."""
    options = options.for_model(index.hparams.n_ctx_train)
    kv = None
    if plan is not None:
        kv = KvSizing(plan.kv_chunk_pages, plan.kv_chunks, plan.kv_max_chunks, kv_namespace(index, options))
    return make_backend(name, index, max_seqs=options.max_batch, max_ctx=options.ctx, kernels=options.kernel_options,
                        kv=kv, embed_in_host=plan is not None and plan.embed_in_host)


def kv_namespace(index: ModelIndex, options: EngineOptions) -> bytes:
    """What the K/V values of this engine depend on besides the tokens (the prefix cache's
    namespace): the model file as it is on disk, and the layers it skips."""
    ident = []
    for path in sorted({s.path for layer in index.layers for s in layer.spans}):
        st = os.stat(path)
        ident.append(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}")
    return ("|".join(ident) + f"|skip={sorted(options.skip_layers or ())}").encode()


def warm_up_engine(engine: EngineCore, log: Callable[[str], None]) -> float:
    """Build every kernel and graph ``engine``'s passes can need (``LlamaModel.warm_up``), its
    drafter's too; returns the seconds it took. The largest pass: a prompt chunk beside every
    other sequence's decode row and draft tree. A failure raises ``NtxError`` with one line."""
    t0 = time.monotonic()
    drafter = engine.drafter
    while isinstance(drafter, (ReplayDrafter, CombinedDrafter)):  # down to the drafter that runs passes
        drafter = drafter.inner
    spec = WarmUp(max_rows=engine.max_pass_rows,
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


def _drafter(target: LlamaModel, backend: str, options: EngineOptions) -> Drafter | None:
    """The drafter ``options`` name (``EngineOptions.validate`` has checked there is one at most)."""
    if options.drafts_itself:
        return SelfDrafter(target, options.self_draft_layers, options.self_draft_skip or ())
    if options.draft_model is None:
        return None
    index = open_model(options.draft_model)
    check_same_vocabulary(target.index, index)
    return ModelDrafter(LlamaModel(index, backend_for(backend, index, options)))
