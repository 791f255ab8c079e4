"""The backend seam: the operations a forward pass needs, filled by numpy (cpu) or cupy (cuda).

The model code above this seam (``model.py``) only orders the work: embed, run each layer from
wherever its bytes are, produce logits. Everything that touches numbers lives behind it, so the
CUDA backend can fuse kernels and capture graphs without the model code knowing.

Layers reach a backend as a byte buffer in the slot layout of ``ntx.shared.gguf_index`` (the
layer's file span(s), page-aligned), whoever filled it: the file, the dma daemon's pinned RAM,
or a streamed ring slot. ``prepare_layer`` turns that buffer into whatever the backend runs from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from ntx.daemons.compute.batch import StepBatch
from ntx.shared.gguf_index import LayerInfo, ModelIndex


MAX_PICK_K = 256  # the most candidates a backend selects per row; beyond it the whole row is copied


@dataclass(frozen=True)
class Pick:
    """What the engine needs from one row of logits: its ``k`` largest entries (ids and values,
    best first, ties to the lower id), with ``lse`` also the row's log-normaliser
    (log-probabilities are value - lse); ``k == 0``: the whole row."""

    k: int
    lse: bool = False


@dataclass
class Picked:
    """One row's answer to a ``Pick``: ``row`` [V] when the whole row was asked for, else
    ``ids`` [k] int64 and ``vals`` [k] float64 best first, and ``lse`` when asked."""

    ids: np.ndarray | None = None
    vals: np.ndarray | None = None
    lse: float | None = None
    row: np.ndarray | None = None


def top_entries(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of ``row`` [V], best first, ties to the lower id."""
    n = row.shape[0]
    if k >= n:
        return np.lexsort((np.arange(n), -row))
    kth = np.partition(row, n - k)[n - k]  # the k-th largest value
    cand = np.flatnonzero(row >= kth)  # ascending ids, >= k of them (ties at kth)
    return cand[np.lexsort((cand, -row[cand]))[:k]]


def log_normaliser(row: np.ndarray) -> float:
    """log(sum(exp(row))) in float64, stable."""
    x = np.asarray(row, dtype=np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


def pick_on_host(logits: np.ndarray, picks: list[Pick]) -> list[Picked]:
    """``Pick`` answered from logits [N, V] already on the host."""
    out = []
    for row, p in zip(logits, picks):
        if p.k == 0:
            out.append(Picked(row=row))
            continue
        ids = top_entries(row, p.k)
        out.append(Picked(ids=ids.astype(np.int64), vals=row[ids].astype(np.float64),
                          lse=log_normaliser(row) if p.lse else None))
    return out


class Backend(ABC):
    name: str = "?"

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        self.hp = index.hparams

    @abstractmethod
    def load_globals(self, raw: dict[str, np.ndarray]) -> None:
        """Take the non-layer tensors (``token_embd``, ``output_norm``, optional ``output`` and
        ``rope_freqs``) from their raw GGUF bytes (uint8 arrays)."""

    @abstractmethod
    def prepare_layer(self, layer: LayerInfo, buf: Any, *, keep: bool) -> Any:
        """Make runnable weights from a slot-layout buffer. ``keep``: the weights stay for the
        life of the model (resident), so a backend may convert them once; otherwise the buffer is
        handed back right after the layer ran, and nothing may keep a reference to it."""

    @abstractmethod
    def alloc_sequence(self, seq_id: int, capacity_tokens: int) -> None:
        """Reserve a KV cache for a sequence of up to ``capacity_tokens`` positions."""

    @abstractmethod
    def free_sequence(self, seq_id: int) -> None: ...

    @abstractmethod
    def embed(self, batch: StepBatch) -> Any:
        """x: [T, D] hidden states for the batch's tokens."""

    @abstractmethod
    def layer_forward(self, layer_idx: int, weights: Any, x: Any, batch: StepBatch) -> Any:
        """One transformer block: x [T, D] -> x [T, D], appending K/V to each sequence's cache."""

    @abstractmethod
    def logits(self, x: Any, batch: StepBatch) -> np.ndarray:
        """Final norm and head for the rows in ``batch.logit_rows``: [N_out, V] float32 on host."""

    def pick(self, x: Any, batch: StepBatch, picks: list[Pick]) -> list[Picked]:
        """Final norm and head for ``batch.logit_rows``, reduced per row as ``picks`` asks
        (one Pick per logit row). A GPU backend selects on the device and copies k entries
        instead of the vocabulary; this default takes the host logits."""
        return pick_on_host(self.logits(x, batch), picks)

    def sync(self) -> None:
        """Wait until the work queued so far is done (before a streamed slot is handed back)."""


def make_backend(name: str, index: ModelIndex, max_seqs: int = 16, max_ctx: int = 4096) -> Backend:
    """The backend called ``name`` ("cpu" or "cuda"), sized for ``max_seqs`` sequences of up to
    ``max_ctx`` positions (the cuda backend reserves its KV cache up front)."""
    if name == "cpu":
        from ntx.daemons.compute.cpu_backend import CpuBackend

        return CpuBackend(index)
    if name == "cuda":
        from ntx.daemons.compute.cuda_check import require_cuda

        require_cuda()
        from ntx.daemons.compute.cuda.backend import CudaBackend  # noqa: PLC0415 (optional dep)

        return CudaBackend(index, max_seqs=max_seqs, max_ctx=max_ctx)
    from ntx.shared.errors import ConfigError

    raise ConfigError(f"unknown backend {name!r} (choose cuda or cpu)")
