"""The numpy backend: the numerically plain reference of the Llama forward pass.

Float32 throughout, with the order of operations llama.cpp uses for GGUF ``llama`` models:
RMSNorm, RoPE in its "normal" mode (adjacent pairs, because the GGUF converter permuted Q and K),
grouped-query attention over a per-sequence KV cache, SwiGLU, tied or separate output head.
Resident layers are dequantized once; streamed layers are dequantized from the slot each pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ntx.daemons.compute.backend import Backend
from ntx.daemons.compute.batch import StepBatch
from ntx.daemons.compute.quants import dequantize
from ntx.shared.gguf_index import LayerInfo, ModelIndex


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x: [T, D], w: [D]
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * w


def rope_angles(hp, freq_factors: np.ndarray | None) -> np.ndarray:
    """Inverse frequencies [rope_dim/2] for llama's RoPE, with Llama 3.1 factors or linear scaling."""
    half = hp.rope_dim // 2
    inv_freq = hp.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hp.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    if hp.rope_scaling.kind == "linear" and hp.rope_scaling.factor:
        inv_freq = inv_freq / hp.rope_scaling.factor
    return inv_freq


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first rope_dim dims. x: [T, H, hd]."""
    rope_dim = inv_freq.shape[0] * 2
    theta = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, rope_dim/2]
    cos = np.cos(theta).astype(np.float32)[:, None, :]
    sin = np.sin(theta).astype(np.float32)[:, None, :]
    out = x.copy()
    x0 = x[..., 0:rope_dim:2]
    x1 = x[..., 1:rope_dim:2]
    out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
    out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class _KvCache:
    """One sequence's keys and values for every layer: [L, Hkv, capacity, hd] float32."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int) -> None:
        self.capacity = capacity
        self.k = np.zeros((n_layers, n_kv, capacity, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, index: ModelIndex) -> None:
        super().__init__(index)
        self.caches: dict[int, _KvCache] = {}
        self.inv_freq: np.ndarray | None = None
        self.tok_embd: np.ndarray | None = None
        self.out_norm: np.ndarray | None = None
        self.out_head: np.ndarray | None = None

    # -- weights -------------------------------------------------------------------------------
    def load_globals(self, raw: dict[str, np.ndarray]) -> None:
        g = self.index.globals
        self.tok_embd = dequantize(raw["token_embd"], g["token_embd"].ggml_type, g["token_embd"].shape)  # [V, D]
        self.out_norm = dequantize(raw["output_norm"], g["output_norm"].ggml_type, g["output_norm"].shape)  # [D]
        if "output" in raw:
            self.out_head = dequantize(raw["output"], g["output"].ggml_type, g["output"].shape)  # [V, D]
        else:
            self.out_head = self.tok_embd
        ff = None
        if "rope_freqs" in raw:
            ff = dequantize(raw["rope_freqs"], g["rope_freqs"].ggml_type, g["rope_freqs"].shape)
        self.inv_freq = rope_angles(self.hp, ff)

    def prepare_layer(self, layer: LayerInfo, buf: Any, *, keep: bool) -> dict[str, np.ndarray]:
        # buf: [slot_bytes] uint8 in slot layout; the result owns fresh arrays either way.
        w = {}
        for name, t in layer.tensors.items():
            off = layer.slot_offset(name)
            w[name] = dequantize(buf[off : off + t.nbytes], t.ggml_type, t.shape)
        return w

    # -- KV cache ------------------------------------------------------------------------------
    def alloc_sequence(self, seq_id: int, capacity_tokens: int) -> None:
        hp = self.hp
        self.caches[seq_id] = _KvCache(hp.n_layers, hp.n_head_kv, hp.head_dim, capacity_tokens)

    def free_sequence(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    # -- forward -------------------------------------------------------------------------------
    def embed(self, batch: StepBatch) -> np.ndarray:
        return self.tok_embd[batch.tokens].astype(np.float32)  # x: [T, D]

    def layer_forward(self, layer_idx: int, w: dict[str, np.ndarray], x: np.ndarray, batch: StepBatch) -> np.ndarray:
        hp = self.hp
        T = x.shape[0]
        h = rms_norm(x, w["attn_norm"], hp.rms_eps)  # h: [T, D]
        q = (h @ w["attn_q"].T).reshape(T, hp.n_head, hp.head_dim)  # q: [T, H, hd]
        k = (h @ w["attn_k"].T).reshape(T, hp.n_head_kv, hp.head_dim)  # k: [T, Hkv, hd]
        v = (h @ w["attn_v"].T).reshape(T, hp.n_head_kv, hp.head_dim)  # v: [T, Hkv, hd]
        q = apply_rope(q, batch.positions, self.inv_freq)
        k = apply_rope(k, batch.positions, self.inv_freq)

        attn = np.empty((T, hp.n_head, hp.head_dim), dtype=np.float32)  # attn: [T, H, hd]
        group = hp.n_head // hp.n_head_kv
        scale = np.float32(1.0 / np.sqrt(hp.head_dim))
        for chunk, r0 in zip(batch.chunks, batch.row_starts):
            n = chunk.n_tokens
            cache = self.caches[chunk.seq_id]
            cache.k[layer_idx, :, chunk.start_pos : chunk.end_pos] = k[r0 : r0 + n].transpose(1, 0, 2)
            cache.v[layer_idx, :, chunk.start_pos : chunk.end_pos] = v[r0 : r0 + n].transpose(1, 0, 2)
            keys = cache.k[layer_idx, :, : chunk.end_pos]  # [Hkv, S, hd]
            vals = cache.v[layer_idx, :, : chunk.end_pos]  # [Hkv, S, hd]
            qc = q[r0 : r0 + n].reshape(n, hp.n_head_kv, group, hp.head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, n, hd]
            scores = np.matmul(qc, keys[:, None].transpose(0, 1, 3, 2)) * scale  # [Hkv, G, n, S]
            q_pos = np.arange(chunk.start_pos, chunk.end_pos)[:, None]
            k_pos = np.arange(chunk.end_pos)[None, :]
            scores = np.where(k_pos <= q_pos, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            out = np.matmul(p, vals[:, None])  # [Hkv, G, n, hd]
            attn[r0 : r0 + n] = out.transpose(2, 0, 1, 3).reshape(n, hp.n_head, hp.head_dim)

        x = x + attn.reshape(T, -1) @ w["attn_output"].T
        h = rms_norm(x, w["ffn_norm"], hp.rms_eps)
        ff = silu(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)  # ff: [T, F]
        return x + ff @ w["ffn_down"].T

    def logits(self, x: np.ndarray, batch: StepBatch) -> np.ndarray:
        h = rms_norm(x[batch.logit_rows], self.out_norm, self.hp.rms_eps)  # h: [N_out, D]
        return h @ self.out_head.T  # [N_out, V] float32 (both operands are)
