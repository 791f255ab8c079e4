"""Can the cuda backend run here? One clear line when it cannot, naming the fix."""

from __future__ import annotations

from ntx.shared.errors import ConfigError

_FIX = "install cupy for your CUDA version: pip install 'ntransformer[cuda12]' or 'ntransformer[cuda13]'"


def cuda_problem() -> str | None:
    """None when cupy imports and sees a GPU; otherwise why not."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except ImportError:
        return f"cupy is not installed ({_FIX})"
    try:
        n = runtime.getDeviceCount()
    except Exception as e:  # cupy raises CUDARuntimeError / driver errors of several kinds
        text = str(e)
        if "insufficient" in text.lower() or "driver" in text.lower():
            return f"the NVIDIA driver is too old or missing for this cupy ({text}); update the driver or pick the cupy matching it"
        return f"no usable NVIDIA GPU ({text})"
    if n == 0:
        return "no NVIDIA GPU found"
    return None


def require_cuda() -> None:
    problem = cuda_problem()
    if problem:
        raise ConfigError(f"--backend cuda cannot run: {problem}; or use --backend cpu")
