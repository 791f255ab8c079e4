"""The Llama model: one block written as math over the backend's operations, and the order of a pass.

``llama_block`` is the only place the transformer layer is written; every backend runs it
through its operations (``backend.py``). ``LlamaModel.forward`` is one *pass*: embed, every layer
once — runs of resident layers as the backend may record them (``run_captured``), streamed layers
as their slot buffers arrive from a ``LayerStream`` (the token ring in the pipeline) and are
handed straight back — then the head, for every sequence chunk in the batch. The model numbers
its passes; a stream that failed a pass says where numbering resumes (``abort_pass``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from ntx.daemons.compute.backend import (Backend, CaptureRun, PendingPicks, Pick, Picked, WarmUp, Workspace,
                                        rope_divisors)
from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.host_tier import HostTier
from ntx.daemons.compute.quants import dequantize
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import QKV_BIASES, ModelIndex
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.layer_bytes import read_layer, read_layer_into, read_tensor
from ntx.shared.plan import GPU, STREAMED, TIER, HostRates, PassRoads


def llama_block(ops: Backend, layer_idx: int, w: dict[str, Any], ws: Workspace) -> None:
    """One transformer block on the pass's hidden state ws.x [T, D], in place:

        x = x + W_o · attention(rope(W_q · norm(x)), cache ∪ rope(W_k · norm(x)), W_v · norm(x))
        x = x + W_down · (silu(W_gate · norm(x)) * W_up · norm(x))

    A Qwen2 block is the same with a bias added to each of the three first products, and RoPE
    rotating each head's halves against each other (``Backend.qkv_bias_pairs``).
    """
    # h = norm(x) [T, D]; q = h W_q^T [T, H*hd], k, v [T, Hkv*hd]
    ops.norm_matmuls(ws.x, w["attn_norm"], ws.h, ((w["attn_q"], ws.q), (w["attn_k"], ws.k), (w["attn_v"], ws.v)))
    if ops.hp.qkv_bias or ops.hp.rope_neox:  # Qwen2: q, k, v += biases; q, k in the pair order rope rotates
        ops.qkv_bias_pairs(ws.q, ws.k, ws.v, tuple(w.get(n) for n in QKV_BIASES), ws)
    ops.rope_kv_write(layer_idx, ws.q, ws.k, ws.v, ws)  # q, k rotated; k, v into the cache
    # attn = attention(q) [T, H*hd]; o = attn W_o^T [T, D]
    ops.attention_matmul(layer_idx, ws.q, ws, ws.attn, w["attn_output"], out=ws.o)
    # x += o; h = norm(x); gate, up = h W_gate^T, h W_up^T [T, F]
    ops.norm_matmuls(ws.x, w["ffn_norm"], ws.h, ((w["ffn_gate"], ws.gate), (w["ffn_up"], ws.up)), delta=ws.o)
    # act = silu(gate) * up [T, F]; x += act W_down^T
    ops.swiglu_matmul_add(ws.gate, ws.up, ws.act, w["ffn_down"], ws.x, tmp=ws.o)


class LayerStream(Protocol):
    """Where non-resident layers come from, one pass at a time, in layer order. A pass of several
    rows (``begin_pass(tier_layers=...)``) brings some of the cpu tier's layers too (of
    ``wide_layers``), for the main backend to run: the host's cores are bound by arithmetic there
    (``HostTier.streamed_in`` says which)."""

    wide_layers: list[int]  # the cpu tier's layers a pass may stream too (set by the model)

    def begin_pass(self, pass_id: int, tier_layers: Sequence[int] = ()) -> int:
        """Pass ``pass_id`` begins, streaming ``tier_layers`` of ``wide_layers`` too; returns the
        id it runs as (a later one where the stream had asked for it ahead with other tier
        layers and gave that up)."""

    def acquire(self, layer_idx: int, pass_id: int) -> Any:
        """Block until the layer's slot buffer is ready; return it. Raises ``NtxError`` when the
        layer cannot be delivered for this pass."""

    def release(self, layer_idx: int, pass_id: int) -> None:
        """The layer has run: its slot may be refilled."""

    def end_pass(self, pass_id: int) -> None: ...

    def abort_pass(self, pass_id: int) -> int:
        """The pass failed: hand back whatever it (and any pass already asked for after it)
        holds; returns the first pass id that is still fresh."""

    layers: list[int]  # the layers the passes from now on stream
    n_slots: int  # the layers it can hold at once (copied ahead of the one running)
    standby: set[int]  # layers that may be demoted to streamed (their bytes can be brought in)

    def layers_for(self, pass_id: int) -> list[int]:
        """The layers pass ``pass_id`` streams, in order (the cpu tier's it takes among them)."""

    def set_layers(self, layers: list[int]) -> int:
        """Stream ``layers`` from the first pass not yet asked for on; returns that pass."""

    def poll(self) -> None:
        """Take what arrived without waiting (``standby`` announcements)."""

    def want_standby(self) -> None:
        """Ask for the standby copies not there yet to come now (the KV cache is short of pages)."""


class FileLayerStream:
    """Reads each streamed layer from the file every pass (in-process; tests and the in-process
    benchmarks). The pipeline replaces this with the ring of the reader and dma daemons. Every
    layer can be read from the file, so every layer counts as having a standby copy: a layer may
    be demoted to streamed (``set_layers``) from the next pass on."""

    def __init__(self, index: ModelIndex, streamed_layers: Sequence[int] = ()) -> None:
        self.index = index
        self.buf = np.empty(index.max_layer_image_bytes, dtype=np.uint8)
        self.layers = list(streamed_layers)
        self.standby = set(range(index.hparams.n_layers))
        self.wide_layers: list[int] = []
        self.n_slots = 1  # one layer read at a time, in the pass
        self._begun = -1  # the last pass begun
        self._begun_tier: tuple[int, ...] = ()  # the cpu tier's layers it streams

    def layers_for(self, pass_id: int) -> list[int]:
        if pass_id == self._begun and self._begun_tier:
            return sorted(set(self.layers) | set(self._begun_tier))
        return self.layers

    def set_layers(self, layers: list[int]) -> int:
        self.layers = list(layers)
        return self._begun + 1

    def poll(self) -> None:
        pass

    def want_standby(self) -> None:
        pass

    def begin_pass(self, pass_id: int, tier_layers: Sequence[int] = ()) -> int:
        self._begun, self._begun_tier = pass_id, tuple(sorted(set(tier_layers) & set(self.wide_layers)))
        return pass_id

    def acquire(self, layer_idx: int, pass_id: int) -> np.ndarray:
        return read_layer_into(self.index.layers[layer_idx], self.buf)

    def release(self, layer_idx: int, pass_id: int) -> None:
        pass

    def end_pass(self, pass_id: int) -> None:
        pass

    def abort_pass(self, pass_id: int) -> int:
        return max(pass_id, self._begun + 1)


RESIDENT, STREAMED, HOST = "resident", "streamed", "host"  # how a run of layers reaches a pass


def _runs(resident: set[int], n_layers: int, skipped: set[int] = frozenset(),
          host: set[int] = frozenset()) -> list[tuple[int, int, str]]:
    """The layers that run, cut into maximal runs of consecutive layers of one kind: (first,
    end, kind), kind RESIDENT (held by the backend), HOST (the cpu tier's, ``host_tier.py``) or
    STREAMED. A skipped layer ends a run and belongs to none."""
    runs: list[tuple[int, int, str]] = []
    for i in range(n_layers):
        if i in skipped:
            continue
        kind = RESIDENT if i in resident else HOST if i in host else STREAMED
        if runs and runs[-1][1] == i and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], i + 1, kind)
        else:
            runs.append((i, i + 1, kind))
    return runs


