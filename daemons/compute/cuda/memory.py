"""What the cuda backend holds in device memory for a model, computed without a GPU or cupy.

The planner (``ntxctl start --plan-only`` included) runs where there may be no GPU at all, so
the cuda backend's reservations are stated here, next to the backend but importable alone, and
the backend itself (``CudaBackend.memory_costs``) reports the same object.
"""

from __future__ import annotations

from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.buckets import MAX_GRAPH_ROWS, bucket_sizes
from ntx.shared.gguf_index import HParams, ModelIndex
from ntx.shared.plan import MemoryCosts

KV_ELEMENT_BYTES = 2  # the KV cache is f16 (kernels.alloc_kv_cache)
ALLOCATOR_SLACK_BYTES = 256 << 20  # cuBLAS workspace, cupy's pool rounding, loaded modules, graph memory
POOL_UNIT_BYTES = 512  # cupy's memory pool hands out multiples of this


def attention_splits(T: int, n_kv: int, max_ctx: int, t: tuning.KernelTuning = tuning.DEFAULT) -> int:
    """The key splits attention uses for T query rows on ``t``'s table (tuning's rule, as
    ``kernels.attention_splits`` takes it on the current device)."""
    return t.attn_splits(T, n_kv, max_ctx)


def _pool_bytes(nbytes: int) -> int:
    return -(-nbytes // POOL_UNIT_BYTES) * POOL_UNIT_BYTES


def pass_workspace_bytes(hp: HParams, rows: int, max_ctx: int, n_splits: int | None = None) -> int:
    """Device bytes of the cuda backend's workspace for a pass of ``rows`` rows (``backend._Work``):
    the block's f32 buffers (``Workspace.allocate``), six int32 row arrays, the tree mask
    (u32 [rows, ceil(rows / 32)]) and attention's split partials, each rounded to the pool's unit.
    ``max_ctx``: the KV cache's positions (attention splits by it)."""
    D, F, q, kv = hp.n_embd, hp.n_ff, hp.q_dim, hp.kv_dim
    S = n_splits if n_splits is not None else attention_splits(rows, hp.n_head_kv, max_ctx)
    buffers = [rows * w * 4 for w in (D, D, q, kv, kv, q, D, F, F, F)]  # x h q k v attn o gate up act
    buffers += [rows * 4] * 6  # tokens, positions, cache_positions, slots, kv_lens, tree_base
    buffers.append(rows * max(1, -(-rows // 32)) * 4)  # tree_mask
    buffers += [rows * hp.n_head * S * 2 * 4, rows * hp.n_head * S * hp.head_dim * 4]  # attention partials
    return sum(_pool_bytes(b) for b in buffers)


def matmul_scratch_bytes(hp: HParams, rows: int) -> int:
    """The kernels' own per-size workspaces a pass of ``rows`` rows leaves behind (kernels.py
    _stream_scratch: kept, a graph points at them), for each row length multiplied (D, the
    attention output's q_dim, F): the tensor-core matmul's x split into f16 halves (4 bytes per
    element of x), and the int8 tensor-core matmul's two int8 planes of x padded to 8 rows (2
    bytes per element and 8 per group of 32: kernels.mmq_workspace_bytes; a model of K-quants
    and other types uses both), or the i16 matvec's planes below them (smaller)."""
    widths = {hp.n_embd, hp.q_dim, hp.n_ff}
    bp = 8 * -(-rows // 8)
    return sum(_pool_bytes(rows * w * 4) + _pool_bytes(bp * w * 2 + bp * (w // 32) * 8) for w in widths)


def graph_workspaces_bytes(hp: HParams, max_ctx: int, max_graph_rows: int = MAX_GRAPH_ROWS) -> int:
    """The workspaces the backend keeps for its CUDA graphs: one per row bucket, all of them made
    by the warm-up before the first request."""
    return sum(pass_workspace_bytes(hp, rows, max_ctx) for rows in bucket_sizes(max_graph_rows))


def cuda_memory_costs(index: ModelIndex, *, max_seqs: int, max_ctx: int, prefill_chunk_tokens: int) -> MemoryCosts:
    """Resident layers as their GGUF bytes; the KV cache of ``max_seqs`` sequences at full
    context, reserved up front; the kept workspace of every row bucket (graphs replay into
    them) and the kernels' scratch of each bucket's row count (``matmul_scratch_bytes``); a
    workspace for a prompt chunk of ``prefill_chunk_tokens`` rows (hidden states,
    feed-forward, logits) plus the largest matrix dequantized to f16 (the GEMM path of rows
    beyond the graphs')."""
    hp = index.hparams
    ctx = min(max_ctx, hp.n_ctx_train)
    largest = max(t.n_elements for layer in index.layers for t in layer.tensors.values())
    rows_bytes = prefill_chunk_tokens * (hp.n_embd * 4 + hp.n_ff * 8 + hp.n_vocab * 4)
    return MemoryCosts(
        memory_name="VRAM",
        layer_bytes=tuple(layer.nbytes for layer in index.layers),
        globals_bytes=index.global_bytes_total,
        kv_bytes_per_token=2 * hp.n_layers * hp.kv_dim * KV_ELEMENT_BYTES,
        kv_tokens=ctx * max_seqs,
        workspace_bytes=(ALLOCATOR_SLACK_BYTES + largest * 2 + rows_bytes + graph_workspaces_bytes(hp, ctx)
                         + sum(matmul_scratch_bytes(hp, rows) for rows in bucket_sizes(MAX_GRAPH_ROWS))),
    )
