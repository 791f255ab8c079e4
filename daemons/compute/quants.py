"""Dequantization of GGUF tensors for the CPU backend.

The CPU backend is the numerical reference, so it does not carry its own block decoders: it uses
gguf-py's numpy reference (``gguf.quants``), the same code the tests hold every GPU kernel to.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from ntx.shared.quant_types import tensor_nbytes


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ``raw`` (uint8, the tensor's exact GGUF bytes) to float32 of ``shape``.

    raw: [nbytes] uint8 -> out: shape float32 (a fresh array, never a view of ``raw``, so the
    caller may hand the slot back as soon as this returns).
    """
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    rows = raw[: tensor_nbytes(ggml_type, shape)].reshape(n_rows, -1)  # rows: [R, row_bytes]
    out = _gguf_dequantize(rows, ggml_type)
    if out.base is not None or out.dtype != np.float32:  # F32 is returned as a view of the slot
        out = np.array(out, dtype=np.float32, copy=True)
    return out.reshape(shape)
