"""How the paged KV cache is cut up and sized: the numbers the planner, the engine and both
backends agree on (docs/ARCHITECTURE.md, "KV memory").

A *page* holds ``PAGE_TOKENS`` consecutive positions of one sequence, keys and values, in every
layer: exactly one key tile of the GPU attention kernel, so a tile's keys are one page's. A
backend allocates pages a *chunk* at a time (``chunk_pages`` of them, about
``CHUNK_TARGET_BYTES``); the pool starts with the chunks the plan gives it and grows by whole
chunks into memory a demoted layer gave back, up to ``max_chunks``. No numpy, no cupy: the
planner runs where neither backend does.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_TOKENS = 32  # positions a page holds: one key tile of the GPU attention kernel
CHUNK_TARGET_BYTES = 32 << 20  # a chunk's size where its pages allow: the pool's unit of growth
FLOOR_TOKENS = 1024  # positions the planner reserves for the KV cache before it places layers
CTX_DEFAULT_CAP = 32768  # --ctx's default: the model's trained context, at most this


def pages_for_positions(n_positions: int) -> int:
    """Pages that hold positions [0, n_positions)."""
    if n_positions < 0:
        raise ValueError(f"n_positions must be >= 0, not {n_positions}")
    return -(-n_positions // PAGE_TOKENS)


def chunk_pages_for(page_bytes: int, layer_bytes: int | None = None) -> int:
    """Pages per chunk for pages of ``page_bytes``: about ``CHUNK_TARGET_BYTES``, and no more than
    a quarter of ``layer_bytes`` (the smallest layer), so that a demoted layer's memory becomes
    whole chunks with little left over; at least one page."""
    target = CHUNK_TARGET_BYTES if layer_bytes is None else min(CHUNK_TARGET_BYTES, layer_bytes // 4)
    return max(1, target // max(page_bytes, 1))


@dataclass(frozen=True)
class KvSizing:
    """A backend's page pool: ``chunk_pages`` pages a chunk, ``n_chunks`` chunks at the start, at
    most ``max_chunks`` ever (the device's table of chunk addresses has that many entries).
    ``namespace``: what the K/V values depend on besides the tokens (the model file, its skipped
    layers), so that the prefix cache never matches another model's pages."""

    chunk_pages: int
    n_chunks: int
    max_chunks: int
    namespace: bytes = b""

    @classmethod
    def for_positions(cls, page_bytes: int, n_positions: int, namespace: bytes = b"") -> KvSizing:
        """Chunks enough for ``n_positions`` positions, never growing (an engine without a plan:
        ``generate --local``, the benchmarks, a draft model)."""
        chunk_pages = chunk_pages_for(page_bytes)
        n = -(-pages_for_positions(max(n_positions, 1)) // chunk_pages)
        return cls(chunk_pages, n, n, namespace)