def _spans(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted layer ids cut into maximal runs of consecutive ids: [first, end)."""
    spans: list[tuple[int, int]] = []
    for i in sorted(layers):
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans


class LlamaModel:
    """A Llama GGUF model on a backend: resident layers prepared once, the rest streamed.

    ``forward`` runs one pass and returns logits or picks. Runs of resident layers are handed to
    the backend as one request each (``run_captured``, keyed by the run), so a GPU backend may
    replay a recorded graph of the whole run; the first run also embeds the tokens.
    ``skip_layers`` never run (``--skip-layers``): the hidden state passes them unchanged, they
    are neither loaded nor streamed, and their KV entries are never written nor read.
    ``host_layers`` (the plan's cpu tier) are held in host memory and run by the host's cores
    (``HostTier``), whatever the backend; ``kernels`` switches those host kernels."""

    def __init__(
        self,
        index: ModelIndex,
        backend: Backend,
        resident_layers: Iterable[int] | None = None,
        stream: LayerStream | None = None,
        progress=None,
        skip_layers: Iterable[int] = (),
        host_layers: Iterable[int] = (),
        kernels: KernelOptions | None = None,
        host_wide_rows: int | None = None,
        host_rates: HostRates | None = None,
    ) -> None:
        self.index = index
        self.hp = index.hparams
        self.backend = backend
        self.skip_layers = sorted(set(skip_layers))
        skipped = set(self.skip_layers)
        kept = [i for i in range(self.hp.n_layers) if i not in skipped]
        if not kept:
            raise ValueError("every layer skipped")
        host = set(host_layers) - skipped
        resident = set(kept if resident_layers is None else resident_layers) - skipped - host
        self.host_layers = sorted(host)
        self.streamed_layers = [i for i in kept if i not in resident and i not in host]
        if self.streamed_layers and stream is None:
            raise ValueError("streamed layers need a LayerStream")
        self.stream = stream if self.streamed_layers else None
        if isinstance(self.stream, FileLayerStream) and not self.stream.layers:
            self.stream.layers = list(self.streamed_layers)
        self._skipped = skipped
        self.runs = _runs(resident, self.hp.n_layers, skipped, host)
        self._runs_of: dict[tuple[int, ...], list[tuple[int, int, str]]] = {tuple(self.streamed_layers): self.runs}
        self.residency_gen = 0  # bumped when a layer becomes resident again: its graphs are recorded anew
        raw = {name: read_tensor(t) for name, t in index.globals.items()}
        freqs = None
        if "rope_freqs" in raw:
            t = index.globals["rope_freqs"]
            freqs = dequantize(raw.pop("rope_freqs"), t.ggml_type, t.shape)
        divisors = rope_divisors(self.hp, freqs)
        backend.load_globals(raw, divisors)
        self.host: HostTier | None = None
        if self.host_layers:
            # its wide passes: the stream brings its layers where there is one (in the pipeline,
            # dma from its pinned RAM), else the tier copies them itself (``HostTier.run``)
            self.host = HostTier(index, self.host_layers, backend, kernels, divisors, progress,
                                 wide_rows=host_wide_rows, staged=self.stream is None, rates=host_rates)
            if self.stream is not None and self.host.wide_rows is not None:
                self.stream.wide_layers = list(self.host_layers)
        self.resident: dict[int, Any] = {}
        for i in sorted(resident):
            self.resident[i] = backend.prepare_layer(index.layers[i], read_layer(index.layers[i]), keep=True)
            if progress:
                progress(i)
        self.next_pass_id = 0  # the one pass counter: the engine, the ring and the clocks read it

    @property
    def can_feed(self) -> bool:
        """Whether ``launch`` takes ``feed``: every layer resident. A streamed layer's pass waits
        on the ring from the host, and a cpu-tier layer's on the host's cores, so a pass queued
        behind it would overlap nothing."""
        return self.stream is None and self.host is None

    def forward(self, batch: StepBatch, picks: list[Pick] | None = None) -> np.ndarray | list[Picked]:
        """Run one pass; returns logits [N_out, V] for ``batch.logit_rows``, or with ``picks``
        (one per logit row) what each row was asked for (``Backend.pick``). A streamed layer
        that cannot be delivered raises ``NtxError`` after the stream gave the pass up."""
        if picks is None:
            return self._pass(batch, None, self.backend.logits)
        return self.launch(batch, picks).result()

    def launch(self, batch: StepBatch, picks: list[Pick], feed: PendingPicks | None = None) -> PendingPicks:
        """``forward`` with picks, returning once the pass is queued (``Backend.pick_launch``):
        on a GPU the host may queue the next pass while this one runs. ``feed``: a previous,
        maybe unfinished pass whose top-1 ids become this pass's tokens, one per row, on the
        device (greedy decode one pass ahead of the host); the batch's own tokens are then
        placeholders. Only where ``can_feed``, on single-token chunks."""
        if feed is not None:
            if not self.can_feed:
                raise ValueError("launch(feed=...) needs every layer resident")
            if feed.top1 is None or len(feed.top1) != batch.n_tokens or len(batch.chunks) != batch.n_tokens:
                raise ValueError("launch(feed=...): one single-token chunk per row of the feeding pass")
        return self._pass(batch, feed, lambda ws: self.backend.pick_launch(ws, picks))

    def _pass(self, batch: StepBatch, feed: PendingPicks | None, finish: Callable[[Workspace], Any]) -> Any:
        """One numbered pass of ``batch`` (``feed``: see ``launch``), then ``finish(ws)`` on its
        workspace: the head and what comes back of it."""
        pass_id = self.next_pass_id
        be = self.backend
        with be.scope():
            ws = be.begin_pass(batch)
            if feed is not None:
                be.feed_tokens(ws, feed.top1)
            if self.stream:
                pass_id = self.stream.begin_pass(pass_id, tier_layers=self._tier_streamed(batch))
            self.next_pass_id = pass_id + 1
            try:
                for n, (first, end, kind) in enumerate(self._runs_for(pass_id)):
                    embed = n == 0
                    if kind == RESIDENT:
                        key, run = self._capture_request(first, end, embed)
                        be.run_captured(key, ws, partial(run, ws))
                        continue
                    if embed:
                        be.embed(ws)
                    if kind == HOST:
                        self.host.run(first, end, ws, pass_id)
                    else:
                        for i in range(first, end):
                            self._streamed_layer(i, pass_id, ws)
            except NtxError:
                if self.stream:  # its slots go back; passes it had asked for ahead are dropped
                    self.next_pass_id = max(self.next_pass_id, self.stream.abort_pass(pass_id))
                raise
            if self.stream:
                self.stream.end_pass(pass_id)
            return finish(ws)

    def _tier_streamed(self, batch: StepBatch) -> tuple[int, ...]:
        """The cpu tier's layers that ``batch``'s pass streams and runs on the backend
        (``HostTier.streamed_in``, by its rows and what else the pass moves); the rest of the
        tier runs on the host's cores."""
        if self.host is None or self.stream is None or not self.stream.wide_layers:
            return ()
        return self.host.streamed_in(batch.n_tokens, self._pass_roads)

    def _pass_roads(self) -> PassRoads:
        """The pass's layers in order, each one's road and bytes, and the ring's slots (a
        share's choice, ``HostTier.streamed_in``)."""
        tier, streamed, sizes = self.host.layer_set, set(self.stream.layers), self.index.layers
        kinds, nbytes = [], []
        for i in range(self.index.hparams.n_layers):
            kind = GPU if i in self.resident else TIER if i in tier else STREAMED if i in streamed else None
            if kind is not None:  # None: skipped
                kinds.append(kind)
                nbytes.append(sizes[i].nbytes)
        return PassRoads(tuple(kinds), tuple(nbytes), self.stream.n_slots)

    def draft_forward(self, batch: StepBatch, layers: Sequence[int], picks: list[Pick]) -> list[Picked]:
        """A pass through resident ``layers`` alone (in order; the others skipped) and the head:
        the model drafting for itself. It writes those layers' KV entries at the batch's
        positions, which the verify pass then rewrites; it streams nothing and numbers no pass.
        A run of layers that a full pass also runs is the same capture request (one graph)."""
        be = self.backend
        with be.scope():
            ws = be.begin_pass(batch)
            for n, (first, end) in enumerate(_spans(layers)):
                key, run = self._capture_request(first, end, n == 0)
                be.run_captured(key, ws, partial(run, ws))
            return be.pick(ws, picks)

    def warm_up(self, spec: WarmUp, log: Callable[[str], None], draft_layers: Sequence[int] = (),
                draft_rows: int = 0) -> None:
        """Have the backend build, before the first request, every kernel and graph this model's
        passes can need (``Backend.warm_up``): each run of resident layers as ``forward`` asks
        for it, on passes as ``spec`` describes, and ``draft_forward``'s spans of
        ``draft_layers`` (a self-draft) at up to ``draft_rows`` rows. Streamed layers run outside
        the warm passes: the operations they share with no resident layer (matrix types only
        they have; attention and the rest when no layer is resident) are built apart."""
        runs = [self._capture_request(first, end, n == 0)
                for n, (first, end, kind) in enumerate(self.runs) if kind == RESIDENT]
        eager_ops = None
        outside = self.streamed_layers + (self.host_layers if self.host is not None and self.host.wide_rows is not None
                                          else [])  # layers the backend runs outside the warm passes
        if outside:
            spec = replace(spec, compile_qtypes=spec.compile_qtypes | (self._qtypes(outside) - self._qtypes(self.resident)))
            eager_ops = partial(self._weightless_ops, outside[0])
        self.backend.warm_up(runs, spec, log, eager_ops)
        if self.host is not None:
            self.host.warm_up(log)
        if draft_layers:
            spans = [self._capture_request(first, end, n == 0) for n, (first, end) in enumerate(_spans(draft_layers))]
            self.backend.warm_up(spans, WarmUp(max_rows=draft_rows), log)

    def _capture_request(self, first: int, end: int, embed: bool) -> CaptureRun:
        """Resident layers [first, end) (the tokens embedded first when ``embed``) as a request
        to the backend: its key (one recording per key) and the run, given the workspace. The one
        place the key is made, so the warm-up records exactly what passes replay. The key names
        the residency generation: a run recorded before a layer in it was demoted and brought back
        holds that layer's old weights and is never replayed."""
        return ("layers", first, end, embed, self.residency_gen), partial(self._resident_run, first, end, embed)

    # -- residency: layers demoted to streamed and back (residency.py decides when) -------------
    def _runs_for(self, pass_id: int) -> list[tuple[int, int, str]]:
        """The runs of pass ``pass_id``: resident where the stream does not bring the layer in."""
        if self.stream is None:
            return self.runs
        streamed = tuple(self.stream.layers_for(pass_id))
        runs = self._runs_of.get(streamed)
        if runs is None:
            kept = set(range(self.hp.n_layers)) - self._skipped
            host = set(self.host_layers) - set(streamed)  # a wide pass streams the tier's layers
            runs = self._runs_of[streamed] = _runs(kept - set(streamed) - host, self.hp.n_layers, self._skipped, host)
        return runs

    def demote(self, layers: Sequence[int]) -> int:
        """Stream ``layers`` (resident now; dma holds their standby copies) from the next pass on
        and drop their weights; returns that pass. The pass already asked of dma is given up
        (``abort_pass``: its slots go back as they come) so that the change is immediate."""
        if self.stream is None:
            raise ValueError("demotion needs a layer stream")
        bad = [i for i in layers if i not in self.resident]
        if bad:
            raise ValueError(f"layers {bad} are not resident")
        self.backend.sync()  # nothing queued may still read their weights
        self.next_pass_id = max(self.next_pass_id, self.stream.abort_pass(self.next_pass_id))
        streamed = sorted(set(self.stream.layers) | set(layers))
        first = self.stream.set_layers(streamed)
        for i in layers:
            del self.resident[i]
        self.streamed_layers = streamed
        return first

    def promote(self, layer: int, buf: Any) -> int:
        """Make ``layer`` resident again from ``buf`` (its layer-image bytes): streamed until the
        passes already asked of dma have run, resident from the pass returned."""
        if self.stream is None or layer not in self.stream.layers:
            raise ValueError(f"layer {layer} is not streamed")
        self.resident[layer] = self.backend.prepare_layer(self.index.layers[layer], buf, keep=True)
        self.residency_gen += 1
        streamed = [i for i in self.stream.layers if i != layer]
        self.streamed_layers = streamed
        return self.stream.set_layers(streamed)

    def kv_keep(self, seq_id: int, src_positions: list[int], dst_positions: list[int]) -> None:
        """``Backend.kv_keep`` in every layer: the backend's and the cpu tier's."""
        self.backend.kv_keep(seq_id, src_positions, dst_positions)
        if self.host is not None:
            self.host.kv_keep(seq_id, src_positions, dst_positions)

    def _qtypes(self, layers: Iterable[int]) -> frozenset[int]:
        """The GGUF types of the matrices of ``layers``."""
        return frozenset(int(t.ggml_type) for i in layers for t in self.index.layers[i].tensors.values()
                         if len(t.shape) == 2)

    def _weightless_ops(self, layer_idx: int, ws: Workspace) -> None:
        """The block's operations that take no weights, on layer ``layer_idx``'s cache (rows
        that write or read no cache entry: the warm-up's)."""
        be = self.backend
        be.rope_kv_write(layer_idx, ws.q, ws.k, ws.v, ws)
        if self.host is not None and self.host.wide_rows is not None:  # the tier's wide passes: in two steps
            be.rope(ws.q, ws.k, ws)
            be.kv_write(layer_idx, ws.k, ws.v, ws)
        be.attention(layer_idx, ws.q, ws, out=ws.attn)
        be.swiglu(ws.gate, ws.up, out=ws.act)
        be.add(ws.x, ws.o, out=ws.x)

    def _resident_run(self, first: int, end: int, embed: bool, ws: Workspace) -> None:
        if embed:
            self.backend.embed(ws)
        for i in range(first, end):
            llama_block(self.backend, i, self.resident[i], ws)

    def _streamed_layer(self, i: int, pass_id: int, ws: Workspace) -> None:
        buf = self.stream.acquire(i, pass_id)
        try:
            w = self.backend.prepare_layer(self.index.layers[i], buf, keep=False)
            # a cpu-tier layer in a wide pass: its keys and values go to the tier's cache too
            ops = self.host.wide_ops(ws, pass_id) if self.host is not None and i in self.host.layer_set else self.backend
            llama_block(ops, i, w, ws)
        finally:
            self.stream.release(i, pass_id)
