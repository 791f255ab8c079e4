"""Synthetic Llama GGUF files: any shape, any supported tensor type, random but valid blocks.

What it is for: exercising the loader, the planner and the streaming pipeline on models of the
real sizes (8B, 70B) without downloading them, and producing deliberately broken files for the
loader's error paths. The weights are random, so the text is gibberish, but every block is a
valid block of its type with finite f16 scales, and the scales are chosen so that each weight
matrix has std ≈ 1/sqrt(fan_in) (fan_in = the row length, GGUF ``ne[0]``): activations stay
finite and well scaled through all layers.

How it is fast: for every (type, std) pair the writer generates one *pool* of random blocks
(about 2 MB, a prime number of blocks so that rows do not repeat with a short period), checks
the whole pool with ``gguf.quants.dequantize`` (finite, std near the target), and then writes
every tensor of that kind by tiling the pool from a per-tensor starting block (so tensors
differ). Every byte in the file is a copy of a checked pool byte, so checking the pools checks
the file. Data is written with large sequential writes; the model is never held in memory.

File layout: GGUF v3 written directly (header, KV, tensor infos, padding to ``alignment``,
data). Tensor order is per-layer contiguous; three orders are offered:

``"convert"`` (default)
    ``[rope_freqs]``, ``token_embd``, ``blk.0.*`` … ``blk.N-1.*`` (attn_norm, attn_q, attn_k,
    attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down), ``output_norm``, ``[output]``.
``"hf"``
    What ``convert_hf_to_gguf.py`` produces from HF safetensors, whose keys are sorted as strings:
    ``token_embd``, layers in *string* order (0, 1, 10, 11, …, 19, 2, 20, …), inside a layer
    attn_norm, ffn_down, ffn_gate, ffn_up, ffn_norm, attn_k, attn_output, attn_q, attn_v, then
    ``output_norm``, ``output`` (the real SmolLM2 GGUF looks like this).
``"quantize"``
    What ``llama-quantize`` writes (its ``weight_name_comparer``): the non-layer tensors first,
    sorted by name (``output``, ``output_norm``, ``rope_freqs``, ``token_embd``), then layers in
    numeric order, each layer's tensors sorted by name.

Type mixes ``Q4_K_M`` / ``Q5_K_M`` follow llama.cpp's ``llama_tensor_get_type`` (llama-quant.cpp):
base type Q4_K / Q5_K; ``attn_v`` and ``ffn_down`` get Q6_K where ``use_more_bits(i, n)``
(``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``); ``attn_v`` that is still Q4_K becomes Q5_K in a
"70B" model (80 layers with GQA); ``output`` (or ``token_embd`` when embeddings are tied) is Q6_K,
or Q8_0 when its row length is not a multiple of 256; an untied ``token_embd`` keeps the base
type. Any tensor whose row length does not fit the type's block falls back the way llama.cpp
does (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0, then F16). Single types are "pure": every matrix gets it
(with the same fallback). 1-D tensors (norms, rope_freqs) are always F32.

Split sets follow ``gguf-split``: ``NAME-00001-of-0000N.gguf`` …; every shard is a full GGUF with
``split.no`` (u16, 0-based), ``split.count`` (u16) and ``split.tensors.count`` (i32, the total);
only the first shard carries the model's other metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import mmap
import os
import pathlib
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf import quants as gq

from ntx.shared.bytelevel import bytes_to_unicode
from ntx.shared.errors import ConfigError, ModelError, NtxError

QT = GGMLQuantizationType
VT = GGUFValueType

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
QK_K = 256

#: Matrix types the generator writes valid random blocks for.
MATRIX_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
)
#: llama.cpp-style mixes: name -> base type.
MIXES: dict[str, str] = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
ALL_TYPES: tuple[str, ...] = MATRIX_TYPES + tuple(MIXES)

_FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
}

# Llama 3.1 rope scaling (as in convert_hf_to_gguf.py for "rope_type": "llama3").
LLAMA31_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass
class SynthConfig:
    """Shape and content of a synthetic Llama model.

    ``type`` is one of :data:`ALL_TYPES` (a single matrix type, or a mix like ``Q4_K_M``).
    ``vocab_size`` must equal the tokenizer's size when ``tokenizer_from`` is given.
    """

    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 4096
    tied_embeddings: bool = False
    head_dim: int | None = None          # default d_model // n_heads
    type: str = "Q4_K_M"
    output_type: str | None = None       # override the type of output (or tied token_embd)
    token_embd_type: str | None = None   # override the type of an untied token_embd
    rope_freqs: bool = False             # write rope_freqs.weight (Llama 3.1 scaling factors)
    seed: int = 0
    name: str = "synthetic-llama"
    tokenizer_from: str | os.PathLike | None = None
    order: str = "convert"               # "convert", "hf" or "quantize" (see module doc)
    alignment: int = DEFAULT_ALIGNMENT

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"synthetic model config: {msg}")

        for f in ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "vocab_size"):
            if int(getattr(self, f)) < 1:
                bad(f"{f} must be >= 1 (got {getattr(self, f)})")
        if self.head_dim is None and self.d_model % self.n_heads:
            bad(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.hd % 2:
            bad(f"head_dim {self.hd} must be even (RoPE)")
        if self.type not in ALL_TYPES:
            bad(f"type {self.type!r} is not one of {', '.join(ALL_TYPES)}")
        for f in ("output_type", "token_embd_type"):
            v = getattr(self, f)
            if v is not None and v not in MATRIX_TYPES:
                bad(f"{f} {v!r} is not one of {', '.join(MATRIX_TYPES)}")
        if self.order not in ORDERS:
            bad(f"order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.alignment < 1 or self.alignment & (self.alignment - 1) or self.alignment % 8:
            bad(f"alignment {self.alignment} must be a power of two and a multiple of 8")


PRESETS: dict[str, dict] = {
    "tiny": dict(n_layers=4, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab_size=512,
                 rope_base=10000.0, context_length=2048, tied_embeddings=False),
    "smollm2-135m": dict(n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3,
                         vocab_size=49152, rope_base=100000.0, context_length=8192,
                         tied_embeddings=True),
    "llama3-8b": dict(n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8,
                      vocab_size=128256, rope_base=500000.0, context_length=8192,
                      tied_embeddings=False),
    "llama3-70b": dict(n_layers=80, d_model=8192, d_ff=28672, n_heads=64, n_kv_heads=8,
                       vocab_size=128256, rope_base=500000.0, context_length=8192,
                       tied_embeddings=False),
}


def preset_config(preset: str, **overrides) -> SynthConfig:
    """A :class:`SynthConfig` from a preset name, with any field overridden (None = keep)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset], name=f"synthetic-{preset}")
    names = {f.name for f in dataclasses.fields(SynthConfig)}
    for k, v in overrides.items():
        if k not in names:
            raise ConfigError(f"unknown config field {k!r}")
        if v is not None:
            fields[k] = v
    return SynthConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Deliberate breakage (for loader tests)


