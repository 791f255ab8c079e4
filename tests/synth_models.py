"""Helpers for the foundation tests: tiny synthetic models, an independent reading of GGUF files
(gguf-py's ``GGUFReader``, not ``ntx.shared.gguf_index``) and a float64 Llama reference forward
pass that shares no code with the engine's CPU backend.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf import quants as gq

import synth_gguf as sg  # scripts/synth_gguf (tests/conftest.py puts scripts/ on sys.path)
from synth_gguf.gguf_file import TensorEntry, encode_kv, hole_writer, write_gguf

# ---------------------------------------------------------------------------------------------
# Writing models


def tiny_config(**overrides) -> sg.SynthConfig:
    """The ``tiny`` preset cut to 2 layers (d 256, ff 512, 4 heads, 2 KV heads, vocab 512)."""
    overrides.setdefault("n_layers", 2)
    return sg.preset_config("tiny", **overrides)


def write_tiny(folder: os.PathLike, name: str = "tiny.gguf", *, breakage=None, split: int = 1,
               **overrides) -> pathlib.Path:
    """Write a tiny synthetic model into ``folder``; returns its path (first shard if split)."""
    return sg.write_llama_gguf(pathlib.Path(folder) / name, tiny_config(**overrides),
                               breakage=breakage, split=split)


def write_header_only_gguf(path: os.PathLike, cfg: sg.SynthConfig) -> pathlib.Path:
    """A GGUF of ``cfg``'s full size whose data region is a hole (a sparse file): the header is
    real, every tensor byte reads as zero and none of them is on disk. Indexing it is cheap only
    if the indexer reads no tensor data."""
    path = pathlib.Path(path)
    kvs = [
        encode_kv("general.architecture", GGUFValueType.STRING, "llama"),
        encode_kv("general.name", GGUFValueType.STRING, "sparse"),
        encode_kv("llama.block_count", GGUFValueType.UINT32, cfg.n_layers),
        encode_kv("llama.context_length", GGUFValueType.UINT32, cfg.context_length),
        encode_kv("llama.embedding_length", GGUFValueType.UINT32, cfg.d_model),
        encode_kv("llama.feed_forward_length", GGUFValueType.UINT32, cfg.d_ff),
        encode_kv("llama.attention.head_count", GGUFValueType.UINT32, cfg.n_heads),
        encode_kv("llama.attention.head_count_kv", GGUFValueType.UINT32, cfg.n_kv_heads),
        encode_kv("llama.rope.freq_base", GGUFValueType.FLOAT32, cfg.rope_base),
        encode_kv("llama.attention.layer_norm_rms_epsilon", GGUFValueType.FLOAT32, cfg.rms_eps),
    ]
    entries = [TensorEntry(t.name, t.shape, t.qtype, t.nbytes, hole_writer(t.nbytes)) for t in sg.tensor_plan(cfg)]
    write_gguf(path, kvs, entries)
    return path


def patch_u32_kv(path: os.PathLike, key: str, value: int) -> None:
    """Overwrite the value of a UINT32 metadata key in place (e.g. give a synthetic model a
    ``rope.dimension_count`` smaller than its head size, which the generator does not write)."""
    k = key.encode()
    with open(path, "r+b") as f:
        head = f.read(1 << 20)
        at = head.find(struct.pack("<Q", len(k)) + k)
        assert at >= 0, f"{key} not in the header"
        at += 8 + len(k)
        (vtype,) = struct.unpack_from("<I", head, at)
        assert vtype == GGUFValueType.UINT32, f"{key} is not a UINT32"
        f.seek(at + 4)
        f.write(struct.pack("<I", value))


def data_region_start(path: os.PathLike) -> int:
    """Where the tensor data of a GGUF file starts (from gguf-py's reading of the header)."""
    return int(gguf_reader(str(path)).data_offset)


# ---------------------------------------------------------------------------------------------
# Independent reading


@functools.lru_cache(maxsize=8)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)


def gguf_reader(path: os.PathLike) -> GGUFReader:
    """gguf-py's reader of ``path``, parsed once per process (it takes seconds on a real vocab)."""
    p = os.fspath(path)
    st = os.stat(p)
    return _cached_reader(p, st.st_mtime_ns, st.st_size)


