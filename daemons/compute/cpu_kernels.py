"""Quantized matrix products on the host's cores: numba-compiled, multi-threaded, GIL-free.

Why numba. The CPU backend must run GGUF's quantized types near the host's memory bandwidth
(a decode step reads every weight once). numba compiles these loops with LLVM for the host's own
vector unit (AVX2 here), runs ``prange`` loops on its thread pool and releases the GIL; it
installs as two wheels from PyPI in seconds, with no compiler on the machine. ggml's CPU backend
(llama.cpp's kernels) is faster per byte but reaches Python only through llama-cpp-python, which
PyPI ships as source that builds the whole of llama.cpp with cmake and a C++ compiler at install
(minutes on two cores), and through ctypes calls whose per-call cost is paid some 200 times a
token. docs/PERFORMANCE.md has both measured side by side (``scripts/cpu_vs_llamacpp.py``).

How. Every supported type is unpacked once, when a layer is prepared, into one of two canonical
forms whose inner loops vectorize:

* ``C4`` (Q4_0, Q4_1, Q4_K): 4-bit values q in [0, 15], 16 bytes per group of 32 weights (byte j
  holds weight j in its low nibble and weight j + 16 in its high one), and per group a scale and
  an offset: w = scale * q + offset.
* ``C8`` (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0): one int8 per weight and per group (32 weights, 16 for
  Q6_K) a scale, and an offset for the types that have one.

Scales come in one of two levels, as the GGUF type has them. The legacy types (Q4_0 ... Q8_0) have
a half float per group: it is held as float32 (Q4_0/Q4_1: 24 bytes per 32 weights). The K-quants
have a float per 256-weight super-block times a small integer per group: they keep that, an int8
per group and a float32 per super-block (Q4_K: 19 bytes per 32 weights, against 18 in the file
and 24 as one float32 pair per group; Q6_K: 33.5 read, against 40). The products multiply the two
levels back, exactly (an 11-bit half times a 6- or 8-bit integer fits float32's 24 bits), so
the two forms give the same bits. A decode step reads every weight once: where the memory bounds
it, a fifth fewer bytes is up to a fifth less time (the 70B's cpu tier: 1.08x in one A/B on the
H200's host). Half-float scales for the legacy types were measured and dropped: widening a half
exactly cost more than its bytes saved (docs/PERFORMANCE.md, "The CPU backend").

Where the CPU has AVX-512 VNNI (``VNNI``), both forms take a layout of their own ("c4v", "c8v":
each lane's bytes four by four) and their products go through ``vpdpbusd``, called as an LLVM
intrinsic (``_block16_vnni_rows``, ``_quads4_vnni_rows``): eight instructions sum a 32-weight 4-bit block
for 16 rows, against some 60 for the int16 lanes. The 8-bit values are stored shifted by 128
(unsigned, as vpdpbusd takes them) and 128 times the activations' sum is taken off. The integer
sums are the same integers, and the float steps after them the same, so the bits are too.
Measured on the 2-core VM (AMD EPYC, Zen 4), one row: 2.2x the int16 kernel on a 4096x4096
Q4_K in cache; the 8B-shaped Q4_K_M from 0.75x to 0.94x llama.cpp at 2 threads
(docs/PERFORMANCE.md). Q6_K takes "c6v" there (``_pack_c6v``): 6 bits a value as in the file,
the bytes c8v would hold rebuilt in registers (masks and shifts) before the same ``vpdpbusd``:
a quarter fewer value bytes, and from memory on 2 threads a 14336x4096 product 1.25-1.35x
faster than c8v; the same bits (``NTX_CPU_C6V=0``: c8v).

F16, BF16 and F32 matrices become float32 and go through BLAS (numpy's ``@``).

Activations are quantized per 32 values to int8 with a float32 scale, as llama.cpp does (its
q8_0/q8_1 blocks), and products are summed in int32 per group: ``x·w = Σ_g scale_g · (xd_b · Σ q·xq)
+ offset_g · xd_b · Σ xq``. The result differs from the float32 reference
(``cpu_backend``'s numpy path) by the activation's rounding, about 0.5% of a row's largest output
(the tests state the bound). Every row of x, a prompt's too, takes this same path, and each output
is one thread's fixed sequence of operations: a row's result does not depend on the other rows of
its pass nor on the thread count (batch-invariant), so greedy output is the same alone, batched
or verified in a speculation tree. (Dequantized tiles through BLAS would be about twice as fast
on long prompts, but BLAS rounds a row differently with the pass's row count.)
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K

from ntx.shared.errors import ConfigError

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange
    from numba import types as nb_types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba is a base dependency; the numpy path needs none
    numba = None


def _pin_vector_width() -> None:
    """Compile every kernel for LLVM's ``prefer-256-bit``, whatever the host prefers, before the
    first one is compiled. Why: the norm's and attention's float sums are fast-math (cpu_ops), so
    LLVM vectorizes them at the width the target prefers: 256-bit on its Intel targets, AVX-512
    or not, 512-bit on AMD Zen 4. Through the int8 rounding after the norm, that last bit made
    the greedy text differ between such hosts; their prompt log-probabilities were as far apart
    (mean 0.040) as either is from the float32 reference (dev/cpu/vector_width.py). Pinned, the
    Intel targets, Haswell's and Zen 4's compile the same bits. The 512-bit VNNI products name
    their instruction, so Zen 4 keeps them; the fixed-order sums measured 0.6x as fast on long
    prompts, so the width is pinned, not the order. ``NUMBA_CPU_FEATURES`` naming
    ``prefer-256-bit`` (``-prefer-256-bit``: the host's own choice) is left as given."""
    if numba is None:
        return
    features = numba.config.CPU_FEATURES
    if features is None:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
    if "prefer-256-bit" not in features:
        numba.config.CPU_FEATURES = ",".join(f for f in (features, "+prefer-256-bit") if f)


_pin_vector_width()


TIER_SPARE_CORES = 2  # cores the cpu tier leaves to compute's thread and the dma daemon (set_threads)
C4_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q4_K)
C8_TYPES = (QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0)
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)  # two-level scales (``Unpacked``)
SUPPORTED_TYPES = C4_TYPES + C8_TYPES + FLOAT_TYPES


def available() -> bool:
    """Whether the compiled kernels can run here (numba imports)."""
    return numba is not None