@dataclass
class Breakage:
    """Ways to make a file the loader must reject. Every field left at None/False is intact."""

    drop_tensor: str | None = None           # omit this tensor entirely
    duplicate_tensor: str | None = None      # write this tensor twice under the same name
    wrong_shape: str | None = None           # halve this tensor's ne[1] (data size matches)
    arch: str | None = None                  # general.architecture value, e.g. "mamba"
    version: int | None = None               # GGUF header version, e.g. 1
    truncate: int | None = None              # cut this many bytes off the end (-1: half the last tensor)
    tensor_type: dict[str, str] | None = None  # force a type, e.g. {"blk.0.attn_q.weight": "Q2_K"}
    drop_key: str | None = None              # omit this metadata key, e.g. "llama.block_count"
    bad_magic: bool = False                  # b"GGUX" instead of b"GGUF"


#: Short names for :func:`write_llama_gguf`'s ``breakage=`` (a string or a :class:`Breakage`).
BREAKAGES: dict[str, Breakage] = {
    "drop_tensor": Breakage(drop_tensor="blk.0.attn_q.weight"),
    "duplicate_name": Breakage(duplicate_tensor="blk.0.attn_k.weight"),
    "wrong_shape": Breakage(wrong_shape="blk.0.ffn_up.weight"),
    "bad_arch": Breakage(arch="mamba"),
    "version1": Breakage(version=1),
    "truncate": Breakage(truncate=-1),
    "q2_k": Breakage(tensor_type={"blk.0.attn_q.weight": "Q2_K"}),
    "iq2_xxs": Breakage(tensor_type={"blk.0.ffn_gate.weight": "IQ2_XXS"}),
    "missing_key": Breakage(drop_key="llama.block_count"),
    "bad_magic": Breakage(bad_magic=True),
}


def _breakage(b: Breakage | str | None) -> Breakage:
    if b is None:
        return Breakage()
    if isinstance(b, Breakage):
        return b
    if b in BREAKAGES:
        return dataclasses.replace(BREAKAGES[b])
    raise ConfigError(f"unknown breakage {b!r}; choose one of {', '.join(BREAKAGES)}")


# ---------------------------------------------------------------------------------------------
# Tensor plan: names, shapes, types, order


ORDERS = ("convert", "hf", "quantize")
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# convert_hf_to_gguf order: HF names sorted as strings, mapped to GGUF names.
_HF_LAYER_ORDER = ("attn_norm", "ffn_down", "ffn_gate", "ffn_up", "ffn_norm",
                   "attn_k", "attn_output", "attn_q", "attn_v")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # GGUF order: ne[0] (row length, fan_in) first
    qtype: int               # a GGMLQuantizationType value
    std: float               # target std of a weight matrix; 0 for 1-D tensors
    layer: int | None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.qtype)

    @property
    def type_name(self) -> str:
        return _qname(self.qtype)


def _qname(qtype: int) -> str:
    try:
        return QT(qtype).name
    except ValueError:
        return f"type{qtype}"


def tensor_nbytes(shape: Sequence[int], qtype: int) -> int:
    try:
        blck, tsize = GGML_QUANT_SIZES[QT(qtype)]
    except (ValueError, KeyError):
        raise NtxError(f"unknown GGML tensor type {qtype}") from None
    n = math.prod(shape)
    if shape[0] % blck:
        raise NtxError(f"row length {shape[0]} is not a multiple of {_qname(qtype)}'s block {blck}")
    return n // blck * tsize


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in *_K_M mixes."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
             QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0}


def _fallback(qtype: QT, ncols: int) -> QT:
    """llama.cpp's tensor_type_fallback: a type whose block fits a row of ``ncols``."""
    blck = GGML_QUANT_SIZES[qtype][0]
    if ncols % blck == 0:
        return qtype
    alt = _FALLBACK.get(qtype, QT.F16)
    if ncols % GGML_QUANT_SIZES[alt][0]:
        alt = QT.F16
    return alt


def _is_70b(cfg: SynthConfig) -> bool:
    # llama-model.cpp: 80 layers -> 65B if n_head == n_head_kv, else 70B
    return cfg.n_layers == 80 and cfg.n_heads != cfg.n_kv_heads


