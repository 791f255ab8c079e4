"""GGUF model index: everything about a Llama-family GGUF file (or split set) except its tensor data.

The reader, the dma stager and the compute worker all need the same facts — hyper-parameters,
where every tensor lives, and each layer's contiguous byte span — and none of them should read
tensor data to learn them. ``open_model`` parses only the header (through a read-only mmap, so
untouched data pages are never read), checks the whole file set, and returns an immutable
``ModelIndex`` or raises one ``ModelError`` line naming the file and the problem. It is built on
``read_header``, the one GGUF header parser in ntx, which returns a file's header as written
(metadata pairs with their raw bytes, tensor infos) without judging it: the synthetic writer and
the tests read deliberately broken files through it.

Hostile files. Every value the index or its users read is checked before use: its type (one
table, ``_KINDS``, that the tokenizer checks its metadata by too), its range (finite, positive,
capped by the ``MAX_*`` bounds so no header can size a large allocation), and every tensor's
place (aligned, inside its file, overlapping no other). Counts in the header are checked against
the bytes left before anything is allocated for them, names quoted in messages are short, and
``NtxError`` escapes what is not printable, so the only thing a file can make escape is one
``ModelError`` line (tests/test_gguf_fuzz.py holds it to that). Metadata values are plain
Python values, except numeric arrays: those stay packed (``array.array``), so a large array in a
file costs its size once, not a Python object per element.

Shapes are given in numpy order (rows first): a GGUF tensor with ``ne = [n_cols, n_rows]`` has
``shape = (n_rows, n_cols)`` and is stored row-major, each row a run of quant blocks.

The layer image. A layer travels as one buffer, its *image* (held by a ring slot, a RAM tier's
region or a standby copy): for each file span of the layer (one, unless a split set cuts the
layer), a region of whole ``DIRECT_ALIGN_BYTES`` units that holds the span's bytes starting at
``span.offset % DIRECT_ALIGN_BYTES``, so an O_DIRECT read of the aligned superset lands every byte
at the same place a buffered read would. ``Span`` is the one place that says where a span's bytes
sit (``slot_start``, ``bytes_in``, ``region_in``); every reader (the reader daemon,
``layer_bytes``, bench) fills an image through it, and ``LayerInfo.image_offset(name)`` is where a
tensor's bytes start in that image, whoever filled it.
"""

from __future__ import annotations

import array
import math
import mmap
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType

from ntx.shared.align import DIRECT_ALIGN_BYTES, PAGE_BYTES, round_up
from ntx.shared.errors import ModelError, printable
from ntx.shared.quant_types import SUPPORTED_TYPES, quant_type, tensor_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

SUPPORTED_ARCHS = ("llama", "qwen2")
#: Architectures whose q, k and v products carry a bias each (``blk.N.attn_{q,k,v}.bias``).
QKV_BIAS_ARCHS = frozenset({"qwen2"})
#: Architectures whose RoPE rotates the two halves of a head against each other (llama.cpp's NEOX
#: mode) where Llama's rotates adjacent pairs (NORMAL): llama.cpp's converter permutes a Llama's
#: q and k rows for NORMAL and leaves these as the checkpoint has them.
ROPE_NEOX_ARCHS = frozenset({"qwen2"})

# What a header may claim. Every tensor must lie inside its file, but a sparse file can be of
# any size, and some values size allocations that no tensor backs (the context, the rope tables,
# a metadata array): each is capped far above any real Llama (405B: 126 layers, 16384 wide,
# 128 heads of 128; the largest vocabularies ~256k tokens, the longest contexts ~1M).
MAX_TENSORS = 1 << 16  # a 4096-layer Llama has 36,868
MAX_METADATA_KEYS = 1 << 20
MAX_METADATA_ITEMS = 1 << 22  # strings decoded from all metadata arrays together
MAX_ALIGNMENT = 1 << 20
MAX_LAYERS = 1 << 12
MAX_EMBD = 1 << 17
MAX_FF = 1 << 20
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24

# GGUF metadata value types (gguf spec): id -> (struct format, size) for scalars.
_SCALAR_FORMATS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
# Numeric arrays stay packed (``array.array``: one copy of the file's bytes, not a Python object
# per element); a bool array reads as bytes 0/1.
_ARRAY_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_INT_CODES = frozenset("bBhHiIqQ")
_TYPE_STRING, _TYPE_ARRAY = 8, 9
_COPY_CHUNK_BYTES = 16 << 20

