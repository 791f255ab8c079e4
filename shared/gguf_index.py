"""GGUF model index: everything about a Llama-family GGUF file (or split set) except its tensor data.

The reader, the dma stager and the compute worker all need the same facts — hyper-parameters,
where every tensor lives, and each layer's contiguous byte span — and none of them should read
tensor data to learn them. ``open_model`` parses only the header (through a read-only mmap, so
untouched data pages are never read), checks the whole file set, and returns an immutable
``ModelIndex`` or raises one ``ModelError`` line naming the file and the problem. It is built on
``read_header``, the one GGUF header parser in ntx, which returns a file's header as written
(metadata pairs with their raw bytes, tensor infos) without judging it: the synthetic writer and
the tests read deliberately broken files through it.

Shapes are given in numpy order (rows first): a GGUF tensor with ``ne = [n_cols, n_rows]`` has
``shape = (n_rows, n_cols)`` and is stored row-major, each row a run of quant blocks.

Slot layout. A layer travels as one buffer (a *slot*): for each file span of the layer (one,
unless a split set cuts the layer), a region of whole ``DIRECT_ALIGN_BYTES`` units that holds the
span's bytes starting at ``span.offset % DIRECT_ALIGN_BYTES``, so an O_DIRECT read of the aligned
superset lands every byte at the same place a buffered read would. ``Span`` is the one place that
says where a span's bytes sit (``slot_start``, ``bytes_in``, ``region_in``); every reader (the
reader daemon, ``layer_bytes``, bench) fills a slot through it, and ``LayerInfo.slot_offset(name)``
is where a tensor's bytes start in that buffer, whoever filled it.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ntx.shared.align import DIRECT_ALIGN_BYTES, round_up
from ntx.shared.errors import ModelError
from ntx.shared.quant_types import SUPPORTED_TYPES, quant_type, tensor_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

SUPPORTED_ARCHS = ("llama",)

# GGUF metadata value types (gguf spec): id -> (struct format, size) for scalars.
_SCALAR_FORMATS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_TYPE_STRING, _TYPE_ARRAY = 8, 9

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)\.weight$")

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)


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
        """The span's bytes inside a slot-layout buffer: a [nbytes] view of ``slot``."""
        return slot[self.slot_start : self.slot_start + self.nbytes]

    def region_in(self, slot: np.ndarray) -> np.ndarray:
        """The span's aligned region inside a slot-layout buffer, which an O_DIRECT read of the
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
    def slot_bytes(self) -> int:
        """Size of a slot buffer that holds this layer in the slot layout."""
        return sum(s.region_bytes for s in self.spans)

    def slot_offset(self, name: str) -> int:
        """Offset of tensor ``name``'s first byte inside the layer's slot buffer."""
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

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class ModelIndex:
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
        return str(self.metadata.get("general.name") or Path(self.path).stem)

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
    def max_layer_slot_bytes(self) -> int:
        return max(layer.slot_bytes for layer in self.layers)

    @property
    def layer_bytes_total(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def global_bytes_total(self) -> int:
        return sum(t.nbytes for t in self.globals.values())


class _HeaderCursor:
    """Sequential little-endian reads from a file's mapping, with truncation reported as such."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

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

    def string(self, what: str) -> str:
        n = self.u64(what)
        self._need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int, what: str) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id, what)
        if type_id == _TYPE_STRING:
            return self.string(what)
        if type_id == _TYPE_ARRAY:
            elem_type = self.u32(what)
            count = self.u64(what)
            if elem_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[elem_type]).newbyteorder("<")
                self._need(count * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr.tolist()
            if elem_type == _TYPE_STRING:
                return [self.string(what) for _ in range(count)]
            if elem_type == _TYPE_ARRAY:
                return [self.value(_TYPE_ARRAY, what) for _ in range(count)]
            raise ModelError(self.path, f"bad metadata value type {elem_type} in {what}")
        raise ModelError(self.path, f"bad metadata value type {type_id} in {what}")


@dataclass(frozen=True)
class HeaderKV:
    """One metadata pair as the file holds it: the decoded value and the encoded bytes (key, type
    and value), which a tool can copy verbatim into another file (gguf-split, a tokenizer copy)."""

    key: str
    type_id: int  # a GGUFValueType
    value: Any
    raw: bytes


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


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse one GGUF file's header (through a read-only mmap: no tensor data is read).

    Raises ``ModelError`` only for what makes the header itself unreadable (missing file, bad
    magic, unsupported version, truncation inside the header, bad alignment); what the header
    says is not checked here.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ModelError(path, "no such file") from None
    except IsADirectoryError:
        raise ModelError(path, "is a directory, not a GGUF file") from None
    except PermissionError:
        raise ModelError(path, "permission denied") from None
    try:
        size = os.fstat(fd).st_size
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
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ModelError(path, f"corrupt header: {n_tensors} tensors, {n_kv} metadata keys")
    kvs = []
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}")
        type_id = cur.u32(f"metadata {key}")
        value = cur.value(type_id, f"metadata {key}")
        kvs.append(HeaderKV(key, type_id, value, bytes(buf[start : cur.pos])))
    alignment_kv = next((kv for kv in reversed(kvs) if kv.key == "general.alignment"), None)
    alignment = int(alignment_kv.value) if alignment_kv is not None else DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(path, f"bad general.alignment {alignment}")

    tensors = []
    for i in range(n_tensors):
        name = cur.string(f"tensor info #{i}")
        n_dims = cur.u32(f"tensor {name}")
        if not 1 <= n_dims <= 4:
            raise ModelError(path, f"tensor {name} has {n_dims} dimensions")
        ne = tuple(cur.u64(f"tensor {name}") for _ in range(n_dims))
        type_id = cur.u32(f"tensor {name}")
        rel_offset = cur.u64(f"tensor {name}")
        tensors.append(HeaderTensor(name, ne, type_id, rel_offset))
    return GGUFHeader(path, version, tuple(kvs), tuple(tensors), alignment, round_up(cur.pos, alignment), size)