def _host_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (``vpdpbusd``: 64 byte products summed by fours into 16
    int32 lanes in one instruction), which the 4- and 8-bit products use where it exists
    (``NTX_CPU_VNNI=0`` turns that off), and numba compiles for it: for the host's CPU (the
    default), or for one that ``NUMBA_CPU_NAME`` names with VNNI in ``NUMBA_CPU_FEATURES``."""
    if numba is None or os.environ.get("NTX_CPU_VNNI", "").strip() == "0":
        return False
    target = numba.config.CPU_NAME
    if target not in (None, "", "host"):
        # numba compiles for another CPU (NUMBA_CPU_NAME, e.g. "generic" for a cache shared by a
        # fleet): only the features it was given count. LLVM aborts the process, no exception,
        # when it meets vpdpbusd on a target without it.
        given = set((numba.config.CPU_FEATURES or "").split(","))
        return {"+avx512vnni", "+avx512bw"} <= given
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
        return bool(features.get("avx512vnni")) and bool(features.get("avx512bw"))
    except Exception:  # pragma: no cover - a platform llvmlite cannot describe
        return False


# The 4-bit forms' layout: "c4v" (for vpdpbusd) where the CPU has VNNI, else "c4" (int16 lanes)
VNNI = _host_has_vnni()


def set_threads(n: int | None = None, spare: int = 0) -> int:
    """Use ``n`` threads (None: ``$NTX_CPU_THREADS``, else every core numba sees less ``spare``);
    returns it. The cpu tier beside a GPU spares two cores (``TIER_SPARE_CORES``): compute's own
    thread and the dma daemon's copies run beside it, and a parallel product waits for its
    slowest thread, so one descheduled worker costs the whole product."""
    if n is None:
        env = os.environ.get("NTX_CPU_THREADS", "").strip()
        if env:
            try:
                n = int(env)
            except ValueError:
                raise ConfigError(f"NTX_CPU_THREADS={env!r} is not a number of threads (unset it, or give e.g. 2)")
    limit = numba.config.NUMBA_NUM_THREADS
    n = max(1, limit - spare) if n is None else n
    if not 1 <= n <= limit:
        raise ConfigError(f"{n} CPU threads asked for, but this machine runs at most {limit} (NTX_CPU_THREADS)")
    numba.set_num_threads(n)
    return n


# ---------------------------------------------------------------------------------------------
# Unpacking GGUF blocks into the canonical forms (numpy, once per prepared layer)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two uint8 columns -> float32: GGUF's little-endian half floats."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] uint8 of a 32-weight block (low nibbles: weights 0-15, high: 16-31) -> [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] uint8, bit j of the little-endian word is weight j's fifth bit -> [..., 32] uint8."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


@dataclass
class Unpacked:
    """A quantized matrix's integer values and scales, exactly as GGUF stores them:
    w = scale * q + offset per group of ``group`` weights, where for the K-quants (``two_level``)
    scale = super_scale * sub_scale and offset = super_offset * sub_offset per 256-weight
    super-block and group.

    q [N, K] uint8 or int8; scale / offset [N, K/G]: float32 (one level) or the groups' small
    integers as int8 (two levels; offset None where the type has none); super_scale /
    super_offset [N, K/256] float32 (two levels only).
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int
    super_scale: np.ndarray | None = None
    super_offset: np.ndarray | None = None

    @property
    def two_level(self) -> bool:
        return self.super_scale is not None


def unpack(raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int) -> Unpacked:
    """A quantized matrix's integer values and scales (``Unpacked``). raw: the tensor's bytes."""
    t = QT(ggml_type)
    rows = raw.reshape(n_rows, -1)
    if t == QT.Q8_0:
        b = rows.reshape(n_rows, -1, 34)
        return Unpacked(b[..., 2:].view(np.int8).reshape(n_rows, n_cols), _f16(b[..., 0:2]), None, 32)
    if t in (QT.Q4_0, QT.Q4_1):
        head = 2 if t == QT.Q4_0 else 4
        b = rows.reshape(n_rows, -1, head + 16)
        d = _f16(b[..., 0:2])
        m = -8.0 * d if t == QT.Q4_0 else _f16(b[..., 2:4])
        return Unpacked(_nibbles_32(b[..., head:]).reshape(n_rows, n_cols), d, m.astype(np.float32), 32)
    if t in (QT.Q5_0, QT.Q5_1):
        head = 2 if t == QT.Q5_0 else 4
        b = rows.reshape(n_rows, -1, head + 20)
        d = _f16(b[..., 0:2])
        q = _nibbles_32(b[..., head + 4:]) | (_high_bits_32(b[..., head:head + 4]) << 4)  # [N, nb, 32] 0..31
        if t == QT.Q5_0:
            return Unpacked((q.astype(np.int8) - 16).reshape(n_rows, n_cols), d, None, 32)
        return Unpacked(q.reshape(n_rows, n_cols), d, _f16(b[..., 2:4]), 32)
    if t in (QT.Q4_K, QT.Q5_K):
        size = 144 if t == QT.Q4_K else 176
        b = rows.reshape(-1, size)  # [N*nsb, size], one 256-weight super-block a row
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [nsb, 8] each
        qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 8, 32)  # sub-block s: the low (s even) or high nibbles of 32 bytes
        if t == QT.Q5_K:
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
        # sc, mn: 6-bit, so int8 holds them; w = (d * sc) * q + (-dmin * mn), each product exact
        return Unpacked(q.reshape(n_rows, n_cols), sc.astype(np.int8).reshape(n_rows, -1),
                        mn.astype(np.int8).reshape(n_rows, -1), 32,
                        d.reshape(n_rows, -1).astype(np.float32), (-dmin).reshape(n_rows, -1).astype(np.float32))
    if t == QT.Q6_K:
        b = rows.reshape(-1, 210)
        ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(-1, 2, 4, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = (ql | ((qh & 3) << 4)).astype(np.int8) - 32  # [nsb, 2, 4, 32] in weight order
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)  # [nsb, 16]: w = (d * sc) * q
        return Unpacked(q.reshape(n_rows, n_cols), sc.reshape(n_rows, -1), None, 16,
                        _f16(b[:, 208:210]).reshape(n_rows, -1))
    raise ConfigError(f"no CPU kernel for {t.name} (supported: {', '.join(x.name for x in SUPPORTED_TYPES)})")


# Rows interleaved per group of a packed matrix: its products run across them in vector lanes.
# Always 128: LLVM vectorizes the loops across lanes by blocks of 128 int16 (four 512-bit
# registers), and a group of 64 runs its lanes in the loop's remainder at half the speed
# (measured on the 2-core AMD EPYC, Q4_1, one row: 576x576 in 64-row groups 31 us, the same rows
# padded to 640 in 128-row groups 17 us). A matrix whose rows are not a multiple of 128 (SmolLM2's
# 576 and 192) gets zero rows up to the next one; their outputs are never written.
LANES = 128


def lanes_for(n_rows: int) -> int:
    """Rows per interleaved group (``LANES``, whatever ``n_rows``; the last group is padded)."""
    return LANES