def choose_type(cfg: SynthConfig, name: str, shape: Sequence[int]) -> QT:
    """The type a tensor gets for ``cfg.type`` (see the module doc for the rules)."""
    if len(shape) < 2:
        return QT.F32
    layer = _layer_of(name)
    kind = name.split(".")[-2] if layer is not None else name.rsplit(".", 1)[0]
    is_output = kind == "output" or (cfg.tied_embeddings and kind == "token_embd")
    if cfg.type in MIXES:
        base = QT[MIXES[cfg.type]]
        t = base
        if is_output:
            t = QT.Q8_0 if shape[0] % GGML_QUANT_SIZES[base][0] else QT.Q6_K
        elif kind == "attn_v":
            if use_more_bits(layer, cfg.n_layers):
                t = QT.Q6_K
            if _is_70b(cfg) and t in (QT.Q3_K, QT.Q4_K):
                t = QT.Q5_K
        elif kind == "ffn_down":
            if use_more_bits(layer, cfg.n_layers):
                t = QT.Q6_K
    else:
        t = QT[cfg.type]
    if is_output and cfg.output_type:
        t = QT[cfg.output_type]
    elif kind == "token_embd" and cfg.token_embd_type:
        t = QT[cfg.token_embd_type]
    if t in (QT.F32, QT.F16, QT.BF16):
        return t
    return _fallback(t, shape[0])


def _layer_of(name: str) -> int | None:
    if name.startswith("blk."):
        return int(name.split(".")[1])
    return None