def reader_meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value as gguf-py decodes it."""
    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0].item()


class ReferenceWeights:
    """Weights of a GGUF file as float64, decoded on demand by ``gguf.quants.dequantize`` from
    gguf-py's own reading of the file (so a wrong offset in ntx's index cannot hide here)."""

    def __init__(self, path: os.PathLike) -> None:
        self.reader = gguf_reader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        r = self.reader
        a = self.arch = str(reader_meta(r, "general.architecture"))
        self.n_layers = int(reader_meta(r, f"{a}.block_count"))
        self.n_embd = int(reader_meta(r, f"{a}.embedding_length"))
        self.n_head = int(reader_meta(r, f"{a}.attention.head_count"))
        self.n_head_kv = int(reader_meta(r, f"{a}.attention.head_count_kv", self.n_head))
        self.head_dim = int(reader_meta(r, f"{a}.attention.key_length", self.n_embd // self.n_head))
        self.rope_dim = int(reader_meta(r, f"{a}.rope.dimension_count", self.head_dim))
        self.rope_base = float(reader_meta(r, f"{a}.rope.freq_base", 10000.0))
        self.eps = float(reader_meta(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        self.neox = a == "qwen2"  # llama.cpp's NEOX RoPE: a head's halves rotated against each other

    def __call__(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        w = gq.dequantize(t.data, t.tensor_type).astype(np.float64)
        ne = [int(d) for d in t.shape]
        return w.reshape(tuple(reversed(ne)))  # numpy order: [rows, row length]

    def has(self, name: str) -> bool:
        return name in self.tensors


# ---------------------------------------------------------------------------------------------
# The float64 reference forward pass


def _rms_norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * w


def _rope64(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """llama.cpp's "normal" RoPE on adjacent pairs, written as a complex rotation:
    (x[2i] + j x[2i+1]) * exp(j pos inv_freq[i]) for the first 2*len(inv_freq) dims."""
    # x: [T, H, hd]
    n = 2 * inv_freq.shape[0]
    z = x[..., 0:n:2] + 1j * x[..., 1:n:2]  # [T, H, n/2]
    z = z * np.exp(1j * np.outer(pos, inv_freq))[:, None, :]
    out = x.copy()
    out[..., 0:n:2] = z.real
    out[..., 1:n:2] = z.imag
    return out


def _rope64_neox(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """llama.cpp's "NEOX" RoPE (Qwen2): (x[i] + j x[i + n/2]) * exp(j pos inv_freq[i]) for the
    first n = 2*len(inv_freq) dims."""
    # x: [T, H, hd]
    half = inv_freq.shape[0]
    z = x[..., 0:half] + 1j * x[..., half:2 * half]  # [T, H, n/2]
    z = z * np.exp(1j * np.outer(pos, inv_freq))[:, None, :]
    out = x.copy()
    out[..., 0:half] = z.real
    out[..., half:2 * half] = z.imag
    return out


def reference_logits(w: ReferenceWeights, tokens: list[int],
                     rope_factors: bool | None = None, hidden: list | None = None,
                     skip: tuple[int, ...] = ()) -> np.ndarray:
    """Logits [T, V] (float64) of the whole prompt ``tokens`` from position 0.

    ``rope_factors`` None: use ``rope_freqs.weight`` if the file has it; False: ignore it (to
    show a test is sensitive to it). ``hidden``: a list that receives the hidden state [T, D]
    entering each layer, then the last layer's output. ``skip``: layers left out of the pass."""
    tokens = np.asarray(tokens)
    T = len(tokens)
    H, Hkv, hd = w.n_head, w.n_head_kv, w.head_dim
    pos = np.arange(T, dtype=np.float64)
    inv_freq = w.rope_base ** (-2.0 * np.arange(w.rope_dim // 2) / w.rope_dim)
    if w.has("rope_freqs.weight") and rope_factors is not False:
        inv_freq = inv_freq / w("rope_freqs.weight")
    embd = w("token_embd.weight")  # [V, D]
    x = embd[tokens]  # [T, D]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(w.n_layers):
        if i in skip:
            continue
        if hidden is not None:
            hidden.append(x)
        p = f"blk.{i}."
        h = _rms_norm64(x, w(p + "attn_norm.weight"), w.eps)
        q, k, v = (h @ w(p + f"attn_{n}.weight").T + (w(p + f"attn_{n}.bias") if w.has(p + f"attn_{n}.bias") else 0)
                   for n in "qkv")  # Qwen2 adds a bias to each
        rope = _rope64_neox if w.neox else _rope64
        q = rope(q.reshape(T, H, hd), pos, inv_freq)
        k = rope(k.reshape(T, Hkv, hd), pos, inv_freq)
        v = v.reshape(T, Hkv, hd)
        heads = []
        for head in range(H):
            g = head // (H // Hkv)  # the KV head this query head shares (GQA)
            s = q[:, head] @ k[:, g].T / math.sqrt(hd)  # [T, T]
            s = np.where(causal, s, -np.inf)
            pr = np.exp(s - s.max(axis=1, keepdims=True))
            pr /= pr.sum(axis=1, keepdims=True)
            heads.append(pr @ v[:, g])  # [T, hd]
        x = x + np.concatenate(heads, axis=1) @ w(p + "attn_output.weight").T
        h = _rms_norm64(x, w(p + "ffn_norm.weight"), w.eps)
        gate = h @ w(p + "ffn_gate.weight").T
        up = h @ w(p + "ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T
    if hidden is not None:
        hidden.append(x)
    h = _rms_norm64(x, w("output_norm.weight"), w.eps)
    head_w = w("output.weight") if w.has("output.weight") else embd
    return h @ head_w.T


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| relative to max |want|."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))

