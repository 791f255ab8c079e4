"""CUDA kernel library of the cuda backend (cupy RawModule, compiled by NVRTC at first use).

Every function takes cupy device arrays and an optional ``stream`` (a ``cupy.cuda.Stream``; the
current stream when None), launches asynchronously and returns device arrays. Functions that take
``out=`` write there and allocate nothing, so a sequence of them can be captured in a CUDA graph;
every position, length and slot index is read from device memory, so one captured graph replays
every decode step once those small arrays are updated.

Weights are the tensor's exact GGUF bytes as a uint8 device array (no repacking): a row-major
matrix [n_rows, n_cols] (GGUF ne = [n_cols, n_rows]) of n_cols / block_size blocks per row.

KV cache layout (one pair per layer): ``cache_k``, ``cache_v``: f16 [n_slots, n_kv, max_ctx, hd];
a sequence owns one slot; position p of kv-head g of slot s is ``cache[s, g, p, :]``.

Token trees (speculative decoding verifies a tree of drafted tokens in one pass): attention
takes, per query row, the cache position of its tree's row 0 and a bit mask over the tree's rows
(``pack_tree_mask``); ``kv_move`` then moves the accepted path's keys and values down to the
prefix in every layer at once.

Matrix products by rows of x (``gemm`` chooses): ``matvec`` (f32, i16 or dp4a activations, up to
8 rows per launch), the tensor-core ``mm`` (up to 64 rows, exact to f32 rounding), and
``gemm_dequant`` (an f16 copy and cuBLAS) beyond. Which launch configuration, layout cut and
path each call takes is looked up per device in tuning.py, with the measurements behind each
choice. Tensor types come from
ntx.shared.quant_types (gguf's GGMLQuantizationType; block sizes from gguf's own table).

Shapes: T tokens, B sequences (or tokens of a decode batch), H query heads, n_kv kv heads
(H = n_kv * group), hd head dim, D model dim, F feed-forward dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from typing import Any

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as QT

from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.sources import kernel_source
from ntx.shared.quant_types import QUANT_TYPES, QuantType, quant_type, row_nbytes

__all__ = [
    "row_bytes", "matvec", "dequantize_f16", "get_rows", "gemm", "gemm_dequant",
    "rmsnorm", "rope_inplace", "rope_qk_inplace", "rope_inv_freq", "alloc_kv_cache", "kv_append", "rope_kv_append",
    "kv_cache_table", "kv_move", "attention", "attention_gemm", "attention_gemm_fuses", "attention_splits",
    "attention_workspace", "tree_mask_words", "pack_tree_mask", "swiglu",
    "argmax", "apply_repetition_penalty", "topk", "compile_all",
    "MAX_MATVEC_B", "matvec_workspace", "matvec_workspace_bytes", "quantize_x", "MATVEC_VARIANT", "VARIANTS",
    "mm", "mm_supported", "MAX_MM_ROWS", "MM_STAGED_TYPES", "mmq", "mmq_supported", "MMQ_TYPES",
    "mmq_workspace_bytes", "mmq_quantize", "i16_quantize", "gemm_group", "pdl_enabled", "set_programmatic_launch",
    "norm_gemm_group", "rmsnorm_i16", "add", "swiglu_gemm_add",
]

MAX_MATVEC_B = tuning.MAX_MATVEC_B
MAX_MM_ROWS = tuning.MAX_MM_ROWS
# matvec variants: "v1", "v2" = the f32 path through that layout cut ("f32" = "v1"), "dp4a" =
# the int8-activation path, "i16" = activations in two int8 planes (15 bits), "i16s" = the same
# product with x staged in shared memory once per CTA (opt-in, measured by bench_gemm_paths.py
# --sweep-mv), "auto" = per tuning.py
MATVEC_VARIANT = "auto"
VARIANTS = ("auto", "v1", "v2", "dp4a", "i16", "i16s", "f32")
# template argument of each layout cut (quant.cu CUT_V1, CUT_V2)
_CUT_ID = {"v1": 1, "v2": 2}
# elements per piece (EPB / LPB of quant.cu's QTraits<QT, CUT>) where it is not 8: the
# dequantizer runs one thread per piece
_ELEMS_PER_PIECE = {(QT.Q4_K, "v1"): 32, (QT.Q5_K, "v1"): 32, (QT.Q6_K, "v1"): 16}


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols elements in the GGUF layout of qtype."""
    return row_nbytes(qtype, n_cols)


_tunings: dict[int, tuning.KernelTuning] = {}


def _tuning() -> tuning.KernelTuning:
    """The current device's launch table (tuning.for_device, looked up once per device). Called
    several times per eager matvec: the device id comes straight from the runtime (a Device
    object per call cost ~60 µs a layer at 16 rows on the H200)."""
    dev = cp.cuda.runtime.getDevice()
    t = _tunings.get(dev)
    if t is None:
        name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
        t = _tunings[dev] = tuning.for_device(name.decode() if isinstance(name, bytes) else str(name))
    return t


# ------------------------------------------------------------------------------ compilation
_lock = threading.Lock()
_modules: dict[tuple, cp.RawModule] = {}
_OPTIONS = ("-std=c++17",)


def _module(fname: str, names: tuple[str, ...]) -> cp.RawModule:
    key = (cp.cuda.runtime.getDevice(), fname, names)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                # headers inlined: cupy caches compiled modules by this text (sources.py)
                src = kernel_source(fname)
                if names:
                    mod = cp.RawModule(code=src, options=_OPTIONS, name_expressions=list(names))
                else:
                    mod = cp.RawModule(code=src, options=_OPTIONS)
                mod.compile()
                _modules[key] = mod
    return mod


# ------------------------------------------------------------------------------ launching
# Every kernel of ops.cu and quant.cu is launched through _launch. Where the device has
# programmatic dependent launch (compute capability 9.0 and later) it goes through the driver's
# cuLaunchKernelEx with the programmatic-stream-serialization attribute, which cupy's launcher
# does not expose: the kernel may then start while the previous kernel in the stream finishes
# (its CTAs resident, a matvec's first weights in flight), and waits in pdl_wait (common.cuh)
# before it touches what earlier work wrote. Graph capture records the overlap as programmatic
# edges. NTX_PDL=0 turns it off (cupy's launcher, plain stream order) for comparison.
_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


# numpy scalar type -> the C type the kernel's parameter has
_C_SCALARS = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
              np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}
_pdl_by_device: dict[int, Any] = {}  # device -> cuLaunchKernelEx, or None where it is not used
_pdl_wanted: bool | None = None  # set_programmatic_launch; None: NTX_PDL (default on)


def set_programmatic_launch(on: bool | None) -> None:
    """Use programmatic launch where the device has it (True), never (False), or as NTX_PDL says
    (None, the default). For comparisons (tests, benchmarks); graphs captured before keep the
    launches they were captured with."""
    global _pdl_wanted
    _pdl_wanted = on
    _pdl_by_device.clear()


def _pdl_launcher(dev: int):
    """cuLaunchKernelEx where programmatic launch is used on device `dev`, else None."""
    if dev in _pdl_by_device:
        return _pdl_by_device[dev]
    fn = None
    major = cp.cuda.runtime.getDeviceProperties(dev)["major"]
    wanted = _pdl_wanted if _pdl_wanted is not None else os.environ.get("NTX_PDL", "1") != "0"
    if wanted and major >= 9:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError):  # a driver older than CUDA 12.0
            fn = None
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.c_void_p]
    _pdl_by_device[dev] = fn
    return fn


def pdl_enabled() -> bool:
    """Whether kernels on the current device are launched with programmatic dependent launch."""
    return _pdl_launcher(cp.cuda.runtime.getDevice()) is not None


def _c_arg(a):
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    ctype = _C_SCALARS.get(type(a))
    if ctype is None:
        raise TypeError(f"kernel argument of type {type(a).__name__}: pass a cupy array or a sized numpy scalar")
    return ctype(a.item())


# The tensor-core matmuls (mm, mms, mmq) are launched plainly, after the previous kernel has
# ended, unless NTX_PDL_MM=1. Launched early, a matmul's CTAs are placed on whichever SMs the
# kernels before it free first, and its one wave of CTAs (8-64 rows) then balances worse: in one
# run on the H200 (docs/decode-final2-h200.json, docs/decode-pdl-mm-h200.json) SmolLM2 at 32 rows
# took 4.54 ms a pass plain and 5.21 early, the 8B Q4_K_M 9.80 and 10.03 (8 rows: 5.58, 5.64;
# 1 row, where no matmul runs, the same within noise). They still trigger their successor early
# and call pdl_wait (a no-op in a plain launch).
_PDL_MATMUL = os.environ.get("NTX_PDL_MM", "0") == "1"


def _launch(kern, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, programmatic: bool = True) -> None:
    """Launch `kern` (a cupy RawKernel of a compiled module) on the current stream; see above.
    programmatic=False: a plain launch even where programmatic launch is on."""
    launch_ex = _pdl_launcher(cp.cuda.runtime.getDevice()) if programmatic else None
    if launch_ex is None:
        kern(grid, block, args, shared_mem=shared_mem)
        return
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    attr = _LaunchAttribute(id=_PDL_ATTRIBUTE)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, cp.cuda.get_current_stream().ptr,
                           ctypes.pointer(attr), 1)
    c_args = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(c_args))(*[ctypes.addressof(c) for c in c_args])
    status = launch_ex(ctypes.byref(config), kern.kernel.ptr, params, None)
    if status != 0:
        raise cp.cuda.driver.CUDADriverError(status)


def _mv_names(qt: int, cut: str, nr: int, u: int) -> tuple[str, ...]:
    return tuple(f"mv_kernel<{int(qt)},{_CUT_ID[cut]},{b},{nr},{u}>" for b in range(1, MAX_MATVEC_B + 1))


_functions: dict[tuple, Any] = {}  # (device, kind, template arguments) -> compiled kernel


def _function(kind: str, args: tuple, names, index: int):
    """The kernel ``names()[index]`` of quant.cu, looked up once per device: an eager pass makes
    hundreds of matvec calls, and building names and asking the module each time cost ~2 ms a
    pass at 16 rows (8B Q4_K_M on the H200)."""
    key = (cp.cuda.runtime.getDevice(), kind, *args)
    f = _functions.get(key)
    if f is None:
        all_names = names()
        f = _functions[key] = _module("quant.cu", all_names).get_function(all_names[index])
    return f