def padded_rows(n_rows: int) -> int:
    """``n_rows`` up to a whole number of interleaved groups."""
    return -(-n_rows // LANES) * LANES


@dataclass
class PackedMatrix:
    """A weight matrix [N, K] in a canonical form (see the module's docstring), its rows
    interleaved in groups of ``lanes`` so that one vector instruction serves ``lanes`` rows.

    ``form``: "c4", "c4v", "c8" or "f32". N/R below is rounded up: the last group's rows past N
    are zeros (``LANES``). c4: ``q`` [N/R, K/32, 16, R] uint8 (byte j of a block holds
    columns j and j + 16 of the row); c4v, the same bytes for VNNI: [N/R, K/32, R/16, 4, 16, 4],
    byte j = 4k + i of lane 16c + l at [., ., c, k, l, i] (a lane's four bytes side by side); c8: ``q`` [N/R, K/G, G, R] int8; ``scale``/``offset``
    [N/R, K/G, R] (``offset`` all zeros where the type has none), float32 for the one-level types
    and int8 for the K-quants, whose ``super_scale``/``super_offset`` [N/R, K/256, R] float32
    multiply them (the one-level types' are [N/R, 1, R] ones: the kernels have one form). f32:
    ``q`` [N, K] float32 and no scales. ``span``: how many c8 products with an int8 activation (|xq| <= 127)
    add up in int16 before they are widened: 8 when every value is within [-32, 32] (Q5_x, Q6_K),
    2 for Q8_0's [-128, 127]. ``has_offset``: the type has offsets (Q5_1, Q5_K); the others' zeros
    are kept for dequantizing but never read by the products.
    """

    form: str
    n_rows: int
    n_cols: int
    q: np.ndarray
    scale: np.ndarray | None = None
    offset: np.ndarray | None = None
    group: int = 32
    span: int = 8
    has_offset: bool = True
    super_scale: np.ndarray | None = None
    super_offset: np.ndarray | None = None
    shift: int = 0  # c8v: what was added to each value to make it unsigned (128 for the signed types)
    fused: "FusedProduct | None" = field(default=None, repr=False, compare=False)  # the whole it is part of

    @property
    def lanes(self) -> int:
        return 1 if self.form == "f32" else LANES

    def product(self, qx: "QuantizedActivations", out: np.ndarray) -> None:
        """out [T, N] = qx @ self.T on the int8 kernels (out C-contiguous): the products' one call
        per matrix, so it chooses nothing it could have known early."""
        parallel = qx.xq.shape[0] * self.n_rows * self.n_cols >= PARALLEL_FROM_MACS
        if self.form == "c4":
            (_mm_c4_par if parallel else _mm_c4_ser)(self.q, self.scale, self.offset, self.super_scale,
                                                     self.super_offset, qx.xq, qx.xd, qx.xs, out)
        elif self.form == "c4v":
            (_mm_c4v_par if parallel else _mm_c4v_ser)(self.q, self.scale, self.offset, self.super_scale,
                                                       self.super_offset, qx.xq, qx.xd, qx.xs, out)
        elif self.form == "c8v":
            (_mm_c8v_par if parallel else _mm_c8v_ser)(self.q, self.scale, self.offset, self.super_scale,
                                                       self.super_offset, self.has_offset, self.shift,
                                                       qx.xq, qx.xd, qx.xs, out)
        elif self.form == "c6v":
            (_mm_c6v_par if parallel else _mm_c6v_ser)(self.q, self.scale, self.super_scale, qx.xq, qx.xd, out)
        else:
            (_mm_c8_par if parallel else _mm_c8_ser)(self.q, self.scale, self.offset, self.super_scale,
                                                     self.super_offset, self.has_offset, self.span,
                                                     qx.xq, qx.xd, qx.xs, out)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.offset, self.super_scale, self.super_offset)
                   if a is not None)