def _shapes(cfg: SynthConfig) -> dict[str, tuple[int, ...]]:
    d, ff, hd, v = cfg.d_model, cfg.d_ff, cfg.hd, cfg.vocab_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layer = {"attn_norm": (d,), "attn_q": (d, q), "attn_k": (d, kv), "attn_v": (d, kv),
             "attn_output": (q, d), "ffn_norm": (d,), "ffn_gate": (d, ff), "ffn_up": (d, ff),
             "ffn_down": (ff, d)}
    out: dict[str, tuple[int, ...]] = {}
    if cfg.rope_freqs:
        out["rope_freqs.weight"] = (hd // 2,)
    out["token_embd.weight"] = (d, v)
    for i in range(cfg.n_layers):
        for k in _LAYER_TENSORS:
            out[f"blk.{i}.{k}.weight"] = layer[k]
    out["output_norm.weight"] = (d,)
    if not cfg.tied_embeddings:
        out["output.weight"] = (d, v)
    return out


def _ordered_names(cfg: SynthConfig, names: Iterable[str]) -> list[str]:
    names = list(names)
    if cfg.order == "convert":
        return names  # _shapes already builds them in this order
    if cfg.order == "quantize":
        def key(n: str):
            lay = _layer_of(n)
            return (-1 if lay is None else lay, n)
        return sorted(names, key=key)
    # "hf": HF safetensors keys sorted as strings (model.embed_tokens < model.layers.* <
    # model.norm), layers in string order; output (lm_head) last, as single-file exports put it.
    present = set(names)
    head = [n for n in ("rope_freqs.weight", "token_embd.weight") if n in present]
    body = [f"blk.{i}.{k}.weight" for i in sorted(range(cfg.n_layers), key=str)
            for k in _HF_LAYER_ORDER]
    tail = [n for n in ("output_norm.weight", "output.weight") if n in present]
    return head + [n for n in body if n in present] + tail


def tensor_plan(cfg: SynthConfig) -> list[TensorSpec]:
    """Every tensor of the model, in file order, with its type and target std."""
    cfg.validate()
    shapes = _shapes(cfg)
    plan = []
    for name in _ordered_names(cfg, shapes):
        shape = shapes[name]
        qtype = choose_type(cfg, name, shape)
        std = 1.0 / math.sqrt(shape[0]) if len(shape) >= 2 else 0.0
        plan.append(TensorSpec(name, shape, int(qtype), std, _layer_of(name)))
    return plan


def tensor_types(cfg: SynthConfig) -> dict[str, str]:
    """name -> type name for every tensor of ``cfg`` (handy for checking mixes)."""
    return {t.name: t.type_name for t in tensor_plan(cfg)}


# ---------------------------------------------------------------------------------------------
# Random valid blocks


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def _scale_range(std: float, k: float, cap: int) -> tuple[int, int]:
    """Integer sub-block scales [lo, hi] such that the f16 super-scale d = std / (k*sc) stays a
    normal f16 (>= ~2.5e-4) for small targets, capped at the field's range."""
    c = min(max(std / (k * 2.5e-4), 2.0), float(cap))
    return max(1, int(round(c * 0.5))), max(2, int(round(c * 1.5)))


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into Q4_K/Q5_K's 12 bytes."""
    nb = sc.shape[0]
    out = np.zeros((nb, 12), np.uint8)
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    return out


def make_blocks(qtype: int, nblocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``nblocks`` random valid blocks of ``qtype`` (uint8 [nblocks, type_size]) whose values
    have mean ≈ 0 and std ≈ ``std``. For F32/F16/BF16 a "block" is one element."""
    qt = QT(qtype)
    u8 = lambda shape: rng.integers(0, 256, size=shape, dtype=np.uint8)  # noqa: E731
    jitter = rng.uniform(0.75, 1.25, nblocks)
    if qt == QT.F32:
        return (rng.standard_normal(nblocks) * std).astype("<f4").view(np.uint8).reshape(-1, 4)
    if qt == QT.F16:
        return _f16_bytes(rng.standard_normal(nblocks) * std)
    if qt == QT.BF16:
        f = (rng.standard_normal(nblocks) * std).astype("<f4").view(np.uint32)
        b = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype("<u2")
        return b.view(np.uint8).reshape(-1, 2)
    if qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        nib = qt in (QT.Q4_0, QT.Q4_1)
        k = math.sqrt((16**2 - 1) / 12) if nib else math.sqrt((32**2 - 1) / 12)
        mid = 7.5 if nib else 15.5
        d = std / k * jitter
        parts = [_f16_bytes(d)]
        if qt in (QT.Q4_1, QT.Q5_1):
            parts.append(_f16_bytes(-mid * d))
        if not nib:
            parts.append(u8((nblocks, 4)))
        parts.append(u8((nblocks, 16)))
        return np.concatenate(parts, axis=1)
    if qt == QT.Q8_0:
        k = math.sqrt((129**2 - 1) / 12)  # uniform -64..64
        q = rng.integers(-64, 65, size=(nblocks, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(std / k * jitter), q], axis=1)
    if qt in (QT.Q4_K, QT.Q5_K):
        five = qt == QT.Q5_K
        k = math.sqrt((32**2 - 1) / 12) if five else math.sqrt((16**2 - 1) / 12)
        lo, hi = _scale_range(std, k, 31)
        sc = rng.integers(lo, hi + 1, size=(nblocks, 8))
        rms = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
        d = std / (k * rms) * jitter
        # value = d*sc*q - dmin*m with m = sc and dmin = mid*d  ->  d*sc*(q - mid): zero mean
        dmin = (15.5 if five else 7.5) * d
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, sc)]
        if five:
            parts.append(u8((nblocks, 32)))
        parts.append(u8((nblocks, 128)))
        return np.concatenate(parts, axis=1)
    if qt == QT.Q6_K:
        k = math.sqrt((64**2 - 1) / 12)
        lo, hi = _scale_range(std, k, 63)
        sc = rng.integers(lo, hi + 1, size=(nblocks, 16)) * rng.choice([-1, 1], size=(nblocks, 16))
        rms = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
        d = std / (k * rms) * jitter
        return np.concatenate([u8((nblocks, 128)), u8((nblocks, 64)),
                               sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)
    # Anything else (only reached through Breakage.tensor_type): random bytes of the right size.
    return u8((nblocks, GGML_QUANT_SIZES[qt][1]))


def _next_prime(n: int) -> int:
    def prime(k: int) -> bool:
        if k < 2:
            return False
        for p in range(2, int(k**0.5) + 1):
            if k % p == 0:
                return False
        return True
    while not prime(n):
        n += 1
    return n


@dataclass
class _Pool:
    data: np.ndarray      # uint8, flat, nblocks * type_size
    type_size: int
    nblocks: int
    measured_std: float


_POOL_CACHE: dict[tuple, _Pool] = {}   # checked pools, reused across writes in one process
_POOL_CACHE_MAX = 32


class _Pools:
    """One checked pool of random blocks per (type, std), for one seed."""

    def __init__(self, seed: int, pool_bytes: int = 2 << 20, check: bool = True) -> None:
        self.seed = seed
        self.pool_bytes = pool_bytes
        self.check = check

    def get(self, qtype: int, std: float) -> _Pool:
        key = (self.seed, self.pool_bytes, self.check, int(qtype), round(std, 9))
        pool = _POOL_CACHE.get(key)
        if pool is None:
            pool = self._make(qtype, std)
            if len(_POOL_CACHE) >= _POOL_CACHE_MAX:
                _POOL_CACHE.pop(next(iter(_POOL_CACHE)))
            _POOL_CACHE[key] = pool
        return pool

    def _make(self, qtype: int, std: float) -> _Pool:
        tsize = GGML_QUANT_SIZES[QT(qtype)][1]
        nb = _next_prime(max(64, self.pool_bytes // tsize))
        h = hashlib.blake2b(f"{self.seed}/{qtype}/{std!r}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        blocks = make_blocks(qtype, nb, std, rng)
        measured = float("nan")
        if self.check and QT(qtype).name in MATRIX_TYPES:
            vals = gq.dequantize(blocks, QT(qtype)).astype(np.float64)
            if not np.isfinite(vals).all():  # pragma: no cover - a generator bug
                raise AssertionError(f"non-finite values in a {_qname(qtype)} pool")
            measured = float(vals.std())
            if not (0.5 * std <= measured <= 1.5 * std):  # pragma: no cover - a generator bug
                raise AssertionError(f"{_qname(qtype)} pool std {measured:.3g}, wanted {std:.3g}")
        return _Pool(np.ascontiguousarray(blocks).reshape(-1), tsize, nb, measured)


def _small_tensor(spec: TensorSpec, cfg: SynthConfig) -> bytes:
    """Data of a 1-D F32 tensor (norm weights or rope_freqs)."""
    if spec.name == "rope_freqs.weight":
        return llama31_rope_factors(cfg.hd, cfg.rope_base).astype("<f4").tobytes()
    h = hashlib.blake2b(f"{cfg.seed}/{spec.name}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(h, "little"))
    n = math.prod(spec.shape)
    if spec.qtype == QT.F32:
        return (1.0 + 0.05 * rng.standard_normal(n)).astype("<f4").tobytes()
    return make_blocks(spec.qtype, spec.nbytes // GGML_QUANT_SIZES[QT(spec.qtype)][1],
                       1.0, rng).tobytes()


def llama31_rope_factors(head_dim: int, base: float, scaling: dict | None = None) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf writes it for Llama 3.1 ("rope_type": "llama3")."""
    s = scaling or LLAMA31_ROPE_SCALING
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    lo_wl, hi_wl = old / lo, old / hi
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# ---------------------------------------------------------------------------------------------
# GGUF encoding


_SCALAR_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
               VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?",
               VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def _str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: VT, value) -> bytes:
    if vtype == VT.STRING:
        return _str(value)
    return struct.pack(_SCALAR_FMT[vtype], value)


def encode_kv(key: str, vtype: VT, value, subtype: VT | None = None) -> bytes:
    """One GGUF key/value pair as bytes (arrays: ``vtype=ARRAY`` and ``subtype``)."""
    out = [_str(key), struct.pack("<I", vtype)]
    if vtype == VT.ARRAY:
        assert subtype is not None
        out.append(struct.pack("<IQ", subtype, len(value)))
        if subtype == VT.STRING:
            out.extend(_str(v) for v in value)
        else:
            fmt = _SCALAR_FMT[subtype]
            out.append(np.asarray(value, dtype=np.dtype(fmt)).tobytes())
    else:
        out.append(_value(vtype, value))
    return b"".join(out)


@dataclass
class RawKV:
    key: str
    vtype: int
    raw: bytes           # the whole encoded pair, ready to copy into another file
    value: object        # scalars and strings decoded; arrays: None
    count: int = 1       # arrays: number of elements


@dataclass
class RawTensor:
    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int          # relative to the data section
    nbytes: int


@dataclass
class GGUFLayout:
    path: pathlib.Path
    version: int
    kvs: list[RawKV]
    tensors: list[RawTensor]
    alignment: int
    data_start: int

    def kv(self, key: str) -> RawKV | None:
        for kv in self.kvs:
            if kv.key == key:
                return kv
        return None


def read_gguf_layout(path: str | os.PathLike) -> GGUFLayout:
    """Parse a GGUF's header, KV pairs (kept raw, for copying) and tensor infos.

    Much faster than ``gguf.GGUFReader`` on big vocabularies (arrays are skipped, not decoded).
    """
    path = pathlib.Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelError(path, f"cannot open: {e.strerror or e}") from e
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v[0] if len(v) == 1 else v

        def skip_str() -> None:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", mm, pos)
            pos += 8 + n

        def read_str() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", mm, pos)
            s = bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace")
            pos += 8 + n
            return s

        try:
            if mm[:4] != GGUF_MAGIC:
                raise ModelError(path, "not a GGUF file (bad magic)")
            pos = 4
            version = take("<I")
            if version not in (2, 3):
                raise ModelError(path, f"unsupported GGUF version {version}")
            n_tensors, n_kv = take("<QQ")
            kvs: list[RawKV] = []
            for _ in range(n_kv):
                start = pos
                key = read_str()
                vtype = VT(take("<I"))
                value: object = None
                count = 1
                if vtype == VT.ARRAY:
                    sub = VT(take("<I"))
                    count = take("<Q")
                    if sub == VT.STRING:
                        for _ in range(count):
                            skip_str()
                    elif sub == VT.ARRAY:
                        raise ModelError(path, f"nested arrays in {key} are not supported")
                    else:
                        pos += count * struct.calcsize(_SCALAR_FMT[sub])
                elif vtype == VT.STRING:
                    value = read_str()
                else:
                    value = take(_SCALAR_FMT[vtype])
                kvs.append(RawKV(key, int(vtype), bytes(mm[start:pos]), value, count))
            tensors: list[RawTensor] = []
            for _ in range(n_tensors):
                name = read_str()
                nd = take("<I")
                shape = tuple(struct.unpack_from(f"<{nd}Q", mm, pos))
                pos += 8 * nd
                qtype, off = take("<IQ")
                tensors.append(RawTensor(name, shape, qtype, off, tensor_nbytes(shape, qtype)))
        except (struct.error, ValueError) as e:
            raise ModelError(path, f"damaged GGUF header: {e}") from e
        align_kv = next((kv for kv in kvs if kv.key == "general.alignment"), None)
        alignment = int(align_kv.value) if align_kv is not None else DEFAULT_ALIGNMENT
        data_start = -(-pos // alignment) * alignment
    return GGUFLayout(path, version, kvs, tensors, alignment, data_start)


# ---------------------------------------------------------------------------------------------
# Tokenizer keys




SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def minimal_tokenizer_kvs(vocab_size: int) -> list[bytes]:
    """A small but usable byte-level BPE tokenizer (``gpt2`` model) of exactly ``vocab_size``
    tokens: the 256 byte tokens, merges of common letter pairs, Llama-3-style specials, then
    ``<|reserved_special_token_N|>`` padding."""
    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ConfigError(f"vocab_size {vocab_size} is too small for the built-in byte-level "
                          f"tokenizer (needs >= {n_min}); use a larger vocab or --tokenizer-from")
    bu = bytes_to_unicode()
    tokens = [bu[b] for b in range(256)]
    types = [1] * 256  # NORMAL (llama.cpp's gpt2 vocab marks byte tokens normal)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    space = bu[ord(" ")]
    pairs = [(space, c) for c in letters] + [(a, b) for a in letters for b in letters]
    room = vocab_size - n_min
    merges = []
    for a, b in pairs[:room]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    specials_at = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    types.extend([3] * len(SPECIAL_TOKENS))  # CONTROL
    i = 0
    while len(tokens) < vocab_size:
        tokens.append(f"<|reserved_special_token_{i}|>")
        types.append(3)
        i += 1
    sid = {t: specials_at + j for j, t in enumerate(SPECIAL_TOKENS)}
    return [
        encode_kv("tokenizer.ggml.model", VT.STRING, "gpt2"),
        encode_kv("tokenizer.ggml.pre", VT.STRING, "default"),
        encode_kv("tokenizer.ggml.tokens", VT.ARRAY, tokens, VT.STRING),
        encode_kv("tokenizer.ggml.token_type", VT.ARRAY, types, VT.INT32),
        encode_kv("tokenizer.ggml.merges", VT.ARRAY, merges, VT.STRING),
        encode_kv("tokenizer.ggml.bos_token_id", VT.UINT32, sid["<|begin_of_text|>"]),
        encode_kv("tokenizer.ggml.eos_token_id", VT.UINT32, sid["<|eot_id|>"]),
        encode_kv("tokenizer.ggml.eot_token_id", VT.UINT32, sid["<|eot_id|>"]),
        encode_kv("tokenizer.ggml.padding_token_id", VT.UINT32, sid["<|end_of_text|>"]),
        encode_kv("tokenizer.ggml.add_bos_token", VT.BOOL, True),
        encode_kv("tokenizer.ggml.add_space_prefix", VT.BOOL, False),
        encode_kv("tokenizer.chat_template", VT.STRING, CHAT_TEMPLATE),
    ]


def tokenizer_kvs_from(path: str | os.PathLike) -> tuple[list[bytes], int]:
    """All ``tokenizer.*`` pairs of an existing GGUF (raw), and its vocabulary size."""
    lay = read_gguf_layout(path)
    kvs = [kv for kv in lay.kvs if kv.key.startswith("tokenizer.")]
    toks = lay.kv("tokenizer.ggml.tokens")
    if toks is None:
        raise ModelError(path, "has no tokenizer.ggml.tokens; cannot copy its tokenizer")
    return [kv.raw for kv in kvs], int(toks.count)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    qtype: int
    nbytes: int
    write: Callable[[int], None]   # writes exactly nbytes to the file descriptor


def _write_all(fd: int, views: Sequence) -> None:
    """Write every buffer in ``views`` to ``fd`` in order, resuming after partial writes."""
    views = [memoryview(v).cast("B") for v in views if len(v)]
    while views:
        batch = views[:512]
        n = os.writev(fd, batch) if len(batch) > 1 else os.write(fd, batch[0])
        while n:
            head = views[0]
            if n >= len(head):
                n -= len(head)
                views.pop(0)
            else:
                views[0] = head[n:]
                n = 0


def _write_gguf(path: pathlib.Path, kvs: Sequence[bytes], entries: Sequence[_Entry], *,
                version: int = GGUF_VERSION, magic: bytes = GGUF_MAGIC,
                alignment: int = DEFAULT_ALIGNMENT,
                advance: Callable[[int], None] = lambda n: None) -> int:
    """Write one GGUF file; returns its size. Each entry's writer gets the file descriptor."""
    head = [magic, struct.pack("<IQQ", version, len(entries), len(kvs)), *kvs]
    off = 0
    for e in entries:
        head.append(_str(e.name) + struct.pack(f"<I{len(e.shape)}Q", len(e.shape), *e.shape)
                    + struct.pack("<IQ", e.qtype, off))
        off += -(-e.nbytes // alignment) * alignment
    meta = b"".join(head)
    meta += b"\0" * (-len(meta) % alignment)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, [meta])
        for e in entries:
            start = os.lseek(fd, 0, os.SEEK_CUR)
            e.write(fd)
            n = os.lseek(fd, 0, os.SEEK_CUR) - start
            if n != e.nbytes:  # pragma: no cover - a generator bug
                raise AssertionError(f"{e.name}: wrote {n} bytes, expected {e.nbytes}")
            pad = -n % alignment
            if pad:
                _write_all(fd, [b"\0" * pad])
            advance(n + pad)
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def _pool_writer(pool: _Pool, nbytes: int, start_block: int,
                 chunk: int = 64 << 20) -> Callable[[int], None]:
    """Write ``nbytes`` by tiling the pool from ``start_block`` (a per-tensor rotation)."""
    def write(fd: int) -> None:
        mv = memoryview(pool.data)
        plen = len(mv)
        pos = (start_block % pool.nblocks) * pool.type_size
        left = nbytes
        while left:  # gather pool pieces into writes of about `chunk` bytes
            pieces = []
            size = 0
            while left and size < chunk:
                n = min(plen - pos, left)
                pieces.append(mv[pos:pos + n])
                size += n
                left -= n
                pos = (pos + n) % plen
            _write_all(fd, pieces)
    return write


def _bytes_writer(data: bytes) -> Callable[[int], None]:
    return lambda fd: _write_all(fd, [data])


def _start_block(seed: int, name: str) -> int:
    h = hashlib.blake2b(f"{seed}/start/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def _metadata_kvs(cfg: SynthConfig, br: Breakage, tok_kvs: list[bytes]) -> list[bytes]:
    c = cfg
    kvs: list[tuple[str, VT, object]] = [
        ("general.architecture", VT.STRING, br.arch if br.arch is not None else "llama"),
        ("general.type", VT.STRING, "model"),
        ("general.name", VT.STRING, c.name),
        ("general.description", VT.STRING,
         f"synthetic Llama model with random weights (ntx synth_gguf, seed {c.seed})"),
        ("general.file_type", VT.UINT32, int(_FILE_TYPE[c.type])),
        ("general.quantization_version", VT.UINT32, 2),
    ]
    if c.alignment != DEFAULT_ALIGNMENT:
        kvs.append(("general.alignment", VT.UINT32, c.alignment))
    kvs += [
        ("llama.block_count", VT.UINT32, c.n_layers),
        ("llama.context_length", VT.UINT32, c.context_length),
        ("llama.embedding_length", VT.UINT32, c.d_model),
        ("llama.feed_forward_length", VT.UINT32, c.d_ff),
        ("llama.attention.head_count", VT.UINT32, c.n_heads),
        ("llama.attention.head_count_kv", VT.UINT32, c.n_kv_heads),
        ("llama.rope.freq_base", VT.FLOAT32, float(c.rope_base)),
        ("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, float(c.rms_eps)),
        ("llama.vocab_size", VT.UINT32, c.vocab_size),
        ("llama.rope.dimension_count", VT.UINT32, c.hd),
    ]
    if c.head_dim is not None:
        kvs += [("llama.attention.key_length", VT.UINT32, c.hd),
                ("llama.attention.value_length", VT.UINT32, c.hd)]
    out = [encode_kv(k, t, v) for k, t, v in kvs if k != br.drop_key]
    out += [raw for raw in tok_kvs if _raw_key(raw) != br.drop_key]
    return out


def _raw_key(raw: bytes) -> str:
    (n,) = struct.unpack_from("<Q", raw, 0)
    return raw[8:8 + n].decode("utf-8", errors="replace")


def _split_names(base: pathlib.Path, n: int) -> list[pathlib.Path]:
    stem = base.name[:-5] if base.name.endswith(".gguf") else base.name
    return [base.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.gguf") for i in range(n)]


def _partition(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` (in order) into ``n`` non-empty runs of about equal total."""
    if not 1 <= n <= len(sizes):
        raise ConfigError(f"cannot split {len(sizes)} tensors into {n} shards")
    cum = np.cumsum(np.asarray(sizes, dtype=np.float64))
    total = cum[-1]
    cuts = [0]
    for k in range(1, n):
        i = int(np.searchsorted(cum, total * k / n)) + 1  # first index of the next shard
        i = max(i, cuts[-1] + 1)
        i = min(i, len(sizes) - (n - k))
        cuts.append(i)
    cuts.append(len(sizes))
    return [(cuts[k], cuts[k + 1]) for k in range(n)]


def _split_kvs(no: int, count: int, n_tensors: int) -> list[bytes]:
    return [encode_kv("split.no", VT.UINT16, no), encode_kv("split.count", VT.UINT16, count),
            encode_kv("split.tensors.count", VT.INT32, n_tensors)]


@contextlib.contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


@dataclass
class WriteStats:
    paths: list[pathlib.Path]
    bytes_written: int
    seconds: float
    plan: list[TensorSpec] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / max(self.seconds, 1e-9)


def write_llama_gguf(path: str | os.PathLike, config: SynthConfig, *,
                     breakage: Breakage | str | None = None, split: int = 1,
                     progress: bool = False, stats: list | None = None) -> pathlib.Path:
    """Write a synthetic Llama GGUF; returns its path (for ``split > 1``, the first shard's).

    ``breakage`` (a :class:`Breakage` or a key of :data:`BREAKAGES`) makes a file the loader
    must reject. ``split > 1`` writes a gguf-split set ``NAME-0000i-of-0000N.gguf`` directly.
    ``stats``, if a list, receives one :class:`WriteStats`.
    """
    cfg = config
    br = _breakage(breakage)
    path = pathlib.Path(path)
    t0 = time.perf_counter()
    if cfg.tokenizer_from is not None:
        tok_kvs, n_vocab = tokenizer_kvs_from(cfg.tokenizer_from)
        if n_vocab != cfg.vocab_size:
            raise ConfigError(
                f"the tokenizer of {cfg.tokenizer_from} has {n_vocab} tokens but the model's "
                f"vocab_size is {cfg.vocab_size}; set vocab_size={n_vocab} (--vocab {n_vocab})")
    else:
        tok_kvs = minimal_tokenizer_kvs(cfg.vocab_size)
    plan = tensor_plan(cfg)
    for name in (br.drop_tensor, br.duplicate_tensor, br.wrong_shape, *(br.tensor_type or {})):
        if name is not None and name not in {t.name for t in plan}:
            raise ConfigError(f"breakage names tensor {name!r}, which this model does not have")

    # Apply tensor-level breakage to the plan.
    specs: list[TensorSpec] = []
    for t in plan:
        if t.name == br.drop_tensor:
            continue
        if br.tensor_type and t.name in br.tensor_type:
            qt = QT[br.tensor_type[t.name]]
            shape = t.shape
            if shape[0] % GGML_QUANT_SIZES[qt][0]:
                shape = (-(-shape[0] // GGML_QUANT_SIZES[qt][0]) * GGML_QUANT_SIZES[qt][0],
                         *shape[1:])
            t = dataclasses.replace(t, qtype=int(qt), shape=shape)
        if t.name == br.wrong_shape:
            shape = (t.shape[0], max(1, t.shape[1] // 2), *t.shape[2:]) if len(t.shape) > 1 \
                else (t.shape[0] // 2,)
            t = dataclasses.replace(t, shape=shape)
        specs.append(t)
        if t.name == br.duplicate_tensor:
            specs.append(t)

    pools = _Pools(cfg.seed)

    def entry(t: TensorSpec) -> _Entry:
        nbytes = t.nbytes
        if len(t.shape) < 2:
            return _Entry(t.name, t.shape, t.qtype, nbytes, _bytes_writer(_small_tensor(t, cfg)))
        pool = pools.get(t.qtype, t.std)
        return _Entry(t.name, t.shape, t.qtype, nbytes,
                      _pool_writer(pool, nbytes, _start_block(cfg.seed, t.name)))

    entries = [entry(t) for t in specs]
    meta = _metadata_kvs(cfg, br, tok_kvs)
    version = br.version if br.version is not None else GGUF_VERSION
    magic = b"GGUX" if br.bad_magic else GGUF_MAGIC
    total = sum(-(-e.nbytes // cfg.alignment) * cfg.alignment for e in entries)

    if split > 1:
        paths = _split_names(path, split)
        groups = _partition([e.nbytes for e in entries], split)
    else:
        paths = [path]
        groups = [(0, len(entries))]
    written = 0
    label = f"writing {paths[0].name}" + (f" (+{split - 1} shards)" if split > 1 else "")
    try:
        with _progress(total, label, progress) as advance:
            for i, (p, (a, b)) in enumerate(zip(paths, groups)):
                if split > 1:
                    kvs = (meta if i == 0 else []) + _split_kvs(i, split, len(entries))
                    if i > 0 and cfg.alignment != DEFAULT_ALIGNMENT:
                        kvs.append(encode_kv("general.alignment", VT.UINT32, cfg.alignment))
                else:
                    kvs = meta
                written += _write_gguf(p, kvs, entries[a:b], version=version, magic=magic,
                                       alignment=cfg.alignment, advance=advance)
    except BaseException as e:  # disk full, Ctrl-C: leave no half-written model behind
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()
        if isinstance(e, OSError):
            raise NtxError(f"cannot write {e.filename or paths[0]}: {e.strerror or e}") from e
        raise
    if br.truncate is not None:
        last = paths[-1]
        cut = br.truncate if br.truncate >= 0 else max(1, entries[groups[-1][1] - 1].nbytes // 2)
        size = last.stat().st_size
        os.truncate(last, max(0, size - cut))
        written -= min(cut, size)
    if stats is not None:
        stats.append(WriteStats(paths, written, time.perf_counter() - t0, plan))
    return paths[0]


# ---------------------------------------------------------------------------------------------
# Splitting an existing GGUF (gguf-split layout)


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int, chunk: int = 64 << 20) -> None:
    """Copy ``n`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``'s position (copy_file_range
    where the kernel has it, pread/write otherwise)."""
    left = n
    off = offset
    while left:
        m = min(chunk, left)
        try:
            done = os.copy_file_range(src_fd, dst_fd, m, off)
        except (AttributeError, OSError):
            done = 0
        if done <= 0:
            data = os.pread(src_fd, m, off)
            if not data:
                raise NtxError(f"unexpected end of file while copying tensor data at {off}")
            _write_all(dst_fd, [data])
            done = len(data)
        off += done
        left -= done


def split_gguf(src: str | os.PathLike, n_shards: int, *, out: str | os.PathLike | None = None,
               remove_src: bool = False, progress: bool = False) -> list[pathlib.Path]:
    """Split a GGUF into ``n_shards`` files the way llama.cpp's gguf-split does.

    Shards are named ``<out stem>-00001-of-0000N.gguf`` (``out`` defaults to ``src``), tensors
    keep their order and are cut into runs of about equal bytes; the first shard carries all
    metadata, every shard carries ``split.no``/``split.count``/``split.tensors.count``.
    """
    src = pathlib.Path(src)
    lay = read_gguf_layout(src)
    if n_shards < 1:
        raise ConfigError(f"cannot split into {n_shards} shards")
    paths = _split_names(pathlib.Path(out) if out is not None else src, n_shards)
    groups = _partition([t.nbytes for t in lay.tensors], n_shards)
    meta = [kv.raw for kv in lay.kvs if not kv.key.startswith("split.")]
    total = sum(t.nbytes for t in lay.tensors)
    fd = os.open(src, os.O_RDONLY)
    try:
        with _progress(total, f"splitting {src.name}", progress) as advance:
            for i, (p, (a, b)) in enumerate(zip(paths, groups)):
                kvs = (meta if i == 0 else []) + _split_kvs(i, n_shards, len(lay.tensors))
                if i > 0 and lay.alignment != DEFAULT_ALIGNMENT:
                    kvs.append(encode_kv("general.alignment", VT.UINT32, lay.alignment))

                def writer(t: RawTensor):
                    return lambda out: _copy_range(fd, out, lay.data_start + t.offset, t.nbytes)

                entries = [_Entry(t.name, t.shape, t.qtype, t.nbytes, writer(t))
                           for t in lay.tensors[a:b]]
                _write_gguf(p, kvs, entries, version=GGUF_VERSION, alignment=lay.alignment,
                            advance=advance)
    except BaseException as e:  # leave no partial set behind
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()
        if isinstance(e, OSError):
            raise NtxError(f"cannot split {src}: {e.strerror or e}") from e
        raise
    finally:
        os.close(fd)
    if remove_src:
        src.unlink()
    return paths


__all__ = [
    "ALL_TYPES", "BREAKAGES", "Breakage", "GGUFLayout", "MATRIX_TYPES", "MIXES", "PRESETS",
    "SynthConfig", "TensorSpec", "WriteStats", "choose_type", "encode_kv", "llama31_rope_factors",
    "make_blocks", "minimal_tokenizer_kvs", "preset_config", "read_gguf_layout", "split_gguf",
    "tensor_plan", "tensor_types", "tokenizer_kvs_from", "use_more_bits", "write_llama_gguf",
]
