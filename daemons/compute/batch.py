"""What one forward pass computes: a batch of sequence chunks at their own positions.

A *pass* sweeps every layer once and advances every scheduled sequence: a decoding sequence by
one token, a prefilling one by a chunk of its prompt, a speculating one by its last token and a
tree of drafted tokens. All tokens of the pass are laid side by side (``T`` rows), so each weight
matrix is applied once per pass whatever the mix — the point of streaming a layer is to use it
for as many tokens as possible.

A chunk's rows are consecutive positions of its sequence, each seeing every position before it
(causal) — unless the chunk is a *tree* (``parents``): then row j sits at the position of its
depth (RoPE), its key and value are stored at cache position start_pos + j (every row its own
place), and it sees the cached prefix and its ancestors in the tree, not its siblings' branches.
A chain is the tree in which every row's parent is the row before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SeqChunk:
    """``tokens`` of sequence ``seq_id`` (its KV cache) from ``start_pos`` on; with ``parents``
    (one per row, the parent row's index, -1 for row 0) the rows form a tree rooted at row 0."""

    seq_id: int
    start_pos: int
    tokens: tuple[int, ...]
    all_logits: bool = False  # logits for every position (prompt scoring, verifying), not only the last
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or self.parents[0] != -1:
                raise ValueError("a tree chunk needs one parent per row, -1 for row 0")
            if any(not 0 <= p < j for j, p in enumerate(self.parents) if j):
                raise ValueError("a tree's rows must come after their parents")

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def end_pos(self) -> int:
        """One past the last cache position the chunk writes."""
        return self.start_pos + len(self.tokens)

    def depths(self) -> np.ndarray:
        """Each row's distance from row 0: [n] int (the row's RoPE position is start_pos + depth)."""
        if self.parents is None:
            return np.arange(self.n_tokens)
        d = np.zeros(self.n_tokens, dtype=np.int64)
        for j in range(1, self.n_tokens):
            d[j] = d[self.parents[j]] + 1
        return d

    def visible(self) -> np.ndarray | None:
        """For a tree: [n, n] bool, row j sees row i (i is j or an ancestor of j); None: causal."""
        if self.parents is None:
            return None
        n = self.n_tokens
        vis = np.eye(n, dtype=bool)
        for j in range(1, n):
            vis[j] |= vis[self.parents[j]]
        return vis


@dataclass
class StepBatch:
    chunks: list[SeqChunk]
    tokens: np.ndarray = field(init=False)  # [T] int32
    positions: np.ndarray = field(init=False)  # [T] int32: RoPE positions
    cache_positions: np.ndarray = field(init=False)  # [T] int32: where each row's K/V are stored
    row_starts: list[int] = field(init=False)  # first row of each chunk in the T rows
    logit_rows: np.ndarray = field(init=False)  # [N_out] int64: rows whose logits are returned

    def __post_init__(self) -> None:
        toks, pos, cpos, starts, out_rows = [], [], [], [], []
        row = 0
        for c in self.chunks:
            if not c.tokens:
                raise ValueError(f"empty chunk for sequence {c.seq_id}")
            starts.append(row)
            toks.extend(c.tokens)
            pos.extend(range(c.start_pos, c.end_pos) if c.parents is None else c.start_pos + c.depths())
            cpos.extend(range(c.start_pos, c.end_pos))
            out_rows.extend(range(row, row + c.n_tokens) if c.all_logits else [row + c.n_tokens - 1])
            row += c.n_tokens
        self.tokens = np.asarray(toks, dtype=np.int32)
        self.positions = np.asarray(pos, dtype=np.int32)
        self.cache_positions = np.asarray(cpos, dtype=np.int32)
        self.row_starts = starts
        self.logit_rows = np.asarray(out_rows, dtype=np.int64)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def has_trees(self) -> bool:
        return any(c.parents is not None for c in self.chunks)

    def logit_slices(self) -> list[slice]:
        """For each chunk, its rows in the returned logits."""
        out, i = [], 0
        for c in self.chunks:
            n = c.n_tokens if c.all_logits else 1
            out.append(slice(i, i + n))
            i += n
        return out