def _interleave(a: np.ndarray, lanes: int, fill: float = 0) -> np.ndarray:
    """[N, ...] -> [ceil(N/R), ..., R]: row r of group g in lane r; the rows past N hold ``fill``."""
    n = a.shape[0]
    pad = -n % lanes
    if pad:
        a = np.concatenate([a, np.full((pad,) + a.shape[1:], fill, a.dtype)])
    a = a.reshape((a.shape[0] // lanes, lanes) + a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def pack(raw: np.ndarray, ggml_type: int, n_rows: int, n_cols: int) -> PackedMatrix:
    """The matrix ``raw`` (GGUF bytes of [n_rows, n_cols]) in its canonical form."""
    t = QT(ggml_type)
    if t in FLOAT_TYPES:
        from ntx.daemons.compute.quants import dequantize

        return PackedMatrix("f32", n_rows, n_cols, dequantize(raw, t, (n_rows, n_cols)))
    if n_cols % 32:
        raise ConfigError(f"a {t.name} matrix of {n_cols} columns: the CPU kernels need a multiple of 32")
    u = unpack(raw, t, n_rows, n_cols)
    lanes = lanes_for(n_rows)
    off = np.zeros_like(u.scale) if u.offset is None else u.offset.astype(u.scale.dtype)
    if u.two_level:
        sup_scale = u.super_scale
        sup_off = np.zeros_like(sup_scale) if u.super_offset is None else u.super_offset
    else:
        sup_scale = sup_off = np.ones((n_rows, 1), np.float32)
    scales = dict(scale=_interleave(u.scale, lanes), offset=_interleave(off, lanes),
                  super_scale=_interleave(sup_scale, lanes, 1), super_offset=_interleave(sup_off, lanes))
    if t in C4_TYPES:
        blocks = u.q.reshape(n_rows, -1, 32)
        q4 = _interleave((blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8), lanes)  # [G, K/32, 16, R]
        if VNNI:  # byte j = 4k + i of lane 16c + l -> [G, K/32, c, k, l, i]: a lane's 4 bytes side by side
            G, nb = q4.shape[:2]
            q4 = np.ascontiguousarray(q4.reshape(G, nb, 4, 4, lanes // 16, 16).transpose(0, 1, 4, 2, 5, 3))
            return PackedMatrix("c4v", n_rows, n_cols, q4, group=32, **scales)
        return PackedMatrix("c4", n_rows, n_cols, q4, group=32, **scales)
    q8 = _interleave(u.q.astype(np.int8).reshape(n_rows, -1, u.group), lanes)  # [G, K/GS, GS, R]
    span, has_offset = (2 if t == QT.Q8_0 else 8), u.offset is not None
    if VNNI and C6V and t == QT.Q6_K:  # 6 bits a value, as in the file: _pack_c6v
        return PackedMatrix("c6v", n_rows, n_cols, _pack_c6v(q8, lanes), group=u.group, span=span,
                            has_offset=has_offset, shift=C6_SHIFT, **scales)
    if VNNI:  # unsigned for vpdpbusd (the signed types shifted by 128), each lane's bytes four by four
        shift = 0 if t in (QT.Q5_1, QT.Q5_K) else 128  # Q5_1, Q5_K: values 0..31 already
        G, ng, GS = q8.shape[:3]
        qu = (q8.astype(np.int16) + shift).astype(np.uint8).reshape(G, ng, GS // 4, 4, lanes // 16, 16)
        return PackedMatrix("c8v", n_rows, n_cols, np.ascontiguousarray(qu.transpose(0, 1, 4, 2, 5, 3)), group=u.group,
                            span=span, has_offset=has_offset, shift=shift, **scales)
    return PackedMatrix("c8", n_rows, n_cols, q8, group=u.group, span=span, has_offset=has_offset, **scales)


C6_SHIFT = 32  # c6v: Q6_K's values, -32..31, stored + 32 (0..63 in 6 bits)
C6V = os.environ.get("NTX_CPU_C6V", "").strip() != "0"  # with VNNI, Q6_K in c6v (NTX_CPU_C6V=0: c8v)


def _pack_c6v(q8: np.ndarray, lanes: int) -> np.ndarray:
    """Q6_K's values q8 [G, K/16, 16, R] (int8, -32..31) in the c6v layout, 6 bits a value as
    in the file instead of c8v's 8 (a Q6_K matrix reads 26.25 bytes per 32 weights instead of 34,
    scales included; its products are bound by the bytes they read on a busy memory): per
    16 columns x 16 lanes (16c + l), three 64-byte vectors [c, 3, l, i], i the column within
    quad k (columns 4k + i): the low nibbles of quads 0 and 2 (quad 2's in the high nibble),
    those of quads 1 and 3, and the two high bits of quads 0-3 (bits 2k, 2k + 1). Each value
    + 32: ``_quads4_c6v_rows`` rebuilds c8v's unsigned bytes from the three with masks and shifts."""
    G, ng, GS = q8.shape[:3]
    assert GS == 16, "c6v holds groups of 16 (Q6_K's)"
    u = (q8.astype(np.int16) + C6_SHIFT).astype(np.uint8).reshape(G, ng, 4, 4, lanes // 16, 16)
    u = u.transpose(0, 1, 4, 2, 5, 3)  # [G, ng, c, k, l, i]
    lo, hi = u & 15, u >> 4
    planes = (lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4),
              hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6))
    return np.ascontiguousarray(np.stack(planes, axis=3).astype(np.uint8))  # [G, ng, c, 3, l, i]


@dataclass
class FusedProduct:
    """Matrices that multiply the same x, held end to end in one ``PackedMatrix`` (``whole``) so
    that one parallel product serves them all: a layer's q, k and v, or its gate and up. A
    decode step of a small model (SmolLM2: 576-wide) runs some 200 products, each a parallel
    region whose threads start and wait for the slowest; k and v (192 rows: two groups of 128)
    leave one of two threads idle. ``parts`` are views of ``whole`` (no bytes twice), each at
    its column ``starts[i]`` of ``whole``'s output."""

    whole: PackedMatrix
    parts: list[PackedMatrix]
    starts: list[int]

    def product(self, qx: "QuantizedActivations", outs: list[np.ndarray]) -> None:
        """outs[i] [T, parts[i].n_rows] = qx @ parts[i].T, through one product."""
        full = np.empty((qx.xq.shape[0], self.whole.n_rows), np.float32)
        self.whole.product(qx, full)
        for part, start, out in zip(self.parts, self.starts, outs):
            out[...] = full[:, start:start + part.n_rows]


def _signature(w: PackedMatrix) -> tuple:
    """What two matrices must share to run as one product."""
    return (w.form, w.n_cols, w.group, w.span, w.has_offset, w.shift, w.q.dtype, w.scale.dtype,
            w.super_scale.shape[1:])


def fuse(mats: list[PackedMatrix]) -> FusedProduct | None:
    """``mats`` (products of one x) as one ``FusedProduct``, or None where their forms differ
    (a Q4_K_M layer's Q6_K v beside its Q4_K q and k) or there is one matrix."""
    if len(mats) < 2 or any(w.form == "f32" for w in mats) or len({_signature(w) for w in mats}) != 1:
        return None
    arrays = {name: np.concatenate([getattr(w, name) for w in mats]) for name in
              ("q", "scale", "offset", "super_scale", "super_offset")}
    groups = [w.q.shape[0] for w in mats]
    whole = PackedMatrix(mats[0].form, sum(groups) * LANES, mats[0].n_cols, group=mats[0].group, span=mats[0].span,
                         has_offset=mats[0].has_offset, shift=mats[0].shift, **arrays)
    parts, starts, g0 = [], [], 0
    for w, n_groups in zip(mats, groups):
        views = {name: a[g0:g0 + n_groups] for name, a in arrays.items()}
        parts.append(PackedMatrix(w.form, w.n_rows, w.n_cols, group=w.group, span=w.span, has_offset=w.has_offset,
                                  shift=w.shift, **views))
        starts.append(g0 * LANES)
        g0 += n_groups
    return FusedProduct(whole, parts, starts)


def packed_bytes(ggml_type: int, n_rows: int, n_cols: int) -> int:
    """What ``pack`` holds for such a matrix, without packing it (the planner's figure)."""
    t = QT(ggml_type)
    if t in FLOAT_TYPES:
        return n_rows * n_cols * 4
    group = 16 if t == QT.Q6_K else 32
    n_rows = padded_rows(n_rows)
    if t in K_TYPES:  # an int8 scale and offset per group, two float32 per super-block
        scales = 2 * (n_rows * n_cols // group) + 2 * (n_rows * n_cols // 256) * 4
    else:  # a float32 scale and offset per group, and the [N, 1] ones of the second level
        scales = 2 * (n_rows * n_cols // group) * 4 + 2 * n_rows * 4
    values = n_rows * n_cols // 2 if t in C4_TYPES else n_rows * n_cols * 3 // 4 if (t == QT.Q6_K and VNNI and C6V) \
        else n_rows * n_cols
    return values + scales


# ---------------------------------------------------------------------------------------------
# The compiled loops

# Products smaller than this many multiply-adds run on one thread: waking the others costs more
# (and on a machine whose cores are busy, a descheduled worker stalls the whole product). Above
# it, even a 576x576 matrix (SmolLM2's) gains: a decode step reads every layer from memory,
# and one thread alone reads at a fraction of the memory's bandwidth.
PARALLEL_FROM_MACS = 1 << 17


def _compiled(f):
    """``f`` compiled twice: parallel over its ``prange`` (for big products) and serial (a copy
    under its own name, so that numba's on-disk cache keeps the two apart)."""
    serial = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial", f.__defaults__, f.__closure__)
    serial.__qualname__ = f.__qualname__ + "_serial"
    return njit(parallel=True, **_EXACT)(f), njit(parallel=False, **_EXACT)(serial)


if numba is not None:
    _JIT = dict(nogil=True, fastmath=True, cache=True, boundscheck=False)
    # The products: no fast-math, so that the serial and the parallel build (and every row count)
    # round each output the same way (fast-math lets LLVM fuse multiply-adds where it vectorizes);
    # their integer loops vectorize without it, and their float sums run across rows, not along one.
    _EXACT = dict(nogil=True, fastmath=False, cache=True, boundscheck=False)

    @njit(**_EXACT)  # no fast-math: its NaN test must stay
    def round_rows(x, xq, xd, xs):  # pragma: no cover - compiled
        # x: [T, K] f32 -> xq [T, K] int8, xd [T, K/32] scale, xs [T, K/32] = xd * sum of xq.
        # A block holding NaN or inf gets that as its scale, so the products that read it are
        # NaN too and the engine reports the numerical error (rounding would hide it).
        T, K = x.shape
        for t in range(T):
            for b in range(K // 32):
                amax = np.float32(0.0)
                for j in range(32):
                    a = abs(x[t, b * 32 + j])
                    if not a <= amax:  # NaN wins too
                        amax = a
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d if d > 0 and d < np.inf else np.float32(0.0)
                s = np.int32(0)
                for j in range(32):
                    v = np.int32(np.rint(x[t, b * 32 + j] * inv)) if inv > 0 else np.int32(0)
                    xq[t, b * 32 + j] = v
                    s += v
                xd[t, b] = d
                xs[t, b] = d * np.float32(s)

    @njit(inline="always", **_EXACT)
    def _lane_sums(R):  # pragma: no cover - compiled
        """A thread's sums across R rows: int16 (a few products), int32 (a group), float32 (the row)."""
        return np.empty(R, np.int16), np.empty(R, np.int32), np.empty(R, np.float32)

    def _mm_c4(q, scale, offset, sscale, soffset, xq, xd, xs, out):  # pragma: no cover - compiled
        # q: [G, K/32, 16, R] u8; scale/offset: [G, K/32, R] f32 or int8; sscale/soffset:
        # [G, S, R] f32 (S super-blocks; a group's scale is sscale * scale); xq: [T, K] int8;
        # xd/xs: [T, K/32] -> out [T, N] (N <= G*R: the padded rows are not written). Eight
        # byte-columns add up in int16 (8 * 2 * 15 * 127 < 2^15).
        n_groups, nb, _, R = q.shape
        T, N = out.shape
        per_super = nb // sscale.shape[1]
        for g in prange(n_groups):
            a16, acc, accf = _lane_sums(R)
            for t in range(T):
                accf[:] = 0
                for b in range(nb):
                    acc[:] = 0
                    for h in range(2):
                        a16[:] = 0
                        for j in range(h * 8, h * 8 + 8):
                            xl = np.int16(xq[t, b * 32 + j])
                            xh = np.int16(xq[t, b * 32 + 16 + j])
                            for r in range(R):
                                v = np.int16(q[g, b, j, r])
                                a16[r] += np.int16(v & 15) * xl + np.int16(v >> 4) * xh
                        for r in range(R):
                            acc[r] += np.int32(a16[r])
                    d = xd[t, b]
                    o = xs[t, b]
                    sb = b // per_super
                    for r in range(R):
                        accf[r] += ((sscale[g, sb, r] * np.float32(scale[g, b, r])) * d * np.float32(acc[r])
                                    + (soffset[g, sb, r] * np.float32(offset[g, b, r])) * o)
                for r in range(min(R, N - g * R)):
                    out[t, g * R + r] = accf[r]

    def _mm_c8(q, scale, offset, sscale, soffset, has_offset, span, xq, xd, xs, out):  # pragma: no cover
        # q: [G, K/GS, GS, R] int8 (GS: 16 or 32 columns a scale); scale/offset: [G, K/GS, R]
        # f32 or int8, times sscale/soffset [G, S, R] (as in _mm_c4); offset read only when
        # has_offset: the types without one save its bytes;
        # -> out [T, N] as in _mm_c4. ``span`` products add up in int16 before int32 (PackedMatrix.span).
        n_groups, ng, GS, R = q.shape
        T, N = out.shape
        per_block = 32 // GS
        per_super = ng // sscale.shape[1]
        for g in prange(n_groups):
            a16, acc, accf = _lane_sums(R)
            for t in range(T):
                accf[:] = 0
                for s in range(ng):
                    acc[:] = 0
                    for h in range(0, GS, span):
                        a16[:] = 0
                        for j in range(h, h + span):
                            xv = np.int16(xq[t, s * GS + j])
                            for r in range(R):
                                a16[r] += np.int16(q[g, s, j, r]) * xv
                        for r in range(R):
                            acc[r] += np.int32(a16[r])
                    b = s // per_block
                    d = xd[t, b]
                    sb = s // per_super
                    if has_offset:  # groups of 32 (only Q6_K's are 16, and it has no offset)
                        o = xs[t, b]
                        for r in range(R):
                            accf[r] += ((sscale[g, sb, r] * np.float32(scale[g, s, r])) * d * np.float32(acc[r])
                                        + (soffset[g, sb, r] * np.float32(offset[g, s, r])) * o)
                    else:
                        for r in range(R):
                            accf[r] += (sscale[g, sb, r] * np.float32(scale[g, s, r])) * d * np.float32(acc[r])
                for r in range(min(R, N - g * R)):
                    out[t, g * R + r] = accf[r]

    def _dequant_c4(q, scale, offset, sscale, soffset, rows, out):  # pragma: no cover - compiled
        # the matrix's rows ``rows`` -> out [len(rows), K] float32
        R = q.shape[3]
        per_super = q.shape[1] // sscale.shape[1]
        for i in prange(rows.shape[0]):
            g, r = divmod(rows[i], R)
            for b in range(q.shape[1]):
                d = sscale[g, b // per_super, r] * np.float32(scale[g, b, r])
                m = soffset[g, b // per_super, r] * np.float32(offset[g, b, r])
                for j in range(16):
                    v = q[g, b, j, r]
                    out[i, b * 32 + j] = d * np.float32(v & 15) + m
                    out[i, b * 32 + 16 + j] = d * np.float32(v >> 4) + m

    def _dequant_c8(q, scale, offset, sscale, soffset, rows, out):  # pragma: no cover - compiled
        _, ng, GS, R = q.shape
        per_super = ng // sscale.shape[1]
        for i in prange(rows.shape[0]):
            g, r = divmod(rows[i], R)
            for s in range(ng):
                d = sscale[g, s // per_super, r] * np.float32(scale[g, s, r])
                m = soffset[g, s // per_super, r] * np.float32(offset[g, s, r])
                for j in range(GS):
                    out[i, s * GS + j] = d * np.float32(q[g, s, j, r]) + m


    def _vnni_ir(builder):  # pragma: no cover - compiled
        """The pieces both VNNI intrinsics build with: the 16-lane int32 vector type, vpdpbusd,
        and a broadcast of one int32 (four int8 activations) to every lane."""
        i32 = ir.IntType(32)
        v16 = ir.VectorType(i32, 16)
        dpbusd = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(v16, [v16, v16, v16]))
        zero16 = ir.Constant(v16, [0] * 16)

        def broadcast(word):
            return builder.shuffle_vector(builder.insert_element(ir.Constant(v16, None), word, ir.Constant(i32, 0)),
                                          ir.Constant(v16, None), zero16)

        return i32, v16, dpbusd, broadcast, zero16

    def _block16_vnni_rows(n_rows):
        """An intrinsic for ``n_rows`` activation rows of one 32-weight block (c4v) and 16 rows
        of weights: the block's 256 bytes ([4][16][4]) loaded and split into nibbles once, then
        each row's eight ``vpdpbusd`` (each multiplies a lane's 4 weight bytes by 4 activations
        and adds the 4 products to the lane's int32, exactly), row u's 32 int8 activations at
        x_addr + u * x_stride, its 16 int32 sums stored at acc_addr + u * acc_stride. A verify
        pass's few rows then cost the weights' bytes and unpacking once, not once a row."""

        @intrinsic
        def block16_rows(typingctx, acc_addr, acc_stride, w_addr, x_addr, x_stride):  # pragma: no cover
            sig = nb_types.void(nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp)

            def codegen(context, builder, signature, args):
                acc_a, acc_s, w_a, x_a, x_s = args
                i32, v16, dpbusd, broadcast, zero16 = _vnni_ir(builder)
                w_base = builder.inttoptr(w_a, v16.as_pointer())
                nibble, four = ir.Constant(v16, [0x0F0F0F0F] * 16), ir.Constant(v16, [4] * 16)
                halves = []
                for k in range(4):
                    w = builder.load(builder.gep(w_base, [ir.Constant(i32, k)]), align=1)
                    halves.append((builder.and_(w, nibble), builder.and_(builder.lshr(w, four), nibble)))
                for u in range(n_rows):
                    off = builder.mul(ir.Constant(acc_s.type, u), x_s)
                    x = builder.load(builder.inttoptr(builder.add(x_a, off), ir.VectorType(i32, 8).as_pointer()), align=1)
                    acc = zero16
                    for k, (low, high) in enumerate(halves):
                        acc = builder.call(dpbusd, [acc, low, broadcast(builder.extract_element(x, ir.Constant(i32, k)))])
                        acc = builder.call(dpbusd, [acc, high, broadcast(builder.extract_element(x, ir.Constant(i32, 4 + k)))])
                    dst = builder.add(acc_a, builder.mul(ir.Constant(acc_s.type, u), acc_s))
                    builder.store(acc, builder.inttoptr(dst, v16.as_pointer()), align=4)
                return context.get_dummy_value()

            return sig, codegen

        return block16_rows

    def _quads4_c6v_rows(n_rows):
        """An intrinsic for ``n_rows`` activation rows of 16 columns and 16 rows of c6v weights
        (``_pack_c6v``): the 192 bytes loaded and rebuilt once into c8v's four vectors of
        unsigned bytes (a nibble, and two high bits moved to bits 4 and 5, in every byte), then
        each row's four ``vpdpbusd``, row u's 16 int8 activations at x_addr + u * x_stride, its
        16 int32 sums added at acc_addr + u * acc_stride."""

        @intrinsic
        def quads4_rows(typingctx, acc_addr, acc_stride, w_addr, x_addr, x_stride):  # pragma: no cover
            sig = nb_types.void(nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp)

            def codegen(context, builder, signature, args):
                acc_a, acc_s, w_a, x_a, x_s = args
                i32, v16, dpbusd, broadcast, _ = _vnni_ir(builder)

                def splat(value):
                    return ir.Constant(v16, [value] * 16)

                w_base = builder.inttoptr(w_a, v16.as_pointer())
                n02, n13, h = (builder.load(builder.gep(w_base, [ir.Constant(i32, j)]), align=1) for j in range(3))
                nib, top = splat(0x0F0F0F0F), splat(0x30303030)
                quads = (builder.or_(builder.and_(n02, nib), builder.shl(builder.and_(h, splat(0x03030303)), splat(4))),
                         builder.or_(builder.and_(n13, nib), builder.shl(builder.and_(h, splat(0x0C0C0C0C)), splat(2))),
                         builder.or_(builder.and_(builder.lshr(n02, splat(4)), nib), builder.and_(h, top)),
                         builder.or_(builder.and_(builder.lshr(n13, splat(4)), nib),
                                     builder.and_(builder.lshr(h, splat(2)), top)))
                for u in range(n_rows):
                    x_u = builder.add(x_a, builder.mul(ir.Constant(x_s.type, u), x_s))
                    x = builder.load(builder.inttoptr(x_u, ir.VectorType(i32, 4).as_pointer()), align=1)
                    acc_p = builder.inttoptr(builder.add(acc_a, builder.mul(ir.Constant(acc_s.type, u), acc_s)),
                                             v16.as_pointer())
                    acc = builder.load(acc_p, align=4)
                    for k in range(4):
                        acc = builder.call(dpbusd, [acc, quads[k], broadcast(builder.extract_element(x, ir.Constant(i32, k)))])
                    builder.store(acc, acc_p, align=4)
                return context.get_dummy_value()

            return sig, codegen

        return quads4_rows

    def _quads4_vnni_rows(n_rows):
        """An intrinsic for ``n_rows`` activation rows of 16 columns and 16 rows of c8v weights:
        their 256 unsigned bytes ([4][16][4]) loaded once, then each row's four ``vpdpbusd``,
        row u's 16 int8 activations at x_addr + u * x_stride, its 16 int32 sums added at
        acc_addr + u * acc_stride."""

        @intrinsic
        def quads4_rows(typingctx, acc_addr, acc_stride, w_addr, x_addr, x_stride):  # pragma: no cover
            sig = nb_types.void(nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp, nb_types.intp)

            def codegen(context, builder, signature, args):
                acc_a, acc_s, w_a, x_a, x_s = args
                i32, v16, dpbusd, broadcast, _ = _vnni_ir(builder)
                w_base = builder.inttoptr(w_a, v16.as_pointer())
                ws = [builder.load(builder.gep(w_base, [ir.Constant(i32, k)]), align=1) for k in range(4)]
                for u in range(n_rows):
                    x_u = builder.add(x_a, builder.mul(ir.Constant(x_s.type, u), x_s))
                    x = builder.load(builder.inttoptr(x_u, ir.VectorType(i32, 4).as_pointer()), align=1)
                    acc_p = builder.inttoptr(builder.add(acc_a, builder.mul(ir.Constant(acc_s.type, u), acc_s)),
                                             v16.as_pointer())
                    acc = builder.load(acc_p, align=4)
                    for k in range(4):
                        acc = builder.call(dpbusd, [acc, ws[k], broadcast(builder.extract_element(x, ir.Constant(i32, k)))])
                    builder.store(acc, acc_p, align=4)
                return context.get_dummy_value()

            return sig, codegen

        return quads4_rows

    _quads4_vnni_1, _quads4_vnni_2, _quads4_vnni_3, _quads4_vnni_4, _quads4_vnni_8 = (_quads4_vnni_rows(n) for n in (1, 2, 3, 4, 8))
    _block16_vnni_1, _block16_vnni_2, _block16_vnni_3, _block16_vnni_4, _block16_vnni_8 = (_block16_vnni_rows(n) for n in (1, 2, 3, 4, 8))
    _quads4_c6v_1, _quads4_c6v_2, _quads4_c6v_3, _quads4_c6v_4, _quads4_c6v_8 = (_quads4_c6v_rows(n) for n in (1, 2, 3, 4, 8))

    @njit(inline="always", **_EXACT)
    def _rows_at_once(left):  # pragma: no cover - compiled
        """How many rows of x the next sweep through a group's weights takes, of ``left``."""
        return 8 if left >= 8 else 4 if left >= 4 else left

    def _mm_c6v(q, scale, sscale, xq, xd, out):  # pragma: no cover - compiled
        # _mm_c8v for Q6_K on the c6v layout: q [G, K/16, R/16, 3, 16, 4] u8. The rebuilt bytes
        # are c8v's with a shift of 32 (Q6_K has no offsets): _mm_c8's integers exactly, and its
        # float steps in its order: the same bits. Rows of x go up to 8 at a time through each
        # group's weights (_quads4_c6v_rows, _rows_at_once): each row's sums and float steps are
        # those of a row alone, in the same order.
        n_groups, ng, n_chunks = q.shape[0], q.shape[1], q.shape[2]
        R = n_chunks * 16
        T, N = out.shape
        K = xq.shape[1]
        per_super = ng // sscale.shape[1]
        q_base, x_base = q.ctypes.data, xq.ctypes.data
        for g in prange(n_groups):
            acc = np.empty(8 * R, np.int32)
            accf = np.empty(8 * R, np.float32)
            acc_base = acc.ctypes.data
            t = 0
            while t < T:
                n = _rows_at_once(T - t)
                accf[:] = 0
                for s in range(ng):
                    acc[:] = 0
                    w0 = q_base + ((g * ng + s) * n_chunks) * 192
                    x0 = x_base + t * K + s * 16
                    if n == 8:
                        for c in range(n_chunks):
                            _quads4_c6v_8(acc_base + c * 64, R * 4, w0 + c * 192, x0, K)
                    elif n == 4:
                        for c in range(n_chunks):
                            _quads4_c6v_4(acc_base + c * 64, R * 4, w0 + c * 192, x0, K)
                    elif n == 3:
                        for c in range(n_chunks):
                            _quads4_c6v_3(acc_base + c * 64, R * 4, w0 + c * 192, x0, K)
                    elif n == 2:
                        for c in range(n_chunks):
                            _quads4_c6v_2(acc_base + c * 64, R * 4, w0 + c * 192, x0, K)
                    else:
                        for c in range(n_chunks):
                            _quads4_c6v_1(acc_base + c * 64, R * 4, w0 + c * 192, x0, K)
                    sb = s // per_super
                    for u in range(n):
                        sx = np.int32(0)
                        for j in range(16):
                            sx += np.int32(xq[t + u, s * 16 + j])
                        corr = np.int32(32) * sx
                        d = xd[t + u, s // 2]
                        for r in range(R):
                            accf[u * R + r] += (sscale[g, sb, r] * np.float32(scale[g, s, r])) * d * np.float32(acc[u * R + r] - corr)
                for u in range(n):
                    for r in range(min(R, N - g * R)):
                        out[t + u, g * R + r] = accf[u * R + r]
                t += n

    def _dequant_c6v(q, scale, sscale, rows, out):  # pragma: no cover - compiled
        ng, n_chunks = q.shape[1], q.shape[2]
        per_super = ng // sscale.shape[1]
        for i in prange(rows.shape[0]):
            g, r = divmod(rows[i], n_chunks * 16)
            c, lane = divmod(r, 16)
            for s in range(ng):
                d = sscale[g, s // per_super, r] * np.float32(scale[g, s, r])
                for j in range(16):
                    k, b = j // 4, j % 4
                    nib = np.int32(q[g, s, c, k % 2, lane, b])
                    low = (nib >> np.int32(4)) if k >= 2 else (nib & np.int32(15))
                    high = (np.int32(q[g, s, c, 2, lane, b]) >> np.int32(2 * k)) & np.int32(3)
                    out[i, s * 16 + j] = d * np.float32((low | (high << np.int32(4))) - np.int32(32))

    def _mm_c8v(q, scale, offset, sscale, soffset, has_offset, shift, xq, xd, xs, out):  # pragma: no cover
        # _mm_c8 on the c8v layout: q [G, K/GS, R/16, GS/4, 16, 4] u8, each value + shift. A
        # group's sum is sum((q + shift) x) - shift * sum(x): _mm_c8's integers exactly, and the
        # float steps after them are _mm_c8's: the same bits. Rows of x go up to 8 at a time
        # through each group's weights (_quads4_vnni_rows, _rows_at_once), each row's steps
        # those of a row alone.
        n_groups, ng, n_chunks, n_quads = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
        GS = n_quads * 4
        R = n_chunks * 16
        T, N = out.shape
        K = xq.shape[1]
        per_block = 32 // GS
        per_super = ng // sscale.shape[1]
        q_base, x_base = q.ctypes.data, xq.ctypes.data
        for g in prange(n_groups):
            acc = np.empty(8 * R, np.int32)
            accf = np.empty(8 * R, np.float32)
            acc_base = acc.ctypes.data
            t = 0
            while t < T:
                n = _rows_at_once(T - t)
                accf[:] = 0
                for s in range(ng):
                    acc[:] = 0
                    for c in range(n_chunks):
                        for k0 in range(0, n_quads, 4):
                            w = q_base + (((g * ng + s) * n_chunks + c) * n_quads + k0) * 64
                            x0 = x_base + t * K + s * GS + k0 * 4
                            if n == 8:
                                _quads4_vnni_8(acc_base + c * 64, R * 4, w, x0, K)
                            elif n == 4:
                                _quads4_vnni_4(acc_base + c * 64, R * 4, w, x0, K)
                            elif n == 3:
                                _quads4_vnni_3(acc_base + c * 64, R * 4, w, x0, K)
                            elif n == 2:
                                _quads4_vnni_2(acc_base + c * 64, R * 4, w, x0, K)
                            else:
                                _quads4_vnni_1(acc_base + c * 64, R * 4, w, x0, K)
                    b = s // per_block
                    sb = s // per_super
                    for u in range(n):
                        corr = np.int32(0)
                        if shift != 0:
                            sx = np.int32(0)
                            for j in range(GS):
                                sx += np.int32(xq[t + u, s * GS + j])
                            corr = np.int32(shift) * sx
                        d = xd[t + u, b]
                        if has_offset:
                            o = xs[t + u, b]
                            for r in range(R):
                                accf[u * R + r] += ((sscale[g, sb, r] * np.float32(scale[g, s, r])) * d
                                                    * np.float32(acc[u * R + r] - corr)
                                                    + (soffset[g, sb, r] * np.float32(offset[g, s, r])) * o)
                        else:
                            for r in range(R):
                                accf[u * R + r] += (sscale[g, sb, r] * np.float32(scale[g, s, r])) * d * np.float32(acc[u * R + r] - corr)
                for u in range(n):
                    for r in range(min(R, N - g * R)):
                        out[t + u, g * R + r] = accf[u * R + r]
                t += n

    def _dequant_c8v(q, scale, offset, sscale, soffset, shift, rows, out):  # pragma: no cover - compiled
        ng, n_chunks, n_quads = q.shape[1], q.shape[2], q.shape[3]
        GS = n_quads * 4
        per_super = ng // sscale.shape[1]
        for i in prange(rows.shape[0]):
            g, r = divmod(rows[i], n_chunks * 16)
            c, lane = divmod(r, 16)
            for s in range(ng):
                d = sscale[g, s // per_super, r] * np.float32(scale[g, s, r])
                m = soffset[g, s // per_super, r] * np.float32(offset[g, s, r])
                for j in range(GS):
                    out[i, s * GS + j] = d * np.float32(np.int32(q[g, s, c, j // 4, lane, j % 4]) - shift) + m

    def _mm_c4v(q, scale, offset, sscale, soffset, xq, xd, xs, out):  # pragma: no cover - compiled
        # _mm_c4 on the c4v layout: q [G, K/32, R/16, 4, 16, 4] u8 (C-contiguous), xq C-contiguous.
        # A group's integer sums are the same integers as _mm_c4's, and the float steps after
        # them the same operations in the same order: the same bits. Rows of x go up to 8 at a
        # time through each group's weights (_block16_vnni_rows, _rows_at_once), each row's
        # steps those of a row alone.
        n_groups, nb, n_chunks = q.shape[0], q.shape[1], q.shape[2]
        R = n_chunks * 16
        T, N = out.shape
        K = xq.shape[1]
        per_super = nb // sscale.shape[1]
        q_base, x_base = q.ctypes.data, xq.ctypes.data
        for g in prange(n_groups):
            acc = np.empty(8 * R, np.int32)
            accf = np.empty(8 * R, np.float32)
            acc_base = acc.ctypes.data
            t = 0
            while t < T:
                n = _rows_at_once(T - t)
                accf[:] = 0
                for b in range(nb):
                    w0 = q_base + ((g * nb + b) * n_chunks) * 256
                    x0 = x_base + t * K + b * 32
                    if n == 8:
                        for c in range(n_chunks):
                            _block16_vnni_8(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                    elif n == 4:
                        for c in range(n_chunks):
                            _block16_vnni_4(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                    elif n == 3:
                        for c in range(n_chunks):
                            _block16_vnni_3(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                    elif n == 2:
                        for c in range(n_chunks):
                            _block16_vnni_2(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                    else:
                        for c in range(n_chunks):
                            _block16_vnni_1(acc_base + c * 64, R * 4, w0 + c * 256, x0, K)
                    sb = b // per_super
                    for u in range(n):
                        d = xd[t + u, b]
                        o = xs[t + u, b]
                        for r in range(R):
                            accf[u * R + r] += ((sscale[g, sb, r] * np.float32(scale[g, b, r])) * d * np.float32(acc[u * R + r])
                                                + (soffset[g, sb, r] * np.float32(offset[g, b, r])) * o)
                for u in range(n):
                    for r in range(min(R, N - g * R)):
                        out[t + u, g * R + r] = accf[u * R + r]
                t += n

    def _dequant_c4v(q, scale, offset, sscale, soffset, rows, out):  # pragma: no cover - compiled
        per_super = q.shape[1] // sscale.shape[1]
        for i in prange(rows.shape[0]):
            g, r = divmod(rows[i], q.shape[2] * 16)
            c, lane = divmod(r, 16)
            for b in range(q.shape[1]):
                d = sscale[g, b // per_super, r] * np.float32(scale[g, b, r])
                m = soffset[g, b // per_super, r] * np.float32(offset[g, b, r])
                for j in range(16):
                    v = q[g, b, c, j // 4, lane, j % 4]
                    out[i, b * 32 + j] = d * np.float32(v & 15) + m
                    out[i, b * 32 + 16 + j] = d * np.float32(v >> 4) + m

    _mm_c4_par, _mm_c4_ser = _compiled(_mm_c4)
    _mm_c4v_par, _mm_c4v_ser = _compiled(_mm_c4v)
    _dequant_c4v = njit(parallel=True, **_EXACT)(_dequant_c4v)
    _mm_c6v_par, _mm_c6v_ser = _compiled(_mm_c6v)
    _dequant_c6v = njit(parallel=True, **_EXACT)(_dequant_c6v)
    _mm_c8v_par, _mm_c8v_ser = _compiled(_mm_c8v)
    _dequant_c8v = njit(parallel=True, **_EXACT)(_dequant_c8v)
    _mm_c8_par, _mm_c8_ser = _compiled(_mm_c8)
    _dequant_c4 = njit(parallel=True, **_EXACT)(_dequant_c4)  # prompt tiles and embedding rows: one build
    _dequant_c8 = njit(parallel=True, **_EXACT)(_dequant_c8)


class QuantizedActivations:
    """x [T, K] rounded to int8 per 32 values, once for every product that reads it (a layer's
    q, k and v): ``xq`` [T, K] int8, ``xd`` [T, K/32] scales, ``xs`` [T, K/32] = xd * sum of xq."""

    def __init__(self, x: np.ndarray, quantize: bool = True) -> None:
        """``quantize`` False: the arrays only, for a compiled operation to fill as it writes x."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        T, K = x.shape
        self.x = x
        self.xq = np.empty((T, K), np.int8)
        self.xd = np.empty((T, K // 32), np.float32)
        self.xs = np.empty((T, K // 32), np.float32)
        if quantize:
            round_rows(x, self.xq, self.xd, self.xs)


def dequantize_rows(w: PackedMatrix, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (int64 [R]) of ``w`` as float32 [R, K]."""
    if w.form == "f32":
        return w.q[rows]
    out = np.empty((rows.shape[0], w.n_cols), np.float32)
    if w.form == "c8v":
        _dequant_c8v(w.q, w.scale, w.offset, w.super_scale, w.super_offset, w.shift, rows, out)
        return out
    if w.form == "c6v":
        _dequant_c6v(w.q, w.scale, w.super_scale, rows, out)
        return out
    kernel = {"c4": _dequant_c4, "c4v": _dequant_c4v, "c8": _dequant_c8}[w.form]
    kernel(w.q, w.scale, w.offset, w.super_scale, w.super_offset, rows, out)
    return out


def matmul(w: PackedMatrix, x: np.ndarray | QuantizedActivations, out: np.ndarray) -> np.ndarray:
    """out = x @ w.T. x: [T, K] float32 (or already quantized) -> out: [T, N] float32."""
    if w.form == "f32":  # F32/F16/BF16 matrices: BLAS on float32
        np.matmul(x.x if isinstance(x, QuantizedActivations) else x, w.q.T, out=out)
        return out
    qx = x if isinstance(x, QuantizedActivations) else QuantizedActivations(x)
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    w.product(qx, dst)
    if dst is not out:
        out[...] = dst
    return out