# matched with fullmatch: a name with a trailing newline is not another spelling of a plain one
_SPLIT_RE = re.compile(r"(?P<stem>.*)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf")
_LAYER_RE = re.compile(r"blk\.([0-9]+)\.(.+)\.weight")
_LAYER_BIAS_RE = re.compile(r"blk\.([0-9]+)\.(attn_q|attn_k|attn_v)\.bias")  # kept as "attn_q.bias", ...

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
GLOBAL_TENSORS = ("token_embd", "output_norm", "output", "rope_freqs")  # any other is not used
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")  # a layer's tensors where the arch has them


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: ``nbytes`` at absolute ``offset`` in ``path``."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for matrices
    path: str
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Span:
    """A contiguous byte range of one file and its place in the layer's slot buffer.

    ``slot_base`` is where the span's aligned region starts in the slot, ``head`` where its first
    byte lands inside that region: the O_DIRECT alignment of ``offset``, so a direct read of the
    aligned superset into the region and a plain read of the bytes into ``bytes_in`` agree."""

    path: str
    offset: int
    nbytes: int
    slot_base: int

    @property
    def head(self) -> int:
        return self.offset % DIRECT_ALIGN_BYTES

    @property
    def region_bytes(self) -> int:
        return round_up(self.head + self.nbytes, DIRECT_ALIGN_BYTES)

    @property
    def slot_start(self) -> int:
        """Where the span's first byte sits in the slot buffer."""
        return self.slot_base + self.head

    def bytes_in(self, slot: np.ndarray) -> np.ndarray:
        """The span's bytes inside a layer-image buffer: a [nbytes] view of ``slot``."""
        return slot[self.slot_start : self.slot_start + self.nbytes]

    def region_in(self, slot: np.ndarray) -> np.ndarray:
        """The span's aligned region inside a layer-image buffer, which an O_DIRECT read of the
        aligned superset fills exactly: a [region_bytes] view of ``slot``."""
        return slot[self.slot_base : self.slot_base + self.region_bytes]


@dataclass(frozen=True)
class LayerInfo:
    """One transformer block: its tensors (by short name, e.g. ``attn_q``) and its byte spans."""

    index: int
    tensors: dict[str, TensorInfo]
    spans: tuple[Span, ...]

    @property
    def nbytes(self) -> int:
        """Bytes that cross storage and PCIe when this layer streams."""
        return sum(s.nbytes for s in self.spans)

    @property
    def image_bytes(self) -> int:
        """Size of this layer's image (a ring slot holds the largest one)."""
        return sum(s.region_bytes for s in self.spans)

    def image_offset(self, name: str) -> int:
        """Offset of tensor ``name``'s first byte inside the layer's image."""
        t = self.tensors[name]
        for s in self.spans:
            if s.path == t.path and s.offset <= t.offset < s.offset + s.nbytes:
                return s.slot_start + (t.offset - s.offset)
        raise KeyError(name)  # unreachable for an index built by open_model


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn | llama3 (frequency factors from rope_freqs.weight)
    factor: float = 1.0
    original_context: int = 0


