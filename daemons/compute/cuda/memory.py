"""What the cuda backend holds in device memory for a model, computed without a GPU or cupy.

The planner (``ntxctl start --plan-only`` included) runs where there may be no GPU at all, so
the cuda backend's reservations are stated here, next to the backend but importable alone, and
the backend itself (``CudaBackend.memory_costs``) reports the same object.
"""

from __future__ import annotations

from ntx.shared.gguf_index import ModelIndex
from ntx.shared.plan import MemoryCosts

KV_ELEMENT_BYTES = 2  # the KV cache is f16 (kernels.alloc_kv_cache)
ALLOCATOR_SLACK_BYTES = 256 << 20  # cuBLAS workspace, cupy's pool rounding, graph memory


def cuda_memory_costs(index: ModelIndex, *, max_seqs: int, max_ctx: int, prefill_chunk_tokens: int) -> MemoryCosts:
    """Resident layers as their GGUF bytes; the KV cache of ``max_seqs`` sequences at full
    context, reserved up front; a workspace for a prompt chunk of ``prefill_chunk_tokens`` rows
    (hidden states, feed-forward, logits) plus the largest matrix dequantized to f16 (the GEMM
    path of rows beyond the matvec's)."""
    hp = index.hparams
    largest = max(t.n_elements for layer in index.layers for t in layer.tensors.values())
    rows_bytes = prefill_chunk_tokens * (hp.n_embd * 4 + hp.n_ff * 8 + hp.n_vocab * 4)
    return MemoryCosts(
        memory_name="VRAM",
        layer_bytes=tuple(layer.nbytes for layer in index.layers),
        globals_bytes=index.global_bytes_total,
        kv_bytes_per_token=2 * hp.n_layers * hp.kv_dim * KV_ELEMENT_BYTES,
        kv_tokens=min(max_ctx, hp.n_ctx_train) * max_seqs,
        workspace_bytes=ALLOCATOR_SLACK_BYTES + largest * 2 + rows_bytes,
    )