def _file_tensors(header: GGUFHeader) -> list[TensorInfo]:
    """The file's tensors with absolute offsets, each checked: a unique name, a type ntx reads,
    whole blocks per row, and data that the file really holds."""
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
        block_elems = quant_type(gtype).block_elems
        if h.ne[0] % block_elems:
            raise ModelError(
                path, f"tensor {name}: row length {h.ne[0]} is not a multiple of the {gtype.name} block ({block_elems})"
            )
        nbytes = h.nbytes
        offset = header.data_start + h.rel_offset
        if offset + nbytes > header.file_bytes:
            raise ModelError(
                path,
                f"truncated file: tensor {name} ends at byte {offset + nbytes} but the file has {header.file_bytes} bytes",
            )
        tensors.append(TensorInfo(name, gtype, tuple(int(d) for d in reversed(h.ne)), path, offset, nbytes))
    return tensors


def model_file_paths(path: str | os.PathLike) -> list[str]:
    """The files ``open_model(path)`` reads: the file itself, or every shard of its split set."""
    return _split_paths(os.fspath(path))


def _split_paths(path: str) -> list[str]:
    """All shard paths of a split set that ``path`` belongs to, or [path]."""
    m = _SPLIT_RE.match(os.path.basename(path))
    if not m:
        return [path]
    count = int(m["count"])
    folder = os.path.dirname(path)
    paths = [os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not os.path.exists(p):
            raise ModelError(path, f"split set is missing shard {os.path.basename(p)}")
    return paths


def _hparams(path: str, md: dict[str, Any], globals_: dict[str, TensorInfo], n_layers_found: int) -> HParams:
    arch = md.get("general.architecture")

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required and default is None:
            raise ModelError(path, f"missing metadata key {full}")
        return default

    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    if n_head <= 0 or n_embd % n_head:
        raise ModelError(path, f"embedding length {n_embd} is not divisible by head count {n_head}")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ModelError(path, f"head count {n_head} is not a multiple of KV head count {n_head_kv}")
    head_dim = int(get("attention.key_length", n_embd // n_head))
    rope_dim = int(get("rope.dimension_count", head_dim))
    scaling_kind = str(get("rope.scaling.type", "none"))
    if "rope_freqs" in globals_:
        scaling_kind = "llama3"
    scaling = RopeScaling(
        kind=scaling_kind,
        factor=float(get("rope.scaling.factor", 1.0)),
        original_context=int(get("rope.scaling.original_context_length", 0)),
    )
    embd = globals_["token_embd"]
    n_vocab = int(get("vocab_size", embd.shape[0]))
    n_layers = int(get("block_count"))
    if n_layers != n_layers_found:
        raise ModelError(path, f"{arch}.block_count says {n_layers} layers but the file has blk.0..{n_layers_found - 1}")
    return HParams(
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=int(get("feed_forward_length")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dim=rope_dim,
        rope_scaling=scaling,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        n_ctx_train=int(get("context_length", 4096)),
        n_vocab=n_vocab,
        tied_embeddings="output" not in globals_,
    )


def _expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    d, f = hp.n_embd, hp.n_ff
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
    }


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
    unusable, so nothing downstream ever sees a half-valid model.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ModelError(path, "is a directory, not a GGUF file")
    if not os.path.exists(path):
        raise ModelError(path, "no such file")
    paths = _split_paths(path)
    headers = [read_header(p) for p in paths]
    md = headers[0].metadata
    if len(paths) > 1:
        count = md.get("split.count")
        if count is not None and int(count) != len(paths):
            raise ModelError(paths[0], f"split.count is {count} but the set has {len(paths)} shards")

    arch = md.get("general.architecture")
    if arch is None:
        raise ModelError(paths[0], "missing metadata key general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(paths[0], f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    all_tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in _file_tensors(h):
            if t.name in all_tensors:
                raise ModelError(h.path, f"duplicate tensor name {t.name}")
            all_tensors[t.name] = t

    globals_: dict[str, TensorInfo] = {}
    layer_tensors: dict[int, dict[str, TensorInfo]] = {}
    for name, t in all_tensors.items():
        m = _LAYER_RE.match(name)
        if m:
            layer_tensors.setdefault(int(m[1]), {})[m[2]] = t
        elif name.endswith(".weight"):
            globals_[name[: -len(".weight")]] = t
    for g in ("token_embd", "output_norm"):
        if g not in globals_:
            raise ModelError(paths[0], f"missing tensor {g}.weight")

    n_layers_found = (max(layer_tensors) + 1) if layer_tensors else 0
    hp = _hparams(paths[0], md, globals_, n_layers_found)
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
                raise ModelError(paths[0], f"missing tensor blk.{i}.{short}.weight")
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