@dataclass(frozen=True)
class HParams:
    """Llama hyper-parameters as the GGUF states them."""

    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rope_dim: int
    rope_scaling: RopeScaling
    rms_eps: float
    n_ctx_train: int
    n_vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False  # q, k, v each add a bias after their product (Qwen2)
    rope_neox: bool = False  # RoPE rotates (x[i], x[i + rope_dim/2]), not (x[2i], x[2i+1]) (Qwen2)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class ModelIndex:
    """A checked Llama model: its files, hyper-parameters, layers (tensors and byte spans), the
    global tensors, and the first file's metadata (values as ``read_header`` decodes them)."""

    paths: tuple[str, ...]
    version: int
    architecture: str
    hparams: HParams
    layers: tuple[LayerInfo, ...]
    globals: dict[str, TensorInfo]  # token_embd, output_norm, optionally output and rope_freqs
    metadata: dict[str, Any] = field(repr=False)

    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def name(self) -> str:
        """The model's name for display (``general.name``), anything unprintable escaped."""
        return printable(self.metadata.get("general.name") or Path(self.path).stem)

    @property
    def file_type(self) -> str:
        """The dominant matrix type, e.g. ``Q4_1`` (what a user would call the quantization)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for t in layer.tensors.values():
                if len(t.shape) == 2:
                    counts[t.type_name] = counts.get(t.type_name, 0) + t.nbytes
        return max(counts, key=counts.get) if counts else "?"

    @property
    def max_layer_image_bytes(self) -> int:
        return max(layer.image_bytes for layer in self.layers)

    @property
    def layer_bytes_total(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def global_bytes_total(self) -> int:
        return sum(t.nbytes for t in self.globals.values())


class _HeaderCursor:
    """Sequential little-endian reads from a file's mapping, with truncation reported as such.

    Every count the file states is checked against the bytes left before anything is allocated
    for it, and the strings decoded from metadata arrays are counted against
    ``MAX_METADATA_ITEMS``: a small file cannot make the parser build a large Python structure."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.items_left = MAX_METADATA_ITEMS

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ModelError(self.path, f"truncated file: header ends inside {what} at byte {self.pos}")

    def scalar(self, type_id: int, what: str) -> Any:
        fmt, size = _SCALAR_FORMATS[type_id]
        self._need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str, max_bytes: int | None = None) -> str:
        n = self.u64(what)
        if max_bytes is not None and n > max_bytes:
            raise ModelError(self.path, f"{what}: a name of {n} bytes (at most {max_bytes})")
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _copy_into(self, arr: array.array, nbytes: int) -> None:
        """Append the next ``nbytes`` to ``arr`` a chunk at a time, letting each chunk's pages of
        the mapping go once copied: a large array costs its one copy, not its copy and its
        mapped pages."""
        end = self.pos + nbytes
        with memoryview(self.buf) as whole:
            while self.pos < end:
                step = min(_COPY_CHUNK_BYTES, end - self.pos)
                with whole[self.pos : self.pos + step] as part:
                    arr.frombytes(part)
                first_page = self.pos - self.pos % PAGE_BYTES
                self.pos += step
                if step == _COPY_CHUNK_BYTES:
                    self.buf.madvise(mmap.MADV_DONTNEED, first_page, self.pos - self.pos % PAGE_BYTES - first_page)

    def value(self, type_id: int, what: str) -> Any:
        """One metadata value: a scalar, a str, a list[str] (string array) or an ``array.array``
        (numeric array, packed as in the file)."""
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id, what)
        if type_id == _TYPE_STRING:
            return self.string(what)
        if type_id != _TYPE_ARRAY:
            raise ModelError(self.path, f"bad metadata value type {type_id} in {what}")
        elem_type = self.u32(what)
        count = self.u64(what)
        if elem_type in _ARRAY_CODES:
            arr = array.array(_ARRAY_CODES[elem_type])
            nbytes = count * arr.itemsize
            self._need(nbytes, what)
            self._copy_into(arr, nbytes)
            if sys.byteorder == "big":
                arr.byteswap()
            return arr
        if elem_type == _TYPE_STRING:
            self._need(count * 8, what)  # each string is at least its length
            self.items_left -= count
            if self.items_left < 0:
                raise ModelError(self.path, f"corrupt header: more than {MAX_METADATA_ITEMS} strings in metadata arrays ({what})")
            return [self.string(what) for _ in range(count)]
        if elem_type == _TYPE_ARRAY:
            raise ModelError(self.path, f"{what}: arrays of arrays are not supported")
        raise ModelError(self.path, f"bad metadata array element type {elem_type} in {what}")