def _mv_kernel(qt: int, cut: str, b: int, nr: int, u: int):
    return _function("mv", (int(qt), cut, b, nr, u), lambda: _mv_names(qt, cut, nr, u), b - 1)


def _mvq_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    return tuple(f"mvq_kernel<{int(qt)},{b},{nr},{u}>" for b in range(1, MAX_MATVEC_B + 1))


def _mvq_kernel(qt: int, b: int, nr: int, u: int):
    return _function("mvq", (int(qt), b, nr, u), lambda: _mvq_names(qt, nr, u), b - 1)


def _quantize_x_kernel():
    return _module("quant.cu", ()).get_function("quantize_x_kernel")


def _quantize_x2_kernel():
    return _module("quant.cu", ()).get_function("quantize_x2_kernel")


def _quantize_kernel(name: str):
    """An extern "C" kernel of quant.cu (its module without template instantiations)."""
    return _module("quant.cu", ()).get_function(name)


def _mvq2_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    """mvq2_kernel for B = 1..MAX_MATVEC_B, then mvq2g_kernel likewise (one module for both)."""
    return tuple(f"{k}<{int(qt)},{b},{nr},{u}>" for k in ("mvq2_kernel", "mvq2g_kernel")
                 for b in range(1, MAX_MATVEC_B + 1))


def _mvq2_kernel(qt: int, b: int, nr: int, u: int):
    return _function("mvq2", (int(qt), b, nr, u), lambda: _mvq2_names(qt, nr, u), b - 1)


def _mvq2g_kernel(qt: int, b: int, nr: int, u: int):
    return _function("mvq2g", (int(qt), b, nr, u), lambda: _mvq2_names(qt, nr, u), MAX_MATVEC_B + b - 1)


def _mvq2s_names(qt: int, nr: int, u: int) -> tuple[str, ...]:
    return tuple(f"mvq2s_kernel<{int(qt)},{b},{nr},{u}>" for b in range(1, MAX_MATVEC_B + 1))


def _mvq2s_kernel(qt: int, b: int, nr: int, u: int):
    return _function("mvq2s", (int(qt), b, nr, u), lambda: _mvq2s_names(qt, nr, u), b - 1)


