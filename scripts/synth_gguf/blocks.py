"""Random but valid blocks of every supported tensor type, made fast through checked pools.

Every block is a valid block of its type with finite f16 scales, and the scales are chosen so
that each weight matrix has std ≈ 1/sqrt(fan_in) (fan_in = the row length, GGUF ``ne[0]``):
activations stay finite and well scaled through all layers.

How it is fast: for every (type, std) pair the writer generates one *pool* of random blocks
(about 2 MB, a prime number of blocks so that rows do not repeat with a short period), checks
the whole pool with ``gguf.quants.dequantize`` (finite, std near the target), and then writes
every tensor of that kind by tiling the pool from a per-tensor starting block (so tensors
differ). Every byte in the file is a copy of a checked pool byte, so checking the pools checks
the file. Data is written with large sequential writes; the model is never held in memory.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gq

from ntx.shared.quant_types import SUPPORTED_TYPES

# Llama 3.1 rope scaling (as in convert_hf_to_gguf.py for "rope_type": "llama3").
LLAMA31_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


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


# One encoder per type: (nblocks, std, jitter [nblocks] in 0.75..1.25, rng) -> uint8
# [nblocks, block_bytes]. For F32/F16/BF16 a "block" is one element.


def _float_blocks(qt: QT):
    def encode(nblocks: int, std: float, jitter: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        x = rng.standard_normal(nblocks) * std
        if qt == QT.F32:
            return x.astype("<f4").view(np.uint8).reshape(-1, 4)
        if qt == QT.F16:
            return _f16_bytes(x)
        f = x.astype("<f4").view(np.uint32)  # BF16: round to nearest even
        return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype("<u2").view(np.uint8).reshape(-1, 2)
    return encode


def _legacy_blocks(qt: QT):
    """Q4_0, Q4_1, Q5_0, Q5_1: an f16 scale (and an f16 min for the _1 types), 4- or 5-bit values."""
    nib = qt in (QT.Q4_0, QT.Q4_1)
    k = math.sqrt((16**2 - 1) / 12) if nib else math.sqrt((32**2 - 1) / 12)
    mid = 7.5 if nib else 15.5

    def encode(nblocks: int, std: float, jitter: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        d = std / k * jitter
        parts = [_f16_bytes(d)]
        if qt in (QT.Q4_1, QT.Q5_1):
            parts.append(_f16_bytes(-mid * d))
        if not nib:
            parts.append(_u8(rng, (nblocks, 4)))
        parts.append(_u8(rng, (nblocks, 16)))
        return np.concatenate(parts, axis=1)
    return encode


def _q8_0_blocks(nblocks: int, std: float, jitter: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    k = math.sqrt((129**2 - 1) / 12)  # uniform -64..64
    q = rng.integers(-64, 65, size=(nblocks, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(std / k * jitter), q], axis=1)


def _q45_k_blocks(qt: QT):
    """Q4_K, Q5_K: f16 d and dmin, eight 6-bit scales and mins, 4- or 5-bit values."""
    five = qt == QT.Q5_K
    k = math.sqrt((32**2 - 1) / 12) if five else math.sqrt((16**2 - 1) / 12)

    def encode(nblocks: int, std: float, jitter: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        lo, hi = _scale_range(std, k, 31)
        sc = rng.integers(lo, hi + 1, size=(nblocks, 8))
        rms = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
        d = std / (k * rms) * jitter
        # value = d*sc*q - dmin*m with m = sc and dmin = mid*d  ->  d*sc*(q - mid): zero mean
        dmin = (15.5 if five else 7.5) * d
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, sc)]
        if five:
            parts.append(_u8(rng, (nblocks, 32)))
        parts.append(_u8(rng, (nblocks, 128)))
        return np.concatenate(parts, axis=1)
    return encode


def _q6_k_blocks(nblocks: int, std: float, jitter: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    k = math.sqrt((64**2 - 1) / 12)
    lo, hi = _scale_range(std, k, 63)
    sc = rng.integers(lo, hi + 1, size=(nblocks, 16)) * rng.choice([-1, 1], size=(nblocks, 16))
    rms = np.sqrt((sc.astype(np.float64) ** 2).mean(axis=1))
    d = std / (k * rms) * jitter
    return np.concatenate([_u8(rng, (nblocks, 128)), _u8(rng, (nblocks, 64)),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _u8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


ENCODERS = {
    **{qt: _float_blocks(qt) for qt in (QT.F32, QT.F16, QT.BF16)},
    **{qt: _legacy_blocks(qt) for qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)},
    QT.Q8_0: _q8_0_blocks,
    **{qt: _q45_k_blocks(qt) for qt in (QT.Q4_K, QT.Q5_K)},
    QT.Q6_K: _q6_k_blocks,
}
assert set(ENCODERS) == SUPPORTED_TYPES, "every type ntx reads needs an encoder here"


def make_blocks(qtype: int, nblocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``nblocks`` random valid blocks of ``qtype`` (uint8 [nblocks, type_size]) whose values
    have mean ≈ 0 and std ≈ ``std``. For F32/F16/BF16 a "block" is one element. Any other type
    (only reached through ``Breakage.tensor_type``) gets random bytes of the right size."""
    qt = QT(qtype)
    jitter = rng.uniform(0.75, 1.25, nblocks)  # per-block scale spread (drawn first for every type)
    encode = ENCODERS.get(qt)
    if encode is None:
        return _u8(rng, (nblocks, GGML_QUANT_SIZES[qt][1]))
    return encode(nblocks, std, jitter, rng)


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
class Pool:
    """Checked random blocks of one (type, std), tiled to write every tensor of that kind."""

    data: np.ndarray      # uint8, flat, nblocks * type_size
    type_size: int
    nblocks: int
    measured_std: float


_POOL_CACHE: dict[tuple, Pool] = {}   # checked pools, reused across writes in one process
_POOL_CACHE_MAX = 32


class Pools:
    """One checked pool of random blocks per (type, std), for one seed."""

    def __init__(self, seed: int, pool_bytes: int = 2 << 20, check: bool = True) -> None:
        self.seed = seed
        self.pool_bytes = pool_bytes
        self.check = check

    def get(self, qtype: int, std: float) -> Pool:
        key = (self.seed, self.pool_bytes, self.check, int(qtype), round(std, 9))
        pool = _POOL_CACHE.get(key)
        if pool is None:
            pool = self._make(qtype, std)
            if len(_POOL_CACHE) >= _POOL_CACHE_MAX:
                _POOL_CACHE.pop(next(iter(_POOL_CACHE)))
            _POOL_CACHE[key] = pool
        return pool

    def _make(self, qtype: int, std: float) -> Pool:
        tsize = GGML_QUANT_SIZES[QT(qtype)][1]
        nb = _next_prime(max(64, self.pool_bytes // tsize))
        h = hashlib.blake2b(f"{self.seed}/{qtype}/{std!r}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        blocks = make_blocks(qtype, nb, std, rng)
        measured = float("nan")
        if self.check and QT(qtype) in SUPPORTED_TYPES:
            vals = gq.dequantize(blocks, QT(qtype)).astype(np.float64)
            if not np.isfinite(vals).all():  # pragma: no cover - a generator bug
                raise AssertionError(f"non-finite values in a {QT(qtype).name} pool")
            measured = float(vals.std())
            if not (0.5 * std <= measured <= 1.5 * std):  # pragma: no cover - a generator bug
                raise AssertionError(f"{QT(qtype).name} pool std {measured:.3g}, wanted {std:.3g}")
        return Pool(np.ascontiguousarray(blocks).reshape(-1), tsize, nb, measured)


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

