"""Row buckets of the cuda backend: which row count a pass runs at, and its padded token rows.

A CUDA graph replays one fixed shape. A pass of T rows (T <= ``MAX_GRAPH_ROWS``) therefore runs
in the workspace of the next bucket (1..8 each, then multiples of 8: the matrix kernels' cost
steps at multiples of 8 rows), its rows after the real ones inert: token 0 at position 0 in no
cache slot (slot -1: kv_append skips the row, attention gives it zeros), one key, outside every
tree. The real rows compute exactly what they would alone; only their logit rows are read.
So a handful of graphs per resident run covers every batch, prompt chunk and tree size below
the limit, and the warm-up can record all of them before the first request.

No cupy here: the planner (``memory.py``) counts the kept workspaces without a GPU, and the
CPU tests check the bucket choice and the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.cuda import tuning

# Passes of up to this many rows are padded to a bucket and replayed as CUDA graphs: every launch
# in them is capturable and uses no buffer a later, larger call may reallocate (tuning.py).
MAX_GRAPH_ROWS: int = tuning.MAX_GRAPH_ROWS
BUCKET_STEP_ROWS = 8  # bucket sizes above 8 rows: multiples of this

INERT_SLOT = -1  # a cache slot no sequence has: kv_append writes nothing, attention reads nothing


def bucket_sizes(max_graph_rows: int = MAX_GRAPH_ROWS) -> list[int]:
    """Every bucket up to ``max_graph_rows``, ascending: 1..8, then 16, 24, ... (and
    ``max_graph_rows`` itself when it is not a multiple of 8)."""
    if max_graph_rows < 1:
        return []
    sizes = list(range(1, min(BUCKET_STEP_ROWS, max_graph_rows) + 1))
    sizes += list(range(2 * BUCKET_STEP_ROWS, max_graph_rows + 1, BUCKET_STEP_ROWS))
    if sizes[-1] != max_graph_rows:
        sizes.append(max_graph_rows)
    return sizes


def row_bucket(n_rows: int, max_graph_rows: int = MAX_GRAPH_ROWS) -> int | None:
    """The rows a pass of ``n_rows`` runs at: the smallest bucket that holds it, or None above
    ``max_graph_rows`` (the pass runs eagerly at its own size)."""
    if n_rows < 1:
        raise ValueError(f"a pass has at least one row, not {n_rows}")
    if n_rows > max_graph_rows:
        return None
    if n_rows <= BUCKET_STEP_ROWS:
        return n_rows
    return min(-(-n_rows // BUCKET_STEP_ROWS) * BUCKET_STEP_ROWS, max_graph_rows)


@dataclass
class PassRows:
    """One pass's token rows on the host, ``rows`` long (int32 each): the real rows first, inert
    rows after them. ``has_trees``: some chunk is a tree of more than one row (attention then
    takes the masked kernel); ``tree_base`` is -1 on every other row."""

    tokens: np.ndarray
    positions: np.ndarray  # RoPE positions
    cache_positions: np.ndarray  # where each row's K and V go
    slots: np.ndarray  # the row's sequence's cache slot; INERT_SLOT on padding
    kv_lens: np.ndarray  # keys each row sees: cache_positions + 1
    tree_base: np.ndarray  # cache position of the row's tree root, -1 outside trees
    has_trees: bool


def tree_chunks(batch: StepBatch) -> list[tuple[int, int]]:
    """(chunk index, first row) of the chunks that are trees of more than one row (a one-row
    tree sees the prefix and itself, as a plain row does)."""
    return [(i, r0) for i, (c, r0) in enumerate(zip(batch.chunks, batch.row_starts))
            if c.parents is not None and c.n_tokens > 1]


def pass_rows(batch: StepBatch, chunk_slots: Sequence[int], rows: int) -> PassRows:
    """``batch``'s rows padded with inert ones to ``rows``; ``chunk_slots``: each chunk's cache slot."""
    T = batch.n_tokens
    if rows < T:
        raise ValueError(f"{T} rows do not fit in {rows}")

    def padded(real: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(rows, fill, dtype=np.int32)
        out[:T] = real
        return out

    slots = np.full(rows, INERT_SLOT, dtype=np.int32)
    tree_base = np.full(rows, -1, dtype=np.int32)
    for c, r0, slot in zip(batch.chunks, batch.row_starts, chunk_slots):
        slots[r0 : r0 + c.n_tokens] = slot
    trees = tree_chunks(batch)
    for i, r0 in trees:
        c = batch.chunks[i]
        tree_base[r0 : r0 + c.n_tokens] = c.start_pos
    return PassRows(
        tokens=padded(batch.tokens, 0), positions=padded(batch.positions, 0),
        cache_positions=padded(batch.cache_positions, 0), slots=slots,
        kv_lens=padded(batch.cache_positions + 1, 1), tree_base=tree_base, has_trees=bool(trees),
    )


def inert_rows(rows: int) -> PassRows:
    """A pass of ``rows`` inert rows only: what the warm-up runs (it touches no KV cache)."""
    return pass_rows(StepBatch([]), [], rows)
