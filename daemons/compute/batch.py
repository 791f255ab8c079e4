"""What one forward pass computes: a batch of sequence chunks at their own positions.

A *pass* sweeps every layer once and advances every scheduled sequence: a decoding sequence by
one token, a prefilling one by a chunk of its prompt. All tokens of the pass are laid side by
side (``T`` rows), so each weight matrix is applied once per pass whatever the mix — the point of
streaming a layer is to use it for as many tokens as possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SeqChunk:
    """``tokens`` of sequence ``seq_id`` (its KV cache) at positions ``start_pos`` onwards."""

    seq_id: int
    start_pos: int
    tokens: tuple[int, ...]
    all_logits: bool = False  # logits for every position (prompt scoring), not only the last

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


@dataclass
class StepBatch:
    chunks: list[SeqChunk]
    tokens: np.ndarray = field(init=False)  # [T] int32
    positions: np.ndarray = field(init=False)  # [T] int32
    row_starts: list[int] = field(init=False)  # first row of each chunk in the T rows
    logit_rows: np.ndarray = field(init=False)  # [N_out] int64: rows whose logits are returned

    def __post_init__(self) -> None:
        toks, pos, starts, out_rows = [], [], [], []
        row = 0
        for c in self.chunks:
            if not c.tokens:
                raise ValueError(f"empty chunk for sequence {c.seq_id}")
            starts.append(row)
            toks.extend(c.tokens)
            pos.extend(range(c.start_pos, c.end_pos))
            out_rows.extend(range(row, row + c.n_tokens) if c.all_logits else [row + c.n_tokens - 1])
            row += c.n_tokens
        self.tokens = np.asarray(toks, dtype=np.int32)
        self.positions = np.asarray(pos, dtype=np.int32)
        self.row_starts = starts
        self.logit_rows = np.asarray(out_rows, dtype=np.int64)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def logit_slices(self) -> list[slice]:
        """For each chunk, its rows in the returned logits."""
        out, i = [], 0
        for c in self.chunks:
            n = c.n_tokens if c.all_logits else 1
            out.append(slice(i, i + n))
            i += n
        return out
