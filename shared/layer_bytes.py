"""Plain reads of tensor and layer bytes, for processes that load once at start (not streaming).

The reader daemon streams with O_DIRECT through ``ntx.daemons.reader.io``; these helpers serve the
one-time loads — compute's resident layers and global tensors, dma's pinned-RAM tier — where a
buffered read at start-up is all that is needed.
"""

from __future__ import annotations

import os

import numpy as np

from ntx.shared.errors import ModelError
from ntx.shared.gguf_index import LayerInfo, TensorInfo


def _pread_exact(path: str, offset: int, dest: memoryview) -> None:
    """Fill ``dest`` from ``path`` at ``offset``; a file that is gone, unreadable or shorter than
    the index said (changed since it was indexed) is a ``ModelError``, not an ``OSError``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ModelError(path, f"cannot open: {e.strerror or e}") from None
    try:
        done = 0
        while done < len(dest):
            try:
                n = os.preadv(fd, [dest[done:]], offset + done)
            except OSError as e:
                raise ModelError(path, f"read failed at byte {offset + done}: {e.strerror or e}") from None
            if n == 0:
                raise ModelError(path, f"short read at byte {offset + done}: file ended early")
            done += n
    finally:
        os.close(fd)


def read_tensor(t: TensorInfo) -> np.ndarray:
    """The tensor's raw GGUF bytes: [nbytes] uint8."""
    out = np.empty(t.nbytes, dtype=np.uint8)
    _pread_exact(t.path, t.offset, memoryview(out))
    return out


def read_layer_into(layer: LayerInfo, dest: np.ndarray) -> np.ndarray:
    """Fill ``dest`` ([>= image_bytes] uint8) with the layer's image; returns ``dest``."""
    if dest.nbytes < layer.image_bytes:
        raise ValueError(f"buffer of {dest.nbytes} bytes is smaller than layer {layer.index}'s image ({layer.image_bytes})")
    for s in layer.spans:
        _pread_exact(s.path, s.offset, memoryview(s.bytes_in(dest)))
    return dest


def read_layer(layer: LayerInfo) -> np.ndarray:
    """A fresh layer-image buffer holding the layer: [image_bytes] uint8."""
    return read_layer_into(layer, np.empty(layer.image_bytes, dtype=np.uint8))