def _short(text: str, limit: int = 80) -> str:
    """A name from a file as a message quotes it: at most ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(value: Any) -> str:
    """A metadata value as a message quotes it: a string in quotes, an array by its length."""
    if isinstance(value, (list, array.array)):
        return f"an array of {len(value)}"
    return _short(repr(value))


@dataclass(frozen=True)
class HeaderKV:
    """One metadata pair as the file holds it: the decoded value, and where the encoded pair (key,
    type and value) lies in the file, which ``raw`` reads when a tool copies the pair verbatim
    into another file (gguf-split, a tokenizer copy). A place, not the bytes: a large array is
    not held twice."""

    key: str
    type_id: int  # a GGUFValueType
    value: Any  # int, float, bool, str; list[str] for a string array, array.array for a numeric one
    path: str = field(repr=False)
    offset: int = field(repr=False)
    nbytes: int = field(repr=False)

    @property
    def raw(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise ModelError(self.path, f"file changed while in use: metadata {_short(self.key)} is cut short")
        return data


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor-info record as written; nothing is checked beyond the record's own structure."""

    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the row length
    type_id: int  # a GGMLQuantizationType value, possibly one ntx does not read (or none at all)
    rel_offset: int  # from the start of the data section

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (by gguf's block sizes; ValueError for an unknown type id)."""
        return tensor_nbytes(self.type_id, self.ne)


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header exactly as written: version, metadata pairs, tensor infos, and where
    the data section starts. ``read_header`` makes one; ``open_model`` builds on it and checks
    everything a model needs, tools (the synthetic writer, split, tests) read files that are
    deliberately not models through it."""

    path: str
    version: int
    kvs: tuple[HeaderKV, ...]
    tensors: tuple[HeaderTensor, ...]
    alignment: int
    data_start: int
    file_bytes: int

    @property
    def metadata(self) -> dict[str, Any]:
        return {kv.key: kv.value for kv in self.kvs}

    def kv(self, key: str) -> HeaderKV | None:
        """The pair named ``key``, or None."""
        return next((kv for kv in self.kvs if kv.key == key), None)


MAX_TENSOR_NAME_BYTES = 63  # ggml's GGML_MAX_NAME less its NUL: what llama.cpp accepts


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse one GGUF file's header (through a read-only mmap: no tensor data is read).

    Raises ``ModelError`` only for what makes the header itself unreadable (missing or not a
    regular file, bad magic, unsupported version, truncation inside the header, counts or names
    beyond the format's limits, bad alignment); what the header says is not checked here.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in the model's place must not block
    except FileNotFoundError:
        raise ModelError(path, "no such file") from None
    except PermissionError:
        raise ModelError(path, "permission denied") from None
    except (OSError, ValueError) as e:  # a loop of links, a name too long, a NUL in the name
        raise ModelError(path, f"cannot open: {getattr(e, 'strerror', None) or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ModelError(path, "is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(path, "not a regular file")
        size = st.st_size
        if size < 24:
            if size >= 4 and os.pread(fd, 4, 0) != GGUF_MAGIC:
                raise ModelError(path, "not a GGUF file (bad magic)")
            raise ModelError(path, f"truncated file: only {size} bytes, too short for a GGUF header")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf, path, size)
    finally:
        os.close(fd)


def _parse_header(buf: mmap.mmap, path: str, size: int) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise ModelError(path, f"not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _HeaderCursor(buf, path)
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise ModelError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_METADATA_KEYS:
        raise ModelError(path, f"corrupt header: {n_tensors} tensors, {n_kv} metadata keys")
    kvs = []
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}")
        type_id = cur.u32(f"metadata {_short(key)}")
        value = cur.value(type_id, f"metadata {_short(key)}")
        kvs.append(HeaderKV(key, type_id, value, path, start, cur.pos - start))
    alignment = _alignment(path, kvs)

    tensors = []
    for i in range(n_tensors):
        name = cur.string(f"tensor info #{i}", max_bytes=MAX_TENSOR_NAME_BYTES)
        n_dims = cur.u32(f"tensor {name}")
        if not 1 <= n_dims <= 4:
            raise ModelError(path, f"tensor {name} has {n_dims} dimensions")
        ne = tuple(cur.u64(f"tensor {name}") for _ in range(n_dims))
        type_id = cur.u32(f"tensor {name}")
        rel_offset = cur.u64(f"tensor {name}")
        tensors.append(HeaderTensor(name, ne, type_id, rel_offset))
    return GGUFHeader(path, version, tuple(kvs), tuple(tensors), alignment, round_up(cur.pos, alignment), size)


def _alignment(path: str, kvs: list[HeaderKV]) -> int:
    """``general.alignment`` (the last pair of that name, as gguf-py reads it): an integer power
    of two up to ``MAX_ALIGNMENT``, else the file is refused."""
    kv = next((kv for kv in reversed(kvs) if kv.key == "general.alignment"), None)
    if kv is None:
        return DEFAULT_ALIGNMENT
    a = kv.value
    if type(a) is not int or not 1 <= a <= MAX_ALIGNMENT or a & (a - 1):
        raise ModelError(path, f"bad general.alignment {_shown(a)}: must be a power of two from 1 to {MAX_ALIGNMENT}")
    return a


def _file_tensors(header: GGUFHeader) -> list[TensorInfo]:
    """The file's tensors with absolute offsets, each checked: a unique name, a type ntx reads,
    no zero dimension, whole blocks per row, an aligned start, data that the file really holds,
    and no two sharing a byte."""
    path = header.path
    tensors = []
    seen: set[str] = set()
    for h in header.tensors:
        name = h.name
        if name in seen:
            raise ModelError(path, f"duplicate tensor name {name}")
        seen.add(name)
        try:
            gtype = GGMLQuantizationType(h.type_id)
        except ValueError:
            raise ModelError(path, f"tensor {name} has unknown type id {h.type_id}") from None
        if gtype not in SUPPORTED_TYPES:
            raise ModelError(path, f"tensor {name} has unsupported quant type {gtype.name}")
        if 0 in h.ne:
            raise ModelError(path, f"tensor {name} has a zero dimension: ne {list(h.ne)}")
        block_elems = quant_type(gtype).block_elems
        if h.ne[0] % block_elems:
            raise ModelError(
                path, f"tensor {name}: row length {h.ne[0]} is not a multiple of the {gtype.name} block ({block_elems})"
            )
        if h.rel_offset % header.alignment:
            raise ModelError(path, f"tensor {name}: data offset {h.rel_offset} is not a multiple of the alignment {header.alignment}")
        nbytes = h.nbytes
        offset = header.data_start + h.rel_offset
        if offset + nbytes > header.file_bytes:
            raise ModelError(
                path,
                f"truncated file: tensor {name} ends at byte {offset + nbytes} but the file has {header.file_bytes} bytes",
            )
        tensors.append(TensorInfo(name, gtype, tuple(int(d) for d in reversed(h.ne)), path, offset, nbytes))
    by_offset = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if b.offset < a.offset + a.nbytes:
            raise ModelError(path, f"tensors {a.name} and {b.name} overlap (bytes {b.offset} to {a.offset + a.nbytes})")
    return tensors


def model_file_paths(path: str | os.PathLike) -> list[str]:
    """The files ``open_model(path)`` reads: the file itself, or every shard of its split set."""
    return _split_paths(os.fspath(path))


def split_name(file_name: str) -> tuple[str, int, int] | None:
    """(stem, shard number, shard count) of a split set's file name as llama.cpp's gguf-split
    writes it, ``STEM-00001-of-00003.gguf``; None for the name of a file outside a split set."""
    m = _SPLIT_RE.fullmatch(file_name)
    return (m["stem"], int(m["no"]), int(m["count"])) if m else None


def split_file_name(stem: str, no: int, count: int) -> str:
    """The file name of shard ``no`` (from 1) of ``count`` of split set ``stem``."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def _split_paths(path: str) -> list[str]:
    """All shard paths of a split set that ``path`` belongs to, or [path]."""
    split = split_name(os.path.basename(path))
    if split is None:
        return [path]
    stem, no, count = split
    if not 1 <= no <= count:
        raise ModelError(path, f"a split set's file name, but it says shard {no} of {count}")
    folder = os.path.dirname(path)
    paths = [os.path.join(folder, split_file_name(stem, i, count)) for i in range(1, count + 1)]
    for p in paths:
        if not os.path.exists(p):
            raise ModelError(path, f"split set is missing shard {os.path.basename(p)}")
    return paths


def _layer_number(path: str, name: str, digits: str) -> int:
    """``blk.N``'s N, refused unless written plainly (no leading zero: ``blk.01`` is not a second
    name for ``blk.1``) and below ``MAX_LAYERS``; a 5,000-digit N is refused before ``int``."""
    if len(digits) > len(str(MAX_LAYERS)) or (len(digits) > 1 and digits[0] == "0") or int(digits) >= MAX_LAYERS:
        raise ModelError(path, f"tensor {name}: layer number {_short(digits, 20)} is not a plain number below {MAX_LAYERS}")
    return int(digits)


# -- metadata types ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """What a metadata value must be, and how a message names it. Values come from ``read_header``
    (str, int, float, bool, list[str], array.array) or from a dict a test built (plain lists)."""

    name: str
    holds: Callable[[Any], bool]


def _all(v: Any, types: tuple[type, ...]) -> bool:
    return isinstance(v, list) and all(type(x) in types for x in v)


_INT = _Kind("an integer", lambda v: type(v) is int)
_NUMBER = _Kind("a number", lambda v: type(v) in (int, float))
_BOOL = _Kind("a bool", lambda v: type(v) is bool)
_STR = _Kind("a string", lambda v: type(v) is str)
_STRS = _Kind("an array of strings", lambda v: _all(v, (str,)))
_INTS = _Kind("an array of integers",
              lambda v: (isinstance(v, array.array) and v.typecode in _INT_CODES) or _all(v, (int,)))
_NUMBERS = _Kind("an array of numbers", lambda v: isinstance(v, array.array) or _all(v, (int, float)))

TOKENIZER_ID_KEYS = ("bos", "eos", "eot", "eom", "pad", "unknown")  # tokenizer.ggml.<k>_token_id
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's names

_ARCH = "{arch}."
_KINDS: dict[str, _Kind] = {  # every key ntx reads ("{arch}." is the architecture's prefix)
    "general.architecture": _STR,
    "general.name": _STR,
    "general.alignment": _INT,
    "split.count": _INT,
    **{_ARCH + k: _INT for k in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "rope.dimension_count",
        "rope.scaling.original_context_length", "context_length", "vocab_size")},
    **{_ARCH + k: _NUMBER for k in ("rope.freq_base", "rope.scaling.factor", "attention.layer_norm_rms_epsilon")},
    _ARCH + "rope.scaling.type": _STR,
    "tokenizer.ggml.model": _STR,
    "tokenizer.ggml.pre": _STR,
    "tokenizer.ggml.tokens": _STRS,
    "tokenizer.ggml.token_type": _INTS,
    "tokenizer.ggml.scores": _NUMBERS,
    "tokenizer.ggml.merges": _STRS,
    **{f"tokenizer.ggml.{k}_token_id": _INT for k in TOKENIZER_ID_KEYS},
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL,
    "tokenizer.chat_template": _STR,
}


def metadata_problem(md: dict[str, Any]) -> str | None:
    """The first problem with the metadata values ntx reads — a value of the wrong type, or
    tokenizer arrays whose lengths disagree — as a message; None when there is none. The index
    refuses a file for it (naming the path), the tokenizer a metadata dict."""
    arch = md.get("general.architecture")
    for key, kind in _KINDS.items():
        if key.startswith(_ARCH):
            if type(arch) is not str:
                continue
            key = f"{arch}.{key[len(_ARCH):]}"
        if key in md and not kind.holds(md[key]):
            return f"metadata {_short(key)} is {_shown(md[key])}, not {kind.name}"
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if len(tokens) > MAX_VOCAB:
            return f"metadata tokenizer.ggml.tokens has {len(tokens)} tokens (at most {MAX_VOCAB})"
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            v = md.get(key)
            if v is not None and len(v) != len(tokens):
                return f"metadata {key} has {len(v)} entries for {len(tokens)} tokens"
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):  # the ones every prompt and stop use
            v = md.get(key)
            if v is not None and not 0 <= v < len(tokens):
                return f"metadata {key} is {v}, outside the vocabulary of {len(tokens)} tokens"
    return None


# -- hyper-parameters -------------------------------------------------------------------------


def _hparams(path: str, md: dict[str, Any], globals_: dict[str, TensorInfo], n_layers_found: int) -> HParams:
    """The hyper-parameters, each in its range (types were checked by ``metadata_problem``)."""
    arch = md["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if default is None:
            raise ModelError(path, f"missing metadata key {full}")
        return default

    def count(key: str, lo: int, hi: int, default: int | None = None) -> int:
        v = get(key, default)
        if not lo <= v <= hi:
            raise ModelError(path, f"{arch}.{key} is {v}, outside {lo}..{hi}")
        return v

    def real(key: str, default: float, ok: Callable[[float], bool], want: str) -> float:
        v = float(get(key, default))
        if not (math.isfinite(v) and ok(v)):
            raise ModelError(path, f"{arch}.{key} is {v}: must be {want}")
        return v

    n_embd = count("embedding_length", 1, MAX_EMBD)
    n_head = count("attention.head_count", 1, MAX_HEADS)
    n_head_kv = count("attention.head_count_kv", 1, MAX_HEADS, n_head)
    if n_embd % n_head:
        raise ModelError(path, f"embedding length {n_embd} is not divisible by head count {n_head}")
    if n_head % n_head_kv:
        raise ModelError(path, f"head count {n_head} is not a multiple of KV head count {n_head_kv}")
    head_dim = count("attention.key_length", 1, MAX_HEAD_DIM, n_embd // n_head)
    rope_dim = count("rope.dimension_count", 2, head_dim, head_dim)
    if rope_dim % 2:
        raise ModelError(path, f"{arch}.rope.dimension_count is {rope_dim}: must be even")
    scaling_kind = get("rope.scaling.type", "none")
    if scaling_kind not in ROPE_SCALING_TYPES:
        raise ModelError(path, f"{arch}.rope.scaling.type is {_shown(scaling_kind)}, not one of {', '.join(ROPE_SCALING_TYPES)}")
    if "rope_freqs" in globals_:
        scaling_kind = "llama3"
    scaling = RopeScaling(
        kind=scaling_kind,
        factor=real("rope.scaling.factor", 1.0, lambda f: f >= 0, "a finite number >= 0"),
        original_context=count("rope.scaling.original_context_length", 0, MAX_CONTEXT, 0),
    )
    n_vocab = count("vocab_size", 1, MAX_VOCAB, globals_["token_embd"].shape[0])
    n_layers = count("block_count", 1, MAX_LAYERS)
    if n_layers != n_layers_found:
        found = f"blk.0..{n_layers_found - 1}" if n_layers_found else "no blk.* tensors"
        raise ModelError(path, f"{arch}.block_count says {n_layers} layers but the file has {found}")
    return HParams(
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=count("feed_forward_length", 1, MAX_FF),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rope_base=real("rope.freq_base", 10000.0, lambda b: b >= 1, "a finite number >= 1"),
        rope_dim=rope_dim,
        rope_scaling=scaling,
        # > 0 in float32 too: the GPU kernels add it in float32, and 0 divides a zero row by zero
        rms_eps=real("attention.layer_norm_rms_epsilon", 1e-5, lambda e: 0 < e <= 1 and np.float32(e) > 0,
                     "a finite number > 0 and <= 1"),
        n_ctx_train=count("context_length", 1, MAX_CONTEXT, 4096),
        n_vocab=n_vocab,
        tied_embeddings="output" not in globals_,
        qkv_bias=arch in QKV_BIAS_ARCHS,
        rope_neox=arch in ROPE_NEOX_ARCHS,
    )


def _expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    d, f = hp.n_embd, hp.n_ff
    biases = dict(zip(QKV_BIASES, ((hp.q_dim,), (hp.kv_dim,), (hp.kv_dim,)))) if hp.qkv_bias else {}
    return {
        "attn_norm": (d,),
        "attn_q": (hp.q_dim, d),
        "attn_k": (hp.kv_dim, d),
        "attn_v": (hp.kv_dim, d),
        "attn_output": (d, hp.q_dim),
        "ffn_norm": (d,),
        "ffn_gate": (f, d),
        "ffn_up": (f, d),
        "ffn_down": (d, f),
    } | biases


def _layer_spans(tensors: dict[str, TensorInfo]) -> tuple[Span, ...]:
    """Cover a layer's tensors with one span per file (gaps between tensors included: a few
    alignment bytes, far cheaper than a second read)."""
    by_path: dict[str, list[TensorInfo]] = {}
    for t in tensors.values():
        by_path.setdefault(t.path, []).append(t)
    spans = []
    slot_base = 0
    for p, ts in by_path.items():
        start = min(t.offset for t in ts)
        end = max(t.offset + t.nbytes for t in ts)
        span = Span(p, start, end - start, slot_base)
        slot_base += span.region_bytes
        spans.append(span)
    return tuple(spans)


def open_model(path: str | os.PathLike) -> ModelIndex:
    """Index a Llama GGUF file or split set without reading tensor data.

    Raises ``ModelError`` (one line: path and problem) for anything that would make the model
    unusable, so nothing downstream ever sees a half-valid model: every value the index or its
    users read is checked for type and range, every tensor for its place in its file.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ModelError(path, "is a directory, not a GGUF file")
    if not os.path.exists(path):
        raise ModelError(path, "no such file")
    paths = _split_paths(path)
    headers = [read_header(p) for p in paths]
    for h in headers:
        seen: set[str] = set()
        for kv in h.kvs:
            if kv.key in seen:
                raise ModelError(h.path, f"duplicate metadata key {_short(kv.key)}")
            seen.add(kv.key)
    md = headers[0].metadata
    problem = metadata_problem(md)
    if problem:
        raise ModelError(paths[0], problem)
    if len(paths) > 1:
        count = md.get("split.count")
        if count is not None and count != len(paths):
            raise ModelError(paths[0], f"split.count is {count} but the set has {len(paths)} shards")

    arch = md.get("general.architecture")
    if arch is None:
        raise ModelError(paths[0], "missing metadata key general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(paths[0], f"unsupported architecture {_shown(arch)} (supported: {', '.join(SUPPORTED_ARCHS)})")

    all_tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in _file_tensors(h):
            if t.name in all_tensors:
                raise ModelError(h.path, f"duplicate tensor name {t.name}")
            all_tensors[t.name] = t

    globals_: dict[str, TensorInfo] = {}
    layer_tensors: dict[int, dict[str, TensorInfo]] = {}
    for name, t in all_tensors.items():
        m = _LAYER_RE.fullmatch(name)
        if m:
            layer_tensors.setdefault(_layer_number(t.path, name, m[1]), {})[m[2]] = t
        elif arch in QKV_BIAS_ARCHS and (m := _LAYER_BIAS_RE.fullmatch(name)):
            layer_tensors.setdefault(_layer_number(t.path, name, m[1]), {})[f"{m[2]}.bias"] = t
        elif name.endswith(".weight") and name[: -len(".weight")] in GLOBAL_TENSORS:
            globals_[name[: -len(".weight")]] = t
    for g in ("token_embd", "output_norm"):
        if g not in globals_:
            raise ModelError(paths[0], f"missing tensor {g}.weight")

    n_layers_found = (max(layer_tensors) + 1) if layer_tensors else 0
    hp = _hparams(paths[0], md, globals_, n_layers_found)
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != hp.n_vocab:
        raise ModelError(paths[0], f"the tokenizer has {len(tokens)} tokens but the model's vocabulary has {hp.n_vocab}")
    expected = _expected_shapes(hp)

    def check_shape(t: TensorInfo, want: tuple[int, ...]) -> None:
        if t.shape != want:
            raise ModelError(t.path, f"tensor {t.name} has shape {list(t.shape)}, expected {list(want)}")

    check_shape(globals_["token_embd"], (hp.n_vocab, hp.n_embd))
    check_shape(globals_["output_norm"], (hp.n_embd,))
    if "output" in globals_:
        check_shape(globals_["output"], (hp.n_vocab, hp.n_embd))
    if "rope_freqs" in globals_:
        check_shape(globals_["rope_freqs"], (hp.rope_dim // 2,))

    layers = []
    for i in range(hp.n_layers):
        tensors = layer_tensors.get(i, {})
        for short, want in expected.items():
            if short not in tensors:
                full = short if short.endswith(".bias") else f"{short}.weight"
                raise ModelError(paths[0], f"missing tensor blk.{i}.{full}")
            check_shape(tensors[short], want)
        layers.append(LayerInfo(i, dict(tensors), _layer_spans(tensors)))

    return ModelIndex(
        paths=tuple(paths),
        version=headers[0].version,
        architecture=arch,
        hparams=hp,
        layers=tuple(layers),
        globals=globals_,
        metadata=md,
    )


assert all(array.array(c).itemsize == _SCALAR_FORMATS[t][1] for t, c in _ARRAY_CODES.items())
