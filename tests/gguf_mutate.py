"""Hostile GGUF files for the index's tests: a valid file taken apart into its header's pieces
(encoded metadata pairs, tensor records, the data section), changed, and written back.

``GGUFParts`` is what the attack tests (tests/test_gguf_index.py) and the fuzz test
(tests/test_gguf_fuzz.py) edit; every piece stays bytes or plain numbers, so a test can write
what no honest writer would: a NaN alignment, a 5,000-digit layer number, an ANSI escape in a
tensor name, two tensors on the same bytes.
"""

from __future__ import annotations

import os
import pathlib
import struct
from dataclasses import dataclass, field

from gguf import GGUFValueType as VT

from ntx.shared.gguf_index import GGUF_MAGIC, read_header
from synth_gguf.gguf_file import encode_kv

# A chat template that fails three ways, on the message's content (an overflow, a macro that
# recurses for ever, a division by zero), and renders anything else as "role: content".
HOSTILE_CHAT_TEMPLATE = (
    "{% macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}"
    "{% for m in messages %}{% if m.content == 'overflow' %}{{ 10.0 ** 400 }}"
    "{% elif m.content == 'recursion' %}{{ deeper(0) }}{% elif m.content == 'zero' %}{{ 1 // 0 }}"
    "{% elif m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m.content == 'memory' %}{% set s = 'x' * 100000 %}{{ (s * 100000)|length }}"
    "{% elif m.content == 'center' %}{{ 'x'.center(10000000000) }}"
    "{% elif m.content == 'output' %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")


@dataclass
class TensorRecord:
    """One tensor-info record as it will be written (the name as bytes: it need not be UTF-8)."""

    name: bytes
    ne: list[int]  # GGUF order; each a u64
    type_id: int
    rel_offset: int

    def encode(self) -> bytes:
        return (struct.pack("<Q", len(self.name)) + self.name + struct.pack("<I", len(self.ne))
                + struct.pack(f"<{len(self.ne)}Q", *self.ne) + struct.pack("<IQ", self.type_id, self.rel_offset))


@dataclass
class GGUFParts:
    """A GGUF file's pieces: write them back with ``write`` (``encode`` for the bytes)."""

    version: int
    kvs: list[bytes]  # encoded pairs (key, type, value), as HeaderKV.raw holds them
    tensors: list[TensorRecord]
    alignment: int  # what the data section is padded to (the file's own general.alignment)
    data: bytes  # the data section
    magic: bytes = GGUF_MAGIC
    counts: tuple[int, int] | None = field(default=None)  # (tensors, pairs) to state, if not the real ones

    @classmethod
    def of(cls, path: os.PathLike) -> GGUFParts:
        h = read_header(path)
        with open(path, "rb") as f:
            f.seek(h.data_start)
            data = f.read()
        return cls(h.version, [kv.raw for kv in h.kvs],
                   [TensorRecord(t.name.encode(), list(t.ne), t.type_id, t.rel_offset) for t in h.tensors],
                   h.alignment, data)

    def key_index(self, key: str) -> int:
        k = key.encode()
        for i, raw in enumerate(self.kvs):
            (n,) = struct.unpack_from("<Q", raw)
            if raw[8 : 8 + n] == k:
                return i
        raise KeyError(key)

    def set_kv(self, key: str, vtype: VT, value, subtype: VT | None = None) -> GGUFParts:
        """Replace the pair ``key`` (or add it) with ``value`` of type ``vtype``."""
        raw = encode_kv(key, vtype, value, subtype)
        try:
            self.kvs[self.key_index(key)] = raw
        except KeyError:
            self.kvs.append(raw)
        return self

    def drop_kv(self, key: str) -> GGUFParts:
        del self.kvs[self.key_index(key)]
        return self

    def tensor(self, name: str) -> TensorRecord:
        return next(t for t in self.tensors if t.name == name.encode())

    def encode(self) -> bytes:
        n_tensors, n_kv = self.counts or (len(self.tensors), len(self.kvs))
        head = b"".join([self.magic, struct.pack("<IQQ", self.version, n_tensors, n_kv), *self.kvs,
                         *(t.encode() for t in self.tensors)])
        return head + b"\0" * (-len(head) % self.alignment) + self.data

    def write(self, path: os.PathLike) -> pathlib.Path:
        pathlib.Path(path).write_bytes(self.encode())
        return pathlib.Path(path)