def i16s_stage_bytes(B: int, n_cols: int) -> int:
    """Shared memory of mvq2s_kernel's activation stage for x [B, n_cols]: both int8 planes and
    both (d, d * sum) arrays."""
    return 2 * B * n_cols + 2 * B * (n_cols // 32) * 8


_i16s_max_ctas: dict[tuple, int] = {}


def _i16s_grid(kern, qt: int, B: int, nr: int, nw: int, u: int, n_rows: int, stage: int) -> int:
    """CTAs of an i16s launch: as many as the device holds at once with this stage (occupancy of
    the compiled kernel times the SMs), at most one per row group. Raises the kernel's dynamic
    shared memory limit past the default 48 KiB where the stage needs it; a stage over the
    device's opt-in limit (227 KiB on the H200) is an error (use "i16")."""
    from cupy_backends.cuda.api import driver

    dev = cp.cuda.runtime.getDevice()
    key = (dev, int(qt), B, nr, nw, u, stage)
    max_ctas = _i16s_max_ctas.get(key)
    if max_ctas is None:
        rt = cp.cuda.runtime
        optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)
        if stage > optin:
            raise ValueError(f"the i16s matvec stages {stage} bytes of x, over the device's {optin} per CTA; use i16")
        if stage > _DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < stage:
            kern.max_dynamic_shared_size_bytes = stage
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, 32 * nw, stage)
        max_ctas = _i16s_max_ctas[key] = max(1, per_sm) * rt.getDeviceProperties(dev)["multiProcessorCount"]
    return min(-(-n_rows // nr), max_ctas)


def _mm_cut(q: QuantType, n_cols: int) -> tuple[str, int] | None:
    """(cut, quad steps per row) the tensor-core matmul takes for rows of n_cols columns of q:
    its first cut (QuantType.mm_cuts) whose block divides the row into whole quad steps (4
    pieces); None when there is none."""
    for cut, epb, lpb in q.mm_cuts:
        if n_cols % epb == 0 and (n_cols // epb * lpb) % 4 == 0:
            return cut, n_cols // epb * lpb // 4
    return None


def mm_supported(qtype, n_cols: int) -> bool:
    """Whether the tensor-core matmul (``mm``) decodes this type at this row length."""
    return _mm_cut(quant_type(qtype), n_cols) is not None


def _mm_names(qt: int, cut: str) -> tuple[str, ...]:
    return tuple(f"mm_kernel<{int(qt)},{_CUT_ID[cut]},{nt},{tuning.MM_UNROLL}>" for nt in range(1, MAX_MM_ROWS // 8 + 1))


def _mm_kernel(qt: int, cut: str, nt: int):
    return _function("mm", (int(qt), cut, nt), lambda: _mm_names(qt, cut), nt - 1)


# the types whose blocks mms_kernel stages through shared memory (QuantType.mm_staged), cut v2
MM_STAGED_TYPES = frozenset(q.qtype for q in QUANT_TYPES.values() if q.mm_staged)


def _mms_names(qt: int) -> tuple[str, ...]:
    return tuple(f"mms_kernel<{int(qt)},{nt}>" for nt in range(1, MAX_MM_ROWS // 8 + 1))


def _mms_kernel(qt: int, nt: int):
    return _function("mms", (int(qt), nt), lambda: _mms_names(qt), nt - 1)


MM_STAGES = 4  # quant.cu MM_STAGES: block columns in flight per warp of the staged kernels
_DEFAULT_SMEM_LIMIT = 48 << 10  # dynamic shared memory a kernel gets without opting in


def _staged_smem_bytes(q: QuantType, warps: int, nt: int, mt: int = 1) -> int:
    """Dynamic shared memory of mms_kernel / mmq_kernel: each warp's MM_STAGES / MT stages of
    16 MT rows (quant.cu MmStage: a block plus its misalignment, in words, rounded up to 16
    bytes), or the epilogue's reduction (warps x 16 MT rows x 8 NT floats), whichever is larger."""
    mis = 0 if q.block_bytes % 4 == 0 else 2
    srow = -(-(-(-(q.block_bytes + mis) // 4) * 4) // 16) * 16
    return max(warps * MM_STAGES * 16 * srow, warps * 16 * mt * 8 * nt * 4)


def _launch_staged(kern, grid, warps: int, smem: int, args) -> None:
    """Launch a staged kernel with `smem` bytes of dynamic shared memory, opting the kernel in
    beyond the default 48 KiB once (a per-function attribute)."""
    if smem > _DEFAULT_SMEM_LIMIT and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem
    _launch(kern, grid, (32 * warps,), args, shared_mem=smem, programmatic=_PDL_MATMUL)


# the types the int8 tensor-core matmul (mmq_kernel) decodes: the staged K-quants, rows of whole
# 256-column blocks
MMQ_TYPES = MM_STAGED_TYPES


def _mmq_names(qt: int, mt: int) -> tuple[str, ...]:
    return tuple(f"mmq_kernel<{int(qt)},{nt},{mt}>" for nt in range(1, MAX_MM_ROWS // 8 + 1))


def _mmq_kernel(qt: int, nt: int, mt: int = 1):
    return _function("mmq", (int(qt), nt, mt), lambda: _mmq_names(qt, mt), nt - 1)


def _quantize_mmq_kernel():
    return _module("quant.cu", ()).get_function("quantize_mmq_kernel")


def _mm_split_kernel():
    return _module("quant.cu", ()).get_function("mm_split_x_kernel")


def _deq_names(qt: int, cut: str) -> tuple[str, ...]:
    return tuple(f"deq_kernel<{int(qt)},{_CUT_ID[cut]},{o}>" for o in (0, 1))


def _deq_kernel(qt: int, cut: str, out_f32: bool):
    return _function("deq", (int(qt), cut, bool(out_f32)), lambda: _deq_names(qt, cut), int(out_f32))


def _ops_kernel(name: str):
    return _module("ops.cu", ()).get_function(name)


def _attn_names(g: int, hd: int) -> tuple[str, ...]:
    return (f"attn_split_kernel<{g},{hd}>", f"attn_tree_split_kernel<{g},{hd}>")


def _attn_kernel(g: int, hd: int, tree: bool):
    names = _attn_names(g, hd)
    return _module("ops.cu", names).get_function(names[int(tree)])


def compile_all(qtypes=None) -> None:
    """Compile (or load from cupy's disk cache) the modules that the default paths use."""
    t = _tuning()
    for qt in qtypes if qtypes is not None else list(QUANT_TYPES):
        q = quant_type(qt)
        for cut in q.cuts:
            for nr, _, u in t.all_mv_launches():
                _mv_kernel(q.qtype, cut, 1, nr, u)
        if q.dp4a:
            for nr, _, u in t.all_mvq_launches():
                _mvq_kernel(q.qtype, 1, nr, u)
        _deq_kernel(q.qtype, t.deq_cut.get(q.qtype, "v1"), False)
        if q.dp4a:
            for nr, _, u in t.all_mvq_launches():
                _mvq2_kernel(q.qtype, 1, nr, u)
        for cut, _, _ in q.mm_cuts:
            _mm_kernel(q.qtype, cut, 1)
        if q.mm_staged:
            _mms_kernel(q.qtype, 1)
            _mmq_kernel(q.qtype, 1, 1)  # the default launch's; two tiles per warp compile on first use
    _quantize_x_kernel()
    _quantize_x2_kernel()
    _quantize_mmq_kernel()
    _ops_kernel("rmsnorm_kernel")


# ------------------------------------------------------------------------------ helpers
def _stream_ctx(stream):
    return stream if stream is not None else contextlib.nullcontext()


def _ptr_or_null(a):
    return a if a is not None else np.uint64(0)


def _check_f32(name: str, a, shape=None):
    if not isinstance(a, cp.ndarray) or a.dtype != cp.float32:
        raise TypeError(f"{name} must be a cupy float32 array")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {a.shape}, expected {tuple(shape)}")


def _check_i32(name: str, a, n=None):
    if not isinstance(a, cp.ndarray) or a.dtype != cp.int32 or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous cupy int32 array")
    if n is not None and a.size != n:
        raise ValueError(f"{name} has {a.size} entries, expected {n}")


def _out(out, shape, dtype):
    if out is None:
        return cp.empty(shape, dtype=dtype)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {np.dtype(dtype).name} {tuple(shape)}, got {out.dtype} {out.shape}")
    return out


def _check_weights(w_raw, q: QuantType, n_rows: int, n_cols: int) -> int:
    col_mult, align = q.kernel_col_multiple, q.kernel_align_bytes
    if not isinstance(w_raw, cp.ndarray) or w_raw.dtype != cp.uint8 or not w_raw.flags.c_contiguous:
        raise TypeError("w_raw must be a C-contiguous cupy uint8 array of the tensor's GGUF bytes")
    if n_cols % col_mult:
        raise ValueError(f"{q.name}: n_cols={n_cols} must be a multiple of {col_mult}")
    rb = row_nbytes(q.qtype, n_cols)
    if w_raw.size < n_rows * rb:
        raise ValueError(f"w_raw holds {w_raw.size} bytes, {q.name} [{n_rows}, {n_cols}] needs {n_rows * rb}")
    if w_raw.data.ptr % align or rb % align:
        raise ValueError(f"{q.name} weights must start on a {align}-byte boundary (address {w_raw.data.ptr:#x}, row {rb} B)")
    return rb


def _aligned_x(x, n_cols: int):
    if x.ndim == 1:
        x = x.reshape(1, -1)
    _check_f32("x", x)
    if x.shape[1] != n_cols:
        raise ValueError(f"x has {x.shape[1]} columns, expected {n_cols}")
    if x.data.ptr % 16:
        x = x.copy()
    return x


def _rows_and_out(x, out, n_rows: int, n_cols: int, max_rows: int, name: str):
    """A product's x as [B, n_cols] (16-byte aligned, 1 <= B <= max_rows rows, else a clear
    error naming ``name``) and its out: [B, n_rows], or [n_rows] for a 1-D x."""
    one_d = x.ndim == 1
    x = _aligned_x(x, n_cols)
    B = x.shape[0]
    if not 1 <= B <= max_rows:
        raise ValueError(f"{name} takes 1..{max_rows} rows of x, got {B}; use gemm")
    return x, _out(out, (n_rows,) if one_d else (B, n_rows), cp.float32)


# ------------------------------------------------------------------------------ GEMV / GEMM
def _mv_cut(q: QuantType, n_cols: int, variant, B: int) -> str:
    """The layout cut the f32 matvec takes: "v2" when asked for (or by "auto" per the device's
    table) and the type has it for this row length (Q8_0's v2 takes blocks in pairs), else "v1"."""
    v = variant or MATVEC_VARIANT
    if v == "auto":
        t = _tuning()
        v = "v2" if B >= t.v2_auto_min_b and q.qtype in t.v2_auto_types else "v1"
    if v == "v2" and "v2" in q.cuts and not (q.qtype == QT.Q8_0 and n_cols % 64):
        return "v2"
    return "v1"


def _activation_path(qtype, variant) -> str:
    """Which activations matvec multiplies with: "dp4a" (int8), "i16" (two int8 planes) or "f32".
    "auto": dp4a where the type has it and NTX_MATVEC_DP4A=1; else i16 where the type has a dp4a
    product and the device's table says i16_auto; else f32."""
    q = quant_type(qtype)
    v = variant or MATVEC_VARIANT
    if v not in VARIANTS:
        raise ValueError(f"unknown matvec variant {v!r} (one of {', '.join(VARIANTS)})")
    if v in ("dp4a", "i16", "i16s"):
        if not q.dp4a:
            raise ValueError(f"the {v} matvec variant does not exist for {q.name}")
        return v
    if v != "auto" or not q.dp4a:
        return "f32"
    if tuning.dp4a_enabled():
        return "dp4a"
    return "i16" if _tuning().i16_auto else "f32"


def _use_dp4a(qtype, variant) -> bool:
    return _activation_path(qtype, variant) == "dp4a"


def matvec_workspace_bytes(B: int, n_cols: int) -> int:
    """Bytes of the dp4a variant's activation workspace for x [B, n_cols]: int8 x [B, n_cols]
    (rounded up to 256 bytes), then f32 (d, d * sum) pairs [B, n_cols / 32]."""
    return -(-B * n_cols // 256) * 256 + B * (n_cols // 32) * 8


def matvec_workspace(B: int = MAX_MATVEC_B, n_cols: int = 0):
    """A device workspace for matvec(..., xq=) / quantize_x with up to B rows of n_cols columns."""
    return cp.empty(matvec_workspace_bytes(B, n_cols), dtype=cp.uint8)


class _StreamScratch:
    """Per-(device, stream, purpose, size) workspaces kept for reuse: allocated on the first eager
    call of a size, never reallocated (a captured CUDA graph keeps pointing at them); one set per
    stream, so calls on two streams never share one. ``zero``: allocated zeroed (the matmul's
    tile counters, which every launch leaves at zero again)."""

    def __init__(self):
        self.bufs: dict[tuple, cp.ndarray] = {}
        self.lock = threading.Lock()

    def get(self, purpose: str, nbytes: int, zero: bool = False) -> cp.ndarray:
        stream = cp.cuda.get_current_stream()
        key = (cp.cuda.runtime.getDevice(), stream.ptr, purpose, nbytes)
        b = self.bufs.get(key)
        if b is None:
            if stream.is_capturing():
                raise RuntimeError(
                    f"{purpose} needs a {nbytes}-byte workspace that does not exist yet, and the stream is capturing "
                    "a CUDA graph: run the same call once eagerly before capture")
            with self.lock:
                b = self.bufs.get(key)
                if b is None:
                    b = (cp.zeros if zero else cp.empty)(nbytes, dtype=cp.uint8)
                    self.bufs[key] = b
        return b


_stream_scratch = _StreamScratch()


def _xq_views(ws, B: int, n_cols: int):
    need = matvec_workspace_bytes(B, n_cols)
    if not isinstance(ws, cp.ndarray) or ws.dtype != cp.uint8 or not ws.flags.c_contiguous:
        raise TypeError("xq must be a C-contiguous cupy uint8 array (matvec_workspace)")
    if ws.size < need:
        raise ValueError(f"xq holds {ws.size} bytes, x [{B}, {n_cols}] needs {need} (matvec_workspace_bytes)")
    if ws.data.ptr % 256:
        raise ValueError("xq must start on a 256-byte boundary")
    off = -(-B * n_cols // 256) * 256
    return ws[:B * n_cols], ws[off:off + B * (n_cols // 32) * 8]


def _quantize_launch(x, ws, B: int, n_cols: int):
    xq, ds = _xq_views(ws, B, n_cols)
    n4 = B * n_cols // 4
    _launch(_quantize_x_kernel(), ((n4 + 255) // 256,), (256,), (x, xq, ds, np.int32(n4)))
    return xq, ds


def _plane_bytes(B: int, n_cols: int) -> int:
    """One plane's workspace (matvec_workspace_bytes) rounded up to 256 bytes."""
    return -(-matvec_workspace_bytes(B, n_cols) // 256) * 256


def _i16_planes(B: int, n_cols: int):
    """The current stream's i16 activation planes for x [B, n_cols], (xq, ds, xq2, ds2): plane 1
    at 0 of the stream's scratch, plane 2 at _plane_bytes (each as _xq_views). One scratch,
    reused: each quantization's products run before the next one in the stream."""
    ws = _stream_scratch.get("matvec (i16) x", 2 * _plane_bytes(B, n_cols))
    off = _plane_bytes(B, n_cols)
    return (*_xq_views(ws[:off], B, n_cols), *_xq_views(ws[off:], B, n_cols))


def i16_quantize(x, *, stream=None):
    """The i16 matvec's activations for x [B, n_cols] (B <= MAX_MATVEC_B, 16-byte aligned):
    quantize_x2_kernel into the stream's scratch; pass them as matvec(..., planes=) to every
    matrix that multiplies this x."""
    B, n_cols = x.shape
    n4 = B * n_cols // 4
    with _stream_ctx(stream):
        planes = _i16_planes(B, n_cols)
        _launch(_quantize_x2_kernel(), ((n4 + 255) // 256,), (256,), (x, *planes, np.int32(n4)))
        return planes


def quantize_x(x, xq=None, *, stream=None):
    """The dp4a variant's activation quantization, exposed for tests and reuse: x f32 [B, n_cols]
    (n_cols a multiple of 32) -> (q int8 [B, n_cols], ds f32 [B, n_cols / 32, 2]) views into the
    workspace xq (a new one when None): per group g of 32 columns, d = max|x| / 127,
    q = round(x / d) in [-127, 127], ds[b, g] = (d, d * sum of the group's q)."""
    if x.ndim == 1:
        x = x.reshape(1, -1)
    _check_f32("x", x)
    B, n_cols = x.shape
    if n_cols % 32:
        raise ValueError(f"n_cols={n_cols} must be a multiple of 32")
    if x.data.ptr % 16:
        x = x.copy()
    ws = xq if xq is not None else matvec_workspace(B, n_cols)
    with _stream_ctx(stream):
        q, ds = _quantize_launch(x, ws, B, n_cols)
    return q.view(cp.int8).reshape(B, n_cols), ds.view(cp.float32).reshape(B, n_cols // 32, 2)


def _check_mv_config(config) -> None:
    nr, nw, u = config
    if nr not in tuning.MV_ROWS_PER_CTA or not 1 <= nw <= tuning.MV_MAX_WARPS or u not in tuning.MV_UNROLLS:
        raise ValueError(f"matvec config {tuple(config)}: rows per CTA in {tuning.MV_ROWS_PER_CTA}, warps per CTA "
                         f"1..{tuning.MV_MAX_WARPS}, pieces per trip in {tuning.MV_UNROLLS}")


def matvec(w_raw, qtype, n_rows: int, n_cols: int, x, out=None, *, stream=None, config=None, variant=None, xq=None,
           planes=None, accumulate: bool = False):
    """out[b, r] = sum_c W[r, c] * x[b, c].

    w_raw: uint8 GGUF bytes of W [n_rows, n_cols]; x: f32 [B, n_cols] (or [n_cols]), B <= 8;
    out: f32 [B, n_rows] (or [n_rows] for a 1-D x). Weights are read once for all B rows of x.

    variant (default MATVEC_VARIANT = "auto"):
      "v1", "v2" (= "f32" is "v1"): f32 arithmetic throughout (weights dequantized in registers,
        f32 accumulation; relative error ~1e-6). v2 is the lane-contiguous cut, for Q4_K, Q5_K,
        Q6_K, and Q8_0 rows of an even number of blocks.
      "dp4a": x quantized per row to int8 in groups of 32 columns (scale max|x| / 127), integer dot
        products with the weights' integer values, f32 scales per sub-block (llama.cpp's mmvq).
        For Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Exact up to f32 rounding for the
        dequantized int8 x; against the exact x the error is that of x's rounding, ~0.3-0.5%
        relative for Gaussian-like rows (each element is off by at most d/2 = max|x_group| / 254).
      "i16": for the same types, x as two int8 planes, x ~= d * q1 + d2 * q2 (d2 = d / 254: the
        second plane quantizes what the first leaves), each dotted with the weights as in dp4a:
        every element within max|x_group| / 64516 (15 bits), ~2e-5 relative; one read of the
        weights, two dp4a products per piece.
      "i16s": "i16" with x staged in shared memory once per CTA (both planes, 2.5 * B * n_cols
        bytes, at most the device's per-CTA limit) and as many CTAs as fit at once, each looping
        over its row groups; the same bits as "i16" at the same warps and pieces per trip.
      "auto": dp4a with NTX_MATVEC_DP4A=1 (tuning.dp4a_enabled) where it exists; else i16 where it
        exists and the device's table says i16_auto; else v1 or v2 per the table (tuning.py; on
        the H200 v2 at B >= 5 for Q4_K, Q5_K, Q8_0).
    config: optional (rows per CTA in {1, 2, 4, 8}, warps per CTA <= 8, pieces per lane per trip in
      {1, 2, 4}; tuning.MatvecLaunch); default the device's launch table (tuning.py).
    xq: the dp4a variant's workspace (uint8, >= matvec_workspace_bytes(B, n_cols), 256-byte
      aligned; matvec_workspace makes one; the i16 variant does not take one). Without it a
      per-(device, stream, size) workspace is made on first use and reused, so the call stays
      allocation-free after the first one of its size; a CUDA graph capture needs that workspace
      to exist before capture (run the call once eagerly, or pass xq=).
    planes: the i16 variant's quantized x (``i16_quantize`` of this x), to quantize x once for
      several matrices (``gemm_group``); then x is not read.
    accumulate: out += the product instead of out = (the i16 variant only: a layer's residual
      add fused into its last product; ``gemm`` does it for every path).
    """
    q = quant_type(qtype)
    rb = _check_weights(w_raw, q, n_rows, n_cols)
    x, out = _rows_and_out(x, out, n_rows, n_cols, MAX_MATVEC_B, "matvec")
    B = x.shape[0]
    if config is not None:
        _check_mv_config(config)
    grid_rows = n_rows
    path = _activation_path(q.qtype, variant)
    if accumulate and path != "i16":
        raise ValueError(f"matvec accumulates only on the i16 path, not {path}; use gemm(accumulate=True)")
    if path in ("i16", "i16s"):
        nr, nw, u = config or _tuning().mvq(q.qtype, B)
        if path == "i16":
            kern = _mvq2_kernel(q.qtype, B, nr, u)
            grid, smem = (grid_rows + nr - 1) // nr, 0
        else:
            kern = _mvq2s_kernel(q.qtype, B, nr, u)
            smem = i16s_stage_bytes(B, n_cols)
            grid = _i16s_grid(kern, q.qtype, B, nr, nw, u, n_rows, smem)
        with _stream_ctx(stream):
            xq1, ds1, xq2, ds2 = planes if planes is not None else i16_quantize(x)
            args = (w_raw, xq1, ds1, xq2, ds2, out, np.int32(n_rows), np.int32(n_cols), np.int64(rb))
            if path == "i16":
                args += (np.int32(accumulate),)
            _launch(kern, (grid,), (32 * nw,), args, shared_mem=smem)
        return out
    if path == "dp4a":
        nr, nw, u = config or _tuning().mvq(q.qtype, B)
        kern = _mvq_kernel(q.qtype, B, nr, u)
        with _stream_ctx(stream):
            ws = xq if xq is not None else _stream_scratch.get("matvec (dp4a) x", matvec_workspace_bytes(B, n_cols))
            xqv, ds = _quantize_launch(x, ws, B, n_cols)
            _launch(kern, ((grid_rows + nr - 1) // nr,), (32 * nw,),
                 (w_raw, xqv, ds, out, np.int32(n_rows), np.int32(n_cols), np.int64(rb)))
        return out
    nr, nw, u = config or _tuning().mv(q.qtype, B)
    v = variant or MATVEC_VARIANT
    kern = _mv_kernel(q.qtype, _mv_cut(q, n_cols, "v1" if v == "f32" else v, B), B, nr, u)
    grid = ((n_rows + nr - 1) // nr,)
    with _stream_ctx(stream):
        _launch(kern, grid, (32 * nw,), (w_raw, x, out, np.int32(n_rows), np.int32(n_cols), np.int64(rb)))
    return out


def mm(w_raw, qtype, n_rows: int, n_cols: int, x, out=None, *, stream=None, config=None, staged: bool = True):
    """out[b, r] = sum_c W[r, c] * x[b, c] on the tensor cores, for x: f32 [B, n_cols] (or
    [n_cols]), 1 <= B <= MAX_MM_ROWS; out: f32 [B, n_rows] (or [n_rows]). Weights are read once
    for all B rows.

    Exact up to f32 rounding, like the f32 matvec (quant.cu, "tensor-core matmul"): weights enter
    the f16 products as their small integers, x as x_hi + x_lo (two f16 values), scales and mins
    are applied in f32. So which of mm and matvec gemm takes for a batch size moves no result
    beyond the last bits. For the types ``mm_supported`` names (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K, Q5_K, Q6_K, F16). Workspaces (x split into f16 halves, split-K partial sums, tile
    counters) are per (device, stream, size), made on a size's first eager call: a CUDA graph
    capture needs that call to have run once eagerly first. config: (WR, WK, KS) instead of the
    device's choice (tuning.KernelTuning.mm_launch), WR * WK <= 8. staged: whether the K-quants
    (MM_STAGED_TYPES) go through the shared-memory staged kernel (default), else read directly.
    """
    q = quant_type(qtype)
    rb = _check_weights(w_raw, q, n_rows, n_cols)
    mm_cut = _mm_cut(q, n_cols)
    if mm_cut is None:
        raise ValueError(f"the tensor-core matmul does not decode {q.name} rows of {n_cols} columns; use gemm")
    cut, n_steps = mm_cut
    x, out = _rows_and_out(x, out, n_rows, n_cols, MAX_MM_ROWS, "mm")
    B = x.shape[0]
    wr, wk, ks = config or _tuning().mm_launch(B, n_rows, n_steps)
    tiles = -(-n_rows // (16 * wr))
    nt = -(-B // 8)
    staged = staged and q.mm_staged and cut == "v2"
    kern = _mms_kernel(q.qtype, nt) if staged else _mm_kernel(q.qtype, cut, nt)
    with _stream_ctx(stream):
        xs = _stream_scratch.get("mm x halves", B * n_cols * 4)  # [n_cols / 4, B] uint4
        n4 = B * n_cols // 4
        _launch(_mm_split_kernel(), ((n4 + 255) // 256,), (256,), (x, xs, np.int32(n4), np.int32(n_cols // 4), np.int32(B)))
        part = counts = np.uint64(0)
        if ks > 1:
            part = _stream_scratch.get("mm partial sums", ks * B * n_rows * 4)
            counts = _stream_scratch.get("mm tile counters", tiles * 4, zero=True)
        args = (w_raw, xs, out, part, counts, np.int32(n_rows), np.int32(n_cols), np.int64(rb), np.int32(B), np.int32(wr))
        if staged:
            _launch_staged(kern, (tiles, ks), wr * wk, _staged_smem_bytes(q, wr * wk, nt), args)
        else:
            _launch(kern, (tiles, ks), (32 * wr * wk,), args, programmatic=_PDL_MATMUL)
    return out


def mmq_supported(qtype, n_cols: int) -> bool:
    """Whether the int8 tensor-core matmul (``mmq``) decodes this type at this row length."""
    return quant_type(qtype).qtype in MMQ_TYPES and n_cols % 256 == 0


def mmq_workspace_bytes(B: int, n_cols: int) -> int:
    """Bytes of mmq's activation workspace for x [B, n_cols]: the rows padded to Bp = 8 *
    ceil(B / 8); both int8 planes (2 bytes per element) and (d2, sum) per group of 32 (8 bytes)."""
    bp = 8 * -(-B // 8)
    return bp * n_cols * 2 + bp * (n_cols // 32) * 8


def mmq_quantize(x, *, stream=None):
    """mmq's activations for x [B, n_cols] (B <= MAX_MM_ROWS, 16-byte aligned): (xq, xd) of
    quantize_mmq_kernel in the stream's scratch; pass them as mmq(..., planes=) to every matrix
    that multiplies this x."""
    B, n_cols = x.shape
    bp = 8 * -(-B // 8)
    with _stream_ctx(stream):
        ws = _stream_scratch.get("mmq x planes", mmq_workspace_bytes(B, n_cols))
        xq, xd = ws[:bp * n_cols * 2], ws[bp * n_cols * 2:]
        n4 = bp * n_cols // 4
        _launch(_quantize_mmq_kernel(), ((n4 + 255) // 256,), (256,), (x, xq, xd, np.int32(n_cols), np.int32(B), np.int32(bp)))
    return xq, xd


def mmq(w_raw, qtype, n_rows: int, n_cols: int, x, out=None, *, stream=None, config=None, planes=None):
    """out[b, r] = sum_c W[r, c] * x[b, c] on the int8 tensor cores, for x: f32 [B, n_cols] (or
    [n_cols]), 1 <= B <= MAX_MM_ROWS; out: f32 [B, n_rows] (or [n_rows]). Weights are read once
    for all B rows.

    x enters as the i16 matvec's two int8 planes (quant.cu quant2_group: every element within
    max|x_group| / 64516, ~2e-5 relative), the weights as their integers, every integer sum
    exact, scales applied in f32: the i16 matvec's activations at tensor-core speed, so the two
    paths gemm takes below and above mmq's rows see the same x. For MMQ_TYPES (Q4_K, Q5_K,
    Q6_K) with n_cols a multiple of 256. Workspaces (quantized x, split-K partial sums, tile
    counters) are per (device, stream, size), made on a size's first eager call: a CUDA graph
    capture needs that call to have run once eagerly first. config: (WR, WK, KS, MT) instead of
    the device's choice (tuning.KernelTuning.mmq_launch): WR * WK <= 8 warps, MT in (1, 2) tiles
    of 16 rows per warp (each x fragment serves MT tiles). planes: ``mmq_quantize`` of
    this x, to quantize x once for several matrices (``gemm_group``); then x is not read.
    """
    q = quant_type(qtype)
    rb = _check_weights(w_raw, q, n_rows, n_cols)
    if not mmq_supported(q.qtype, n_cols):
        raise ValueError(f"the int8 tensor-core matmul does not decode {q.name} rows of {n_cols} columns; use gemm")
    x, out = _rows_and_out(x, out, n_rows, n_cols, MAX_MM_ROWS, "mmq")
    B = x.shape[0]
    wr, wk, ks, mt = config or _tuning().mmq_launch(B, n_rows, n_cols // 256 * 8)
    tiles = -(-n_rows // (16 * mt * wr))
    nt = -(-B // 8)
    with _stream_ctx(stream):
        xq, xd = planes if planes is not None else mmq_quantize(x)
        part = counts = np.uint64(0)
        if ks > 1:
            part = _stream_scratch.get("mm partial sums", ks * B * n_rows * 4)
            counts = _stream_scratch.get("mm tile counters", tiles * 4, zero=True)
        _launch_staged(_mmq_kernel(q.qtype, nt, mt), (tiles, ks), wr * wk, _staged_smem_bytes(q, wr * wk, nt, mt), (
            w_raw, xq, xd, out, part, counts, np.int32(n_rows), np.int32(n_cols), np.int64(rb), np.int32(B),
            np.int32(wr)))
    return out


def _deq_launch(w_raw, q: QuantType, n_src_rows: int, n_cols: int, ids, out, n_out_rows: int, out_f32: bool, stream):
    rb = _check_weights(w_raw, q, n_src_rows, n_cols)
    cut = _tuning().deq_cut.get(q.qtype, "v1")
    total = n_out_rows * n_cols // _ELEMS_PER_PIECE.get((q.qtype, cut), 8)
    if total == 0:
        return out
    blocks = min((total + 255) // 256, 1 << 20)
    with _stream_ctx(stream):
        _launch(_deq_kernel(q.qtype, cut, out_f32), (blocks,), (256,), (
            w_raw, _ptr_or_null(ids), out, np.int32(n_out_rows), np.int32(n_cols), np.int64(rb), np.int32(n_src_rows)))
    return out


def dequantize_f16(w_raw, qtype, n_rows: int, n_cols: int, out=None, *, stream=None):
    """W [n_rows, n_cols] as f16 (dequantized in f32, rounded once to f16)."""
    out = _out(out, (n_rows, n_cols), cp.float16)
    return _deq_launch(w_raw, quant_type(qtype), n_rows, n_cols, None, out, n_rows, False, stream)


def get_rows(table_raw, qtype, n_rows: int, n_cols: int, ids, out=None, *, stream=None):
    """Embedding lookup: out[t, :] = table[ids[t], :] in f32. table_raw: GGUF bytes of
    [n_rows, n_cols]; ids: int32 [T] on the device; out: f32 [T, n_cols]. An id outside
    [0, n_rows) gives a row of NaN."""
    _check_i32("ids", ids)
    T = ids.size
    out = _out(out, (T, n_cols), cp.float32)
    return _deq_launch(table_raw, quant_type(qtype), n_rows, n_cols, ids, out, T, True, stream)


class _Scratch:
    """Grow-only device buffers reused across calls (one set per device)."""

    def __init__(self):
        self.bufs: dict[tuple[int, str], cp.ndarray] = {}

    def get(self, name: str, n: int, dtype) -> cp.ndarray:
        key = (cp.cuda.runtime.getDevice(), name)
        b = self.bufs.get(key)
        if b is None or b.size < n or b.dtype != dtype:
            b = cp.empty(max(n, 1), dtype=dtype)
            self.bufs[key] = b
        return b[:n]


_scratch = _Scratch()


def gemm(w_raw, qtype, n_rows: int, n_cols: int, x, out=None, *, stream=None, accumulate: bool = False):
    """out [T, n_rows] f32 = x [T, n_cols] f32 @ W.T (accumulate: out += x @ W.T, the same f32
    addition as a separate add: in the i16 matvec's epilogue, else through a scratch product and
    ``add``).

    T <= MAX_MM_ROWS, one capturable launch sequence (no cuBLAS, which cupy cannot capture):
      int8 activations (the default where the type has a dp4a matvec): matvec in chunks of 8
        rows, so every row gets the same products whatever the batch size;
      otherwise, for the K-quants (MMQ_TYPES, with the device's mmq_auto): the int8 tensor-core
        matmul ``mmq`` from the device's mmq_from_rows(type) rows on (the i16 activations, ~2e-5),
        else the i16 matvec in chunks of 8 rows;
      the other types: the tensor-core matmul ``mm`` from the device's mm_from_rows(type) rows
        on (types it decodes, f32-exact), else matvec in chunks of 8 rows (its "auto" variant:
        i16 where the type has it, within ~2e-5, else f32).
    More rows: ``gemm_dequant`` (an f16 copy of W and cuBLAS).
    """
    q = quant_type(qtype)
    qt = q.qtype
    x = _aligned_x(x, n_cols)
    T = x.shape[0]
    path = _gemm_path(q, n_cols, T)
    if accumulate:
        _check_f32("out", out, (T, n_rows))
        if path == "i16":
            return matvec(w_raw, qt, n_rows, n_cols, x, out, stream=stream, accumulate=True)
        with _stream_ctx(stream):
            tmp = _stream_scratch.get("gemm accumulate", T * n_rows * 4).view(cp.float32).reshape(T, n_rows)
            gemm(w_raw, qt, n_rows, n_cols, x, tmp, stream=stream)
            return add(out, tmp, out=out, stream=stream)
    if path == "dequant":
        return gemm_dequant(w_raw, qt, n_rows, n_cols, x, out, stream=stream)
    if path == "mmq":
        return mmq(w_raw, qt, n_rows, n_cols, x, out, stream=stream)
    if path == "mm":
        return mm(w_raw, qt, n_rows, n_cols, x, out, stream=stream)
    if T <= MAX_MATVEC_B:
        return matvec(w_raw, qt, n_rows, n_cols, x, out, stream=stream)
    out = _out(out, (T, n_rows), cp.float32)
    for i in range(0, T, MAX_MATVEC_B):
        j = min(i + MAX_MATVEC_B, T)
        matvec(w_raw, qt, n_rows, n_cols, x[i:j], out[i:j], stream=stream)
    return out


def _gemm_path(q: QuantType, n_cols: int, T: int) -> str:
    """Which path gemm takes for T rows of x against q rows of n_cols: "dequant" (beyond
    MAX_MM_ROWS), "mmq", "mm", "i16" (one i16 matvec launch), or "matvec" (matvec in chunks of
    MAX_MATVEC_B rows, its "auto" variant)."""
    qt = q.qtype
    if T > MAX_MM_ROWS:
        return "dequant"
    if not _use_dp4a(qt, None):
        if _tuning().mmq_auto and mmq_supported(qt, n_cols):
            if T >= _tuning().mmq_from_rows(qt):
                return "mmq"
        elif T >= _tuning().mm_from_rows(qt) and _mm_cut(q, n_cols) is not None:
            return "mm"
    if T <= MAX_MATVEC_B and _activation_path(qt, None) == "i16":
        return "i16"
    return "matvec"


def gemm_group(x, parts, *, stream=None, i16_planes=None):
    """The products of one x [T, K] with several matrices (a layer's q, k and v; its gate and
    up): each as ``gemm`` computes it, with x quantized once for all the products that take the
    same quantized x (mmq's planes, or the i16 matvec's) instead of once per matrix, and the i16
    products of one type in one launch (mvq2g_kernel, up to three matrices). parts:
    (w_raw, qtype, n_rows, n_cols, out) per matrix, n_cols = K for all; returns the outs.
    i16_planes: x's i16 planes, made already (``rmsnorm_i16``)."""
    x = _aligned_x(x, parts[0][3])
    T = x.shape[0]
    shared: dict[str, Any] = {} if i16_planes is None else {"i16": i16_planes}
    outs: list[Any] = [None] * len(parts)
    i16_by_type: dict[int, list[int]] = {}
    for i, (w_raw, qtype, n_rows, n_cols, out) in enumerate(parts):
        q = quant_type(qtype)
        path = _gemm_path(q, n_cols, T)
        if path == "mmq":
            if "mmq" not in shared:
                shared["mmq"] = mmq_quantize(x, stream=stream)
            outs[i] = mmq(w_raw, q.qtype, n_rows, n_cols, x, out, stream=stream, planes=shared["mmq"])
        elif path == "i16":
            i16_by_type.setdefault(int(q.qtype), []).append(i)
        else:
            outs[i] = gemm(w_raw, q.qtype, n_rows, n_cols, x, out, stream=stream)
    for members in i16_by_type.values():
        if "i16" not in shared:
            shared["i16"] = i16_quantize(x, stream=stream)
        for c in range(0, len(members), 3):
            chunk = members[c:c + 3]
            if len(chunk) == 1:
                w_raw, qtype, n_rows, n_cols, out = parts[chunk[0]]
                outs[chunk[0]] = matvec(w_raw, qtype, n_rows, n_cols, x, out, stream=stream, variant="i16",
                                        planes=shared["i16"])
            else:
                got = _matvec_i16_segments(x, [parts[i] for i in chunk], shared["i16"], stream)
                for i, o in zip(chunk, got):
                    outs[i] = o
    return outs


def _matvec_i16_segments(x, parts, planes, stream):
    """The i16 products of x with two or three matrices of one type in one mvq2g_kernel launch,
    each matrix's rows as matvec's i16 variant computes them (the same launch shape)."""
    B = x.shape[0]
    q = quant_type(parts[0][1])
    nr, nw, u = _tuning().mvq(q.qtype, B)
    ws, outs, rows, rbs, ends = [], [], [], [], []
    for w_raw, _, n_rows, n_cols, out in parts:
        rbs.append(_check_weights(w_raw, q, n_rows, n_cols))
        _, out = _rows_and_out(x, out, n_rows, n_cols, MAX_MATVEC_B, "matvec")
        ws.append(w_raw)
        outs.append(out)
        rows.append(n_rows)
        ends.append((ends[-1] if ends else 0) + -(-n_rows // nr))
    if len(ws) == 2:  # an unused third segment: no CTA reaches it
        ws.append(ws[0])
        outs.append(outs[0])
        rows.append(0)
        rbs.append(0)
        ends.append(ends[-1])
    xq1, ds1, xq2, ds2 = planes
    args = (*ws, *outs, *(np.int32(r) for r in rows), np.int32(ends[0]), np.int32(ends[1]),
            *(np.int64(rb) for rb in rbs), xq1, ds1, xq2, ds2, np.int32(parts[0][3]))
    with _stream_ctx(stream):
        _launch(_mvq2g_kernel(q.qtype, B, nr, u), (ends[2],), (32 * nw,), args)
    return outs[:len(parts)]


def norm_gemm_group(x, w, eps: float, h, parts, *, residual=None, stream=None):
    """h = rmsnorm(x, w) (with residual: residual += x first and h its norm, as ``rmsnorm``),
    then ``gemm_group(h, parts)``: where the group takes the i16 matvec, the norm's kernel also
    writes h's i16 planes (rmsnorm_q2_kernel), one launch fewer than a norm and a quantization."""
    if _i16_norm_ok(x, w, h, residual, parts):
        planes = rmsnorm_i16(x, w, eps, residual=residual, out=h, stream=stream)
        return gemm_group(h, parts, stream=stream, i16_planes=planes)
    rmsnorm(x, w, eps, residual=residual, out=h, stream=stream)
    return gemm_group(h, parts, stream=stream)


def swiglu_gemm_add(gate, up, act, w_raw, qtype, n_rows: int, n_cols: int, out, *, stream=None):
    """act = silu(gate) * up [T, F], then out += act @ W.T (``gemm(accumulate=True)``): where that
    takes the i16 matvec, the swiglu kernel also writes act's planes (swiglu_q2_kernel), one
    launch fewer than a swiglu and a quantization, with the same bits."""
    _check_f32("gate", gate)
    _check_f32("up", up, gate.shape)
    act = _out(act, gate.shape, cp.float32)
    T, F = gate.shape
    q = quant_type(qtype)
    fused = (F % 32 == 0 and T <= MAX_MATVEC_B and _gemm_path(q, n_cols, T) == "i16"
             and all(a.data.ptr % 16 == 0 for a in (gate, up, act)))
    if not fused:
        swiglu(gate, up, out=act, stream=stream)
        return gemm(w_raw, q.qtype, n_rows, n_cols, act, out, stream=stream, accumulate=True)
    _check_f32("out", out, (T, n_rows))
    n4 = T * F // 4
    with _stream_ctx(stream):
        planes = _i16_planes(T, F)
        _launch(_quantize_kernel("swiglu_q2_kernel"), ((n4 + 255) // 256,), (256,),
                (gate, up, act, *planes, np.int32(n4)))
        return matvec(w_raw, q.qtype, n_rows, n_cols, act, out, stream=stream, variant="i16", planes=planes,
                      accumulate=True)


def _i16_norm_ok(x, w, h, residual, parts) -> bool:
    T, D = h.shape
    if D % 32 or T > MAX_MATVEC_B or not any(_gemm_path(quant_type(p[1]), p[3], T) == "i16" for p in parts):
        return False
    arrays = [a for a in (x, w, h, residual) if a is not None]
    return all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays)


def gemm_dequant(w_raw, qtype, n_rows: int, n_cols: int, x, out=None, *, stream=None):
    """out [T, n_rows] f32 = x [T, n_cols] f32 @ W.T through an f16 copy of W: W dequantized to
    an f16 scratch buffer that is reused across calls, x rounded to f16, cuBLAS GEMM with f32
    accumulation and f32 output (relative error ~1e-3 from the two f16 roundings). The scratch
    is shared per device: calls on different streams must not overlap."""
    qt = quant_type(qtype).qtype
    x = _aligned_x(x, n_cols)
    T = x.shape[0]
    out = _out(out, (T, n_rows), cp.float32)
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    with _stream_ctx(stream):
        w16 = _scratch.get("gemm_w16", n_rows * n_cols, cp.float16).reshape(n_rows, n_cols)
        dequantize_f16(w_raw, qt, n_rows, n_cols, out=w16)
        x16 = _scratch.get("gemm_x16", T * n_cols, cp.float16).reshape(T, n_cols)
        cp.copyto(x16, x, casting="same_kind")
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        one = np.array(1.0, dtype=np.float32)
        zero = np.array(0.0, dtype=np.float32)
        try:
            # column-major view: out^T [n_rows, T] = W16^T(op T of [n_cols, n_rows]) @ x16^T [n_cols, T]
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n_rows, T, n_cols,
                          one.ctypes.data, w16.data.ptr, runtime.CUDA_R_16F, n_cols,
                          x16.data.ptr, runtime.CUDA_R_16F, n_cols,
                          zero.ctypes.data, out.data.ptr, runtime.CUDA_R_32F, n_rows,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)
    return out


# ------------------------------------------------------------------------------ layer ops
def rmsnorm(x, w, eps: float, *, residual=None, out=None, stream=None):
    """out = x / sqrt(mean(x^2) + eps) * w, per row. x: f32 [T, D] (or [D]); w: f32 [D].

    With residual (f32, x's shape): residual += x in place first and the norm is taken of the
    updated residual (a decoder layer's fused "h = h + delta; y = norm(h) * w")."""
    _check_f32("x", x)
    _check_f32("w", w)
    D = x.shape[-1]
    if w.size != D:
        raise ValueError(f"w has {w.size} entries, x rows have {D}")
    if residual is not None:
        _check_f32("residual", residual, x.shape)
    out = _out(out, x.shape, cp.float32)
    T = x.size // D
    if T == 0:
        return out
    block = _tuning().rmsnorm_block(D)
    with _stream_ctx(stream):
        _launch(_ops_kernel("rmsnorm_kernel"), (T,), (block,), (x, w, out, _ptr_or_null(residual), np.int32(D), np.float32(eps)))
    return out


def rmsnorm_i16(x, w, eps: float, *, residual=None, out=None, stream=None):
    """``rmsnorm`` that also quantizes its output for the i16 matvec in the same launch
    (rmsnorm_q2_kernel): returns the planes (as ``i16_quantize`` of out would, the same bits),
    in the stream's scratch. x [T, D] with T <= MAX_MATVEC_B, D a multiple of 32, every array
    16-byte aligned."""
    _check_f32("x", x)
    _check_f32("w", w)
    T, D = x.shape
    if w.size != D or D % 32 or T > MAX_MATVEC_B:
        raise ValueError(f"rmsnorm_i16 takes x [T <= {MAX_MATVEC_B}, D % 32 == 0] and w [D]; got {x.shape}, {w.shape}")
    if residual is not None:
        _check_f32("residual", residual, x.shape)
    out = _out(out, x.shape, cp.float32)
    block = _tuning().rmsnorm_block(D)
    with _stream_ctx(stream):
        planes = _i16_planes(T, D)
        _launch(_quantize_kernel("rmsnorm_q2_kernel"), (T,), (block,),
                (x, w, out, _ptr_or_null(residual), *planes, np.int32(D), np.float32(eps)))
    return planes


def _elementwise2(kernel: str, names: tuple[str, str], a, b, out, stream):
    """out = kernel(a, b), elementwise over f32 arrays of one shape (ops.cu's grid-stride form)."""
    _check_f32(names[0], a)
    _check_f32(names[1], b, a.shape)
    out = _out(out, a.shape, cp.float32)
    n = a.size
    if n:
        with _stream_ctx(stream):
            _launch(_ops_kernel(kernel), (min((n + 255) // 256, 1 << 16),), (256,), (a, b, out, np.int64(n)))
    return out


def add(x, y, out=None, *, stream=None):
    """out = x + y, elementwise (f32, one shape; out may be x or y)."""
    return _elementwise2("add_kernel", ("x", "y"), x, y, out, stream)


_ROPE_THREADS, _ROPE_PER_THREAD = 256, 4  # ops.cu ROPE_THREADS, ROPE_PER_THREAD


class _RopeFreqs:
    """Per-(device, rope_dim, base, freq_factors) device copies of the pairs' angular speeds
    (``rope_inv_freq``), made on the first eager call and kept: a captured CUDA graph keeps
    pointing at them, and the capture itself must allocate nothing. A cached entry holds the
    freq_factors array it was made from, so its address names that array for the cache's life
    (its values are read once: change them in place and the cache does not see it)."""

    def __init__(self):
        self.arrays: dict[tuple, tuple[Any, Any]] = {}
        self.lock = threading.Lock()

    def get(self, rope_dim: int, base: float, freq_factors):
        ff_key = None if freq_factors is None else (freq_factors.data.ptr, freq_factors.size)
        key = (cp.cuda.runtime.getDevice(), int(rope_dim), float(base), ff_key)
        hit = self.arrays.get(key)
        if hit is not None:
            return hit[0]
        if cp.cuda.get_current_stream().is_capturing():
            raise RuntimeError("rope's frequency table for this (rope_dim, base, freq_factors) does not exist yet, and the "
                               "stream is capturing a CUDA graph: run the same call once eagerly before capture")
        with self.lock:
            hit = self.arrays.get(key)
            if hit is None:
                ff = None if freq_factors is None else cp.asnumpy(freq_factors)
                inv = cp.asarray(rope_inv_freq(rope_dim, base, ff))
                cp.cuda.get_current_stream().synchronize()  # the copy is done before any stream reads it
                hit = self.arrays[key] = (inv, freq_factors)
        return hit[0]


_rope_freqs = _RopeFreqs()


def rope_inv_freq(rope_dim: int, base: float, freq_factors=None) -> np.ndarray:
    """The angular speed of each rotated pair, f64 [rope_dim/2] on the host:
    base^(-2i/rope_dim) / freq_factors[i] (numpy freq_factors f32 [rope_dim/2] or None), as the
    CPU reference (cpu_backend.rope_inv_freq) makes it."""
    inv = float(base) ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float32).astype(np.float64)
    return inv


def _rope_check(name: str, x, positions, rope_dim: int):
    _check_f32(name, x)
    if x.ndim != 3:
        raise ValueError(f"{name} must be [T, H, hd]")
    if x.data.ptr % 8:
        raise ValueError(f"{name} must start on an 8-byte boundary (pairs are read as float2)")
    T, _, hd = x.shape
    _check_i32("positions", positions, T)
    if rope_dim % 2 or not 0 < rope_dim <= hd:
        raise ValueError(f"rope_dim={rope_dim} must be even and in (0, hd={hd}]")


def rope_qk_inplace(q, k, positions, rope_dim: int, base: float, freq_factors=None, *, stream=None):
    """Rotary embedding of q and k in place in one launch, llama.cpp NORMAL mode (the GGUF llama
    layout): rotate adjacent pairs (x[2i], x[2i+1]), i < rope_dim/2, by
    theta = pos * base^(-2i/rope_dim) / freq_factors[i], angle and sine/cosine in f64.
    q: f32 [T, Hq, hd]; k: f32 [T, Hk, hd] (same T and hd) or None; positions: int32 [T] on the
    device; freq_factors: f32 [rope_dim/2] on the device or None. Dimensions from rope_dim on are
    left untouched. The pairs' speeds are made once per (rope_dim, base, freq_factors) on the
    host in f64 (``rope_inv_freq``) and kept on the device: the first call of each must be eager
    (not under graph capture)."""
    _rope_check("q", q, positions, rope_dim)
    T, Hq, hd = q.shape
    Hk = 0
    if k is not None:
        _rope_check("k", k, positions, rope_dim)
        if k.shape[0] != T or k.shape[2] != hd:
            raise ValueError(f"k {k.shape} and q {q.shape} differ in T or hd")
        Hk = k.shape[1]
    if freq_factors is not None:
        _check_f32("freq_factors", freq_factors, (rope_dim // 2,))
    half = rope_dim // 2
    n_pairs = (Hq + Hk) * half
    if T == 0 or n_pairs == 0:
        return q, k
    with _stream_ctx(stream):
        inv = _rope_freqs.get(rope_dim, base, freq_factors)
        per_cta = _ROPE_THREADS * _ROPE_PER_THREAD
        _launch(_ops_kernel("rope_kernel"), (T, -(-n_pairs // per_cta)), (_ROPE_THREADS,), (
            q, _ptr_or_null(k), positions, inv, np.int32(Hq), np.int32(Hk), np.int32(hd), np.int32(rope_dim)),
            shared_mem=half * 8)
    return q, k


def rope_inplace(x, positions, rope_dim: int, base: float, freq_factors=None, *, stream=None):
    """Rotary embedding of one tensor in place (``rope_qk_inplace`` with k = None).
    x: f32 [T, H, hd]; positions: int32 [T] on the device; freq_factors: f32 [rope_dim/2] or None."""
    rope_qk_inplace(x, None, positions, rope_dim, base, freq_factors, stream=stream)
    return x


def alloc_kv_cache(n_slots: int, n_kv: int, max_ctx: int, hd: int):
    """(cache_k, cache_v): zeroed f16 [n_slots, n_kv, max_ctx, hd] for one layer."""
    shape = (n_slots, n_kv, max_ctx, hd)
    return cp.zeros(shape, dtype=cp.float16), cp.zeros(shape, dtype=cp.float16)


def _check_cache(cache_k, cache_v):
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        if not isinstance(c, cp.ndarray) or c.dtype != cp.float16 or c.ndim != 4 or not c.flags.c_contiguous:
            raise TypeError(f"{name} must be a C-contiguous f16 [n_slots, n_kv, max_ctx, hd] cupy array")
    if cache_k.shape != cache_v.shape:
        raise ValueError("cache_k and cache_v differ in shape")
    return cache_k.shape


def kv_append(k, v, cache_k, cache_v, slots, positions, *, stream=None):
    """cache_k[slots[t], :, positions[t], :] = k[t] (f16), likewise v. k, v: f32 [T, n_kv, hd];
    slots, positions: int32 [T] on the device (decode: one entry per sequence; prefill: one slot
    repeated, consecutive positions). Tokens with an out-of-range slot or position are skipped."""
    n_slots, n_kv, max_ctx, hd = _check_cache(cache_k, cache_v)
    _check_f32("k", k)
    T = k.shape[0]
    _check_f32("k", k, (T, n_kv, hd))
    _check_f32("v", v, (T, n_kv, hd))
    _check_i32("slots", slots, T)
    _check_i32("positions", positions, T)
    total = T * n_kv * hd
    if total == 0:
        return
    with _stream_ctx(stream):
        _launch(_ops_kernel("kv_append_kernel"), (min((total + 255) // 256, 1 << 16),), (256,), (
            k, v, cache_k, cache_v, slots, positions, np.int32(T), np.int32(n_kv), np.int32(hd),
            np.int32(max_ctx), np.int32(n_slots)))


def rope_kv_append(q, k, v, cache_k, cache_v, positions, slots, cache_positions, rope_dim: int, base: float,
                   freq_factors=None, *, stream=None):
    """``rope_qk_inplace(q, k, positions, ...)`` then ``kv_append(k, v, cache_k, cache_v, slots,
    cache_positions)`` in one launch, with the same results bit for bit: a decoder layer's
    rotation and cache store. q: f32 [T, Hq, hd]; k, v: f32 [T, n_kv, hd]; positions (RoPE),
    slots, cache_positions: int32 [T] on the device; caches as ``kv_append`` takes them."""
    n_slots, n_kv, max_ctx, hd = _check_cache(cache_k, cache_v)
    _rope_check("q", q, positions, rope_dim)
    T, Hq, _ = q.shape
    _rope_check("k", k, positions, rope_dim)
    _check_f32("k", k, (T, n_kv, hd))
    _check_f32("v", v, (T, n_kv, hd))
    if q.shape[2] != hd:
        raise ValueError(f"q {q.shape} and the cache's head dim {hd} differ")
    if v.data.ptr % 8:
        raise ValueError("v must start on an 8-byte boundary (pairs are read as float2)")
    _check_i32("slots", slots, T)
    _check_i32("cache_positions", cache_positions, T)
    if freq_factors is not None:
        _check_f32("freq_factors", freq_factors, (rope_dim // 2,))
    n_units = Hq * (rope_dim // 2) + n_kv * (hd // 2)
    if T == 0:
        return
    with _stream_ctx(stream):
        inv = _rope_freqs.get(rope_dim, base, freq_factors)
        per_cta = _ROPE_THREADS * _ROPE_PER_THREAD
        _launch(_ops_kernel("rope_kv_kernel"), (T, -(-n_units // per_cta)), (_ROPE_THREADS,), (
            q, k, v, cache_k, cache_v, positions, slots, cache_positions, inv, np.int32(Hq), np.int32(n_kv),
            np.int32(hd), np.int32(rope_dim), np.int32(max_ctx), np.int32(n_slots)), shared_mem=(rope_dim // 2) * 8)


def kv_cache_table(caches):
    """The device addresses of every layer's (cache_k, cache_v), in that order: uint64
    [2 * n_layers], for kv_move. Make it once per set of caches (they never move)."""
    shape = _check_cache(*caches[0])
    for ck, cv in caches:
        if _check_cache(ck, cv) != shape:
            raise ValueError("every layer's KV cache must have the same shape")
    return cp.asarray(np.array([c.data.ptr for pair in caches for c in pair], dtype=np.uint64))


def kv_move(caches, slot: int, src_positions, dst_positions, *, table=None, stream=None):
    """For every layer: cache[slot, :, dst[i], :] = cache[slot, :, src[i], :], k and v, for
    i in increasing order, in one launch. caches: every layer's (cache_k, cache_v) of one shape;
    src_positions, dst_positions: host ints with dst[i] < src[i], both strictly increasing (so
    dst[i] may be an earlier src[j], never a later one, and moving in order is in place);
    table: kv_cache_table(caches), made here when None."""
    n_slots, n_kv, max_ctx, hd = _check_cache(*caches[0])
    src = np.asarray(src_positions, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_positions, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        raise ValueError(f"kv_move: {src.size} source positions, {dst.size} destinations")
    if not 0 <= slot < n_slots:
        raise ValueError(f"kv_move: slot {slot} outside [0, {n_slots})")
    if src.size == 0:
        return
    if (np.any(np.diff(src) <= 0) or np.any(np.diff(dst) <= 0) or np.any(dst >= src) or dst[0] < 0
            or src[-1] >= max_ctx):
        raise ValueError("kv_move: positions must be strictly increasing, each destination below its "
                         f"source, all in [0, {max_ctx})")
    if table is None:
        table = kv_cache_table(caches)
    if table.dtype != cp.uint64 or table.size != 2 * len(caches):
        raise ValueError(f"table must be kv_cache_table(caches): uint64 [{2 * len(caches)}]")
    with _stream_ctx(stream):
        moves = cp.asarray(np.stack([src, dst]).astype(np.int32))  # [2, n]: sources, destinations
        _launch(_ops_kernel("kv_move_kernel"), (n_kv, 2 * len(caches)), (min(hd, 256),), (
            table, moves[0], moves[1], np.int32(src.size), np.int32(slot), np.int32(n_kv), np.int32(max_ctx),
            np.int32(hd)))


def tree_mask_words(n_rows: int) -> int:
    """u32 words per row of a tree mask over trees of up to n_rows rows."""
    return max(1, -(-n_rows // 32))


def pack_tree_mask(visible, n_words: int):
    """A tree's visibility (bool [n, n], row j sees row i) as attention's tree_mask rows: uint32
    [n, n_words], bit i % 32 of word i // 32 of row j = visible[j, i]."""
    n = visible.shape[0]
    if n > 32 * n_words:
        raise ValueError(f"a tree of {n} rows needs {tree_mask_words(n)} mask words, not {n_words}")
    bits = np.zeros((n, 32 * n_words), dtype=bool)
    bits[:, :n] = visible
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


_ATTN_WARPS = tuning.ATTN_SPLIT_STEP  # warps per CTA of attn_split_kernel: n_splits is a multiple of it
_ATTN_MAX_SPLITS = 256  # ops.cu ATTN_MAX_SPLITS: attn_combine_kernel's shared arrays


def attention_splits(T: int, n_kv: int, max_ctx: int) -> int:
    """Default number of key splits (a multiple of 4) for attention over T queries: enough
    (query, kv-head, split) warps to fill the device (its tuning entry), at most one split per
    32-key tile."""
    return _tuning().attn_splits(T, n_kv, max_ctx)


def attention_workspace(T: int, H: int, hd: int, n_splits: int):
    """(part_ml, part_acc) scratch for attention: f32 [T*H*n_splits*2] and [T*H*n_splits*hd]."""
    return cp.empty(T * H * n_splits * 2, dtype=cp.float32), cp.empty(T * H * n_splits * hd, dtype=cp.float32)


def attention(q, cache_k, cache_v, slots, kv_lens, out=None, *, n_splits=None, workspace=None, scale=None,
              tree_base=None, tree_mask=None, planes=None, stream=None):
    """Grouped-query attention over the f16 KV cache, softmax in f32.

    q: f32 [T, H, hd] (RoPE applied), H = n_kv * group; query t (head h) attends to positions
    [0, kv_lens[t]) of slot slots[t] through kv-head h // group, scaled by 1/sqrt(hd).
    slots, kv_lens: int32 [T] on the device.
      decode:  T sequences, kv_lens[t] = pos[t] + 1 (after kv_append of this step's k, v);
      prefill: one sequence's chunk of T positions, slots all equal, kv_lens[t] = positions[t] + 1
               (causal within the chunk, the chunk's own keys appended first).
      tree:    with tree_base (int32 [T]) and tree_mask (uint32 [T, W], pack_tree_mask), a row t
               with tree_base[t] >= 0 is a row of a token tree whose row 0 sits at cache position
               tree_base[t]: of the keys in [0, kv_lens[t]) it sees those before tree_base[t] and
               the tree row i (at tree_base[t] + i) where bit i of tree_mask[t] is set (its
               ancestors and itself). Rows with tree_base[t] = -1 keep the rule above. Without
               them the kernel has no mask code at all (a separate instantiation).
    out: f32 [T, H, hd]. n_splits: key splits (multiple of 4; default attention_splits); pass the
    same n_splits and a workspace (attention_workspace) to make the call allocation-free.
    planes: ``_i16_planes(T, H * hd)``, written with out's i16 activations (``i16_quantize`` of
    out as [T, H * hd], the same bits) by the combine kernel: see ``attention_gemm``.
    """
    n_slots, n_kv, max_ctx, hd = _check_cache(cache_k, cache_v)
    _check_f32("q", q)
    if q.ndim != 3 or q.shape[2] != hd or q.shape[1] % n_kv:
        raise ValueError(f"q must be [T, n_kv*group, {hd}], got {q.shape}")
    T, H, _ = q.shape
    G = H // n_kv
    if hd % 32 or hd > 256 or G * hd > 2048:
        raise ValueError(f"unsupported head dim {hd} / group {G} (hd multiple of 32 <= 256, group*hd <= 2048)")
    _check_i32("slots", slots, T)
    _check_i32("kv_lens", kv_lens, T)
    tree = tree_base is not None
    if tree != (tree_mask is not None):
        raise ValueError("tree_base and tree_mask go together")
    if tree:
        _check_i32("tree_base", tree_base, T)
        if (not isinstance(tree_mask, cp.ndarray) or tree_mask.dtype != cp.uint32 or tree_mask.ndim != 2
                or tree_mask.shape[0] != T or not tree_mask.flags.c_contiguous):
            raise TypeError(f"tree_mask must be a C-contiguous cupy uint32 [{T}, W] array")
    out = _out(out, (T, H, hd), cp.float32)
    if T == 0:
        return out
    S = n_splits or attention_splits(T, n_kv, max_ctx)
    if S % _ATTN_WARPS or S > _ATTN_MAX_SPLITS:
        raise ValueError(f"n_splits={S} must be a multiple of {_ATTN_WARPS} up to {_ATTN_MAX_SPLITS}")
    if workspace is None:
        workspace = attention_workspace(T, H, hd, S)
    part_ml, part_acc = workspace
    if part_ml.size < T * H * S * 2 or part_acc.size < T * H * S * hd:
        raise ValueError("workspace too small for this T, H, hd, n_splits")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    smem = _ATTN_WARPS * G * hd * 4
    args = (q, cache_k, cache_v, slots, kv_lens, part_ml, part_acc, np.int32(n_slots), np.int32(n_kv),
            np.int32(max_ctx), np.float32(sc))
    if tree:
        args += (tree_base, tree_mask, np.int32(tree_mask.shape[1]))
    with _stream_ctx(stream):
        _launch(_attn_kernel(G, hd, tree), (S // _ATTN_WARPS, n_kv, T), (32 * _ATTN_WARPS,), args, shared_mem=smem)
        # the combine reads only the splits the row's length uses (kv_lens, slots as above)
        _launch(_ops_kernel("attn_combine_kernel"), (H, T), (min(hd, 256),), (
            part_ml, part_acc, out, np.int32(H), np.int32(S), np.int32(hd), slots, kv_lens, np.int32(n_slots),
            np.int32(max_ctx), *(planes if planes is not None else (np.uint64(0),) * 4)))
    return out


def attention_gemm_fuses(T: int, qtype, n_cols: int) -> bool:
    """Whether ``attention_gemm`` of T rows by a W of this type and n_cols columns is one fused
    operation (the product takes the i16 matvec) rather than an attention and then a gemm."""
    return n_cols % 32 == 0 and T <= MAX_MATVEC_B and _gemm_path(quant_type(qtype), n_cols, T) == "i16"


def attention_gemm(q, cache_k, cache_v, slots, kv_lens, attn, w_raw, qtype, n_rows: int, n_cols: int, out, *,
                   n_splits=None, workspace=None, tree_base=None, tree_mask=None, stream=None):
    """attn = attention(q, ...) [T, H, hd], then out = attn @ W.T [T, n_rows] (n_cols = H * hd):
    where that product takes the i16 matvec, attention's combine kernel also writes attn's planes,
    one launch fewer than an attention and a quantization, with the same bits."""
    T, H, hd = q.shape
    if n_cols != H * hd:
        raise ValueError(f"attention_gemm: W has {n_cols} columns for an attention output of {H}x{hd}")
    attn = _out(attn, (T, H, hd), cp.float32)
    qt = quant_type(qtype)
    fused = attention_gemm_fuses(T, qtype, n_cols) and attn.data.ptr % 16 == 0
    with _stream_ctx(stream):
        planes = _i16_planes(T, n_cols) if fused else None
        attention(q, cache_k, cache_v, slots, kv_lens, attn, n_splits=n_splits, workspace=workspace,
                  tree_base=tree_base, tree_mask=tree_mask, planes=planes)
        x = attn.reshape(T, n_cols)
        if not fused:
            return gemm(w_raw, qt.qtype, n_rows, n_cols, x, out)
        return matvec(w_raw, qt.qtype, n_rows, n_cols, x, out, variant="i16", planes=planes)


def swiglu(gate, up, out=None, *, stream=None):
    """silu(gate) * up, elementwise; gate, up: f32 [T, F]."""
    return _elementwise2("swiglu_kernel", ("gate", "up"), gate, up, out, stream)


# ------------------------------------------------------------------------------ sampling
def _logits2d(logits):
    _check_f32("logits", logits)
    return logits.reshape(1, -1) if logits.ndim == 1 else logits


def argmax(logits, out=None, *, stream=None):
    """int32 [B]: index of the largest logit per row of f32 [B, V]; ties go to the lowest id."""
    lg = _logits2d(logits)
    B, V = lg.shape
    out = _out(out, (B,), cp.int32)
    if B:
        with _stream_ctx(stream):
            _launch(_ops_kernel("argmax_kernel"), (B,), (1024,), (lg, out, np.int32(V)))
    return out


def apply_repetition_penalty(logits, history, penalty, *, stream=None):
    """In place on f32 [B, V]: for each distinct id in history[b] (int32 [B, n], entries < 0 are
    padding) logit / p if logit > 0 else logit * p (llama.cpp's rule), p = penalty (a float, or
    f32 [B] on the device)."""
    lg = _logits2d(logits)
    B, V = lg.shape
    if history.ndim == 1:
        history = history.reshape(1, -1)
    _check_i32("history", history)
    if history.shape[0] != B:
        raise ValueError(f"history has {history.shape[0]} rows, logits {B}")
    pen_arr = None
    if isinstance(penalty, cp.ndarray):
        _check_f32("penalty", penalty, (B,))
        pen_arr, penalty = penalty, 1.0
    if B and history.shape[1]:
        with _stream_ctx(stream):
            _launch(_ops_kernel("rep_penalty_kernel"), (B,), (256,), (
                lg, history, np.int32(V), np.int32(history.shape[1]), np.float32(penalty), _ptr_or_null(pen_arr)))
    return logits


def _topk_chunks(V: int, k: int, B: int = 1) -> int:
    """Chunks topk splits each of B rows of V into (1: none): the largest divisor of V up to
    64 that leaves chunks of at least max(k, 2048) entries, and keeps B x chunks CTAs within
    about two per SM (one wave). One CTA scans a row several times, so a 128k vocabulary row
    took 234 us on the H200; its chunks run side by side, then one CTA picks the top k of their
    candidates. 32 rows of 48 chunks were 1536 CTAs of 1024 threads, several waves: 220 us."""
    cap = max(1, min(64, 2 * _sm_count() // max(1, B)))
    for c in range(cap, 1, -1):
        if V % c == 0 and V // c >= max(k, 2048):
            return c
    return 1


_SM_COUNTS: dict[int, int] = {}


def _sm_count() -> int:
    """Streaming multiprocessors of the current device (cached)."""
    dev = cp.cuda.runtime.getDevice()
    if dev not in _SM_COUNTS:
        _SM_COUNTS[dev] = cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return _SM_COUNTS[dev]


def topk(logits, k: int, values=None, ids=None, *, stream=None):
    """(values f32 [B, k], ids int32 [B, k]) of the k largest logits per row, best first, ties
    broken by the lower id; k <= 256 and k <= V. Long rows go in two stages (``_topk_chunks``):
    the top k of each chunk, then the top k of those candidates, whose order (chunk by chunk,
    each best first and lower id first) keeps the tie rule."""
    lg = _logits2d(logits)
    B, V = lg.shape
    if not 1 <= k <= min(256, V):
        raise ValueError(f"k={k} must be in [1, min(256, V={V})]")
    values = _out(values, (B, k), cp.float32)
    ids = _out(ids, (B, k), cp.int32)
    if not B:
        return values, ids
    kern = _ops_kernel("topk_kernel")
    C = _topk_chunks(V, k, B)
    with _stream_ctx(stream):
        if C == 1:
            _launch(kern, (B,), (1024,), (lg, values, ids, np.int32(V), np.int32(k)))
            return values, ids
        n = V // C
        cand_v = cp.empty((B * C, k), dtype=cp.float32)
        cand_i = cp.empty((B * C, k), dtype=cp.int32)
        _launch(kern, (B * C,), (1024,), (lg, cand_v, cand_i, np.int32(n), np.int32(k)))  # rows of [B * C, n]
        cand_i += (cp.arange(B * C, dtype=cp.int32) % C * n)[:, None]  # chunk ids -> row ids
        pos = cp.empty((B, k), dtype=cp.int32)
        _launch(kern, (B,), (1024,), (cand_v, values, pos, np.int32(C * k), np.int32(k)))
        ids[...] = cp.take_along_axis(cand_i.reshape(B, C * k), pos, axis=1)
    return values, ids
