"""What every kernel family of the cuda backend runs on: NVRTC modules, the launcher, the
argument checks, and the device's tuning table.

Modules: each ``.cu`` of this folder (or a lab source of dev/cuda) is compiled by NVRTC through
cupy (``cp.RawModule``, headers inlined by ``sources.kernel_source``) the first time a kernel of
it is asked for, with the template instantiations its launchers name (``instances.py``), and
kept per device; cupy also caches the compiled code on disk, keyed by the source text.

Launching: a family function launches through its ``KernelContext``'s ``Launcher``, which a
backend makes from its ``KernelOptions``. Where the device has programmatic dependent launch
(compute capability 9.0 and later) and the options ask for it, a kernel goes through the
driver's cuLaunchKernelEx with the programmatic-stream-serialization attribute, which cupy's
launcher does not expose: it may start while the previous kernel in the stream finishes (its
CTAs resident, a matvec's first weights in flight) and waits in pdl_wait (common.cuh) before it
touches what earlier work wrote. Graph capture records the overlap as programmatic edges. The
tensor-core matmuls are launched plainly unless ``pdl_matmul``: launched early, a matmul's CTAs
are placed on whichever SMs the kernels before it free first, and its one wave of CTAs (8-64
rows) balances worse (docs/PERFORMANCE.md, "Kernel tuning").

Scratch: a kernel's temporary buffers (quantized activations, split-K partial sums, ...) come
from its context's ``scratch``: the backend's arena (``arena.py``: fixed regions, sized by
``memory.py``'s layout) or, for tests and benchmarks, ``StandaloneScratch`` (a buffer per purpose
and size, made on its first eager use).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import cupy as cp
import numpy as np

from ntx.daemons.compute.cuda import tuning as tuning_tables
from ntx.daemons.compute.cuda.sources import kernel_source
from ntx.shared.kernel_options import KernelOptions

__all__ = ["KernelContext", "Launcher", "StandaloneScratch", "standalone", "module", "function", "tuning",
           "invariant_tuning",
           "sm_count", "check_f32", "check_i32", "out_array", "stream_ctx", "ptr_or_null", "aligned_x", "rows_and_out",
           "DEFAULT_SMEM_LIMIT"]

DEFAULT_SMEM_LIMIT = 48 << 10  # dynamic shared memory a kernel gets without opting in

# ------------------------------------------------------------------------------ the device
_tunings: dict[int, tuning_tables.KernelTuning] = {}
_SM_COUNTS: dict[int, int] = {}


def tuning() -> tuning_tables.KernelTuning:
    """The current device's launch table (tuning.for_device, looked up once per device; the
    device id straight from the runtime: a Device object per call cost ~60 µs a layer)."""
    dev = cp.cuda.runtime.getDevice()
    t = _tunings.get(dev)
    if t is None:
        name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
        t = _tunings[dev] = tuning_tables.for_device(name.decode() if isinstance(name, bytes) else str(name))
    return t


def set_tuning(t: tuning_tables.KernelTuning) -> None:
    """Make ``t`` the current device's table for the rest of this process, for the backends made
    after it: a benchmark timing a launch choice in whole passes (scripts/bench_decode.py
    --fx-mvq-launch). ``t`` needs a name of its own: the batch-invariant forms are kept by name."""
    if any(k[0] == t.name for k in _invariant_tunings) and t != _tunings.get(cp.cuda.runtime.getDevice()):
        raise ValueError(f"a launch table named {t.name!r} is in use already: give the new one its own name")
    _tunings[cp.cuda.runtime.getDevice()] = t


_invariant_tunings: dict[tuple[str, bool, bool], tuning_tables.KernelTuning] = {}


def invariant_tuning(t: tuning_tables.KernelTuning, rows: bool = False,
                     fixed: bool = False) -> tuning_tables.KernelTuning:
    """``t``'s batch-invariant form (``tuning.batch_invariant``; ``rows``: its matvec_rows form,
    ``fixed``: its fixed-point form), made once per table and form."""
    got = _invariant_tunings.get((t.name, rows, fixed))
    if got is None:
        got = _invariant_tunings[(t.name, rows, fixed)] = tuning_tables.batch_invariant(t, rows, fixed)
    return got


def sm_count() -> int:
    """Streaming multiprocessors of the current device (cached)."""
    dev = cp.cuda.runtime.getDevice()
    if dev not in _SM_COUNTS:
        _SM_COUNTS[dev] = cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return _SM_COUNTS[dev]


# ------------------------------------------------------------------------------ compilation
_lock = threading.Lock()
_modules: dict[tuple, cp.RawModule] = {}
_OPTIONS = ("-std=c++17",)


def module(source: str | Path, names: tuple[str, ...]) -> cp.RawModule:
    """The compiled module of ``source`` (a file of this folder, or a path: dev/cuda's lab) with
    the template instantiations ``names``, per device."""
    key = (cp.cuda.runtime.getDevice(), str(source), names)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                # headers inlined: cupy caches compiled modules by this text (sources.py)
                src = kernel_source(source)
                if names:
                    mod = cp.RawModule(code=src, options=_OPTIONS, name_expressions=list(names))
                else:
                    mod = cp.RawModule(code=src, options=_OPTIONS)
                mod.compile()
                _modules[key] = mod
    return mod


_functions: dict[tuple, Any] = {}  # (device, source, name, module's names) -> compiled kernel


def function(source: str | Path, name: str, names: tuple[str, ...] = ()) -> Any:
    """The kernel ``name`` of ``source``'s module with instantiations ``names`` (``name`` one of
    them, or an extern "C" kernel with ``names`` empty), looked up once per device: an eager pass
    makes hundreds of calls, and asking the module each time cost ~2 ms a pass at 16 rows."""
    key = (cp.cuda.runtime.getDevice(), str(source), name, names)
    f = _functions.get(key)
    if f is None:
        f = _functions[key] = module(source, names).get_function(name)
    return f


# ------------------------------------------------------------------------------ launching
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
_launch_ex_by_device: dict[int, Any] = {}  # device -> cuLaunchKernelEx, or None where the device lacks PDL


def _launch_ex(dev: int):
    """cuLaunchKernelEx where device ``dev`` has programmatic launch (sm_90+), else None."""
    if dev in _launch_ex_by_device:
        return _launch_ex_by_device[dev]
    fn = None
    if cp.cuda.runtime.getDeviceProperties(dev)["major"] >= 9:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):  # a driver older than CUDA 12.0
            fn = None
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.c_void_p]
    _launch_ex_by_device[dev] = fn
    return fn


def _c_arg(a):
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    ctype = _C_SCALARS.get(type(a))
    if ctype is None:
        raise TypeError(f"kernel argument of type {type(a).__name__}: pass a cupy array or a sized numpy scalar")
    return ctype(a.item())


class Launcher:
    """Launches kernels on the current stream as ``options`` say (see the module doc): the
    cuda backend makes one from its ``KernelOptions``; graphs captured with it keep the launches
    they were captured with."""

    def __init__(self, options: KernelOptions | None = None) -> None:
        self.options = options if options is not None else KernelOptions()

    def pdl_enabled(self) -> bool:
        """Whether kernels on the current device are launched with programmatic dependent launch."""
        return self.options.pdl and _launch_ex(cp.cuda.runtime.getDevice()) is not None

    def __call__(self, kern, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
                 matmul: bool = False) -> None:
        """Launch ``kern`` (a cupy RawKernel of a compiled module) on the current stream; a
        tensor-core matmul (``matmul``) early only with ``pdl_matmul``."""
        wanted = self.options.pdl and (self.options.pdl_matmul or not matmul)
        launch_ex = _launch_ex(cp.cuda.runtime.getDevice()) if wanted else None
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


# ------------------------------------------------------------------------------ scratch
class StandaloneScratch:
    """Scratch for kernel calls outside a backend (tests, benchmarks, dev/cuda): one buffer per
    (device, stream, purpose, size), made on the first eager call of a size and kept (a graph
    captured after it points at it), so calls on two streams never share one. ``zero``: made
    zeroed (the matmuls' tile counters, which every launch leaves at zero again). A backend uses
    its arena instead (``arena.ArenaScratch``): fixed regions, sized up front."""

    def __init__(self) -> None:
        self.bufs: dict[tuple, cp.ndarray] = {}
        self.lock = threading.Lock()

    def __call__(self, purpose: str, nbytes: int, zero: bool = False) -> cp.ndarray:
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


@dataclass
class KernelContext:
    """What a kernel call needs beyond its arguments: how to launch (``launch``: the backend's
    ``KernelOptions``), where its scratch lives (``scratch(purpose, nbytes, zero=False)`` -> a
    uint8 device array), and the GEMM plans chosen so far (``plans``: gemm.py, by weight format,
    shape and rows). The cuda backend owns one; ``standalone()`` makes one for tests and tools."""

    launch: Launcher
    scratch: Callable[..., Any]
    plans: dict = field(default_factory=dict)

    @property
    def batch_invariant(self) -> bool:
        """Whether this context's kernels keep a row's result independent of its pass's rows
        (``KernelOptions.batch_invariant``); part of every plan key that depends on it."""
        return self.launch.options.batch_invariant

    def tuning(self) -> tuning_tables.KernelTuning:
        """The launch table this context's kernels take: the device's (``tuning()``), or its
        batch-invariant form when the context's options ask for it."""
        t = tuning()
        o = self.launch.options
        return invariant_tuning(t, o.invariant_rows, o.invariant_fixed) if self.batch_invariant else t


def standalone(options: KernelOptions | None = None) -> KernelContext:
    """A context for kernel calls outside a backend: ``options`` (default: the defaults) and
    ``StandaloneScratch``."""
    return KernelContext(Launcher(options), StandaloneScratch())


# ------------------------------------------------------------------------------ argument checks
def stream_ctx(stream):
    return stream if stream is not None else contextlib.nullcontext()


def ptr_or_null(a):
    return a if a is not None else np.uint64(0)


def check_f32(name: str, a, shape=None) -> None:
    if not isinstance(a, cp.ndarray) or a.dtype != cp.float32:
        raise TypeError(f"{name} must be a cupy float32 array")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {a.shape}, expected {tuple(shape)}")


def check_i32(name: str, a, n=None) -> None:
    if not isinstance(a, cp.ndarray) or a.dtype != cp.int32 or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous cupy int32 array")
    if n is not None and a.size != n:
        raise ValueError(f"{name} has {a.size} entries, expected {n}")


def out_array(out, shape, dtype):
    """``out`` checked against (shape, dtype), or a new array when None."""
    if out is None:
        return cp.empty(shape, dtype=dtype)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {np.dtype(dtype).name} {tuple(shape)}, got {out.dtype} {out.shape}")
    return out


def aligned_x(x, n_cols: int):
    """A product's x as [B, n_cols] f32, copied when it does not start on a 16-byte boundary."""
    if x.ndim == 1:
        x = x.reshape(1, -1)
    check_f32("x", x)
    if x.shape[1] != n_cols:
        raise ValueError(f"x has {x.shape[1]} columns, expected {n_cols}")
    if x.data.ptr % 16:
        x = x.copy()
    return x


def rows_and_out(x, out, n_rows: int, n_cols: int, max_rows: int, name: str):
    """A product's x as [B, n_cols] (16-byte aligned, 1 <= B <= max_rows rows, else a clear
    error naming ``name``) and its out: [B, n_rows], or [n_rows] for a 1-D x."""
    one_d = x.ndim == 1
    x = aligned_x(x, n_cols)
    B = x.shape[0]
    if not 1 <= B <= max_rows:
        raise ValueError(f"{name} takes 1..{max_rows} rows of x, got {B}; use gemm")
    return x, out_array(out, (n_rows,) if one_d else (B, n_rows), cp.float32)
