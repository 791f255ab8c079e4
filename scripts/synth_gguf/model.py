"""A whole synthetic Llama GGUF from a ``SynthConfig``: ``write_llama_gguf``.

It ties the seams together: the tensor plan (``plan``) says what to write, the checked block
pools (``blocks``) supply every matrix byte, ``vocab`` the tokenizer pairs, and ``gguf_file``
writes the file (or a gguf-split set directly); a ``Breakage`` bends the plan or the header
into a file the loader must reject.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType as VT, LlamaFileType

from ntx.shared.align import round_up
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.gguf_index import DEFAULT_ALIGNMENT, GGUF_MAGIC

from .blocks import Pool, Pools, llama31_rope_factors, make_blocks
from .config import Breakage, SynthConfig, resolve_breakage
from .gguf_file import (GGUF_VERSION, TensorEntry, encode_kv, progress_bar, raw_key, split_kvs,
                        split_names, partition, write_all, write_gguf)
from .plan import TensorSpec, tensor_plan
from .vocab import minimal_tokenizer_kvs, tokenizer_kvs_from

# general.file_type of each type choice, as llama.cpp names the mixes.
_FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
}


def _small_tensor(spec: TensorSpec, cfg: SynthConfig) -> bytes:
    """Data of a 1-D F32 tensor (norm weights, rope_freqs or a Qwen2 bias)."""
    if spec.name == "rope_freqs.weight":
        return llama31_rope_factors(cfg.hd, cfg.rope_base).astype("<f4").tobytes()
    h = hashlib.blake2b(f"{cfg.seed}/{spec.name}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(h, "little"))
    n = math.prod(spec.shape)
    if spec.name.endswith(".bias"):  # Qwen2's q, k, v biases: centred, about as large as the products
        return (0.5 * rng.standard_normal(n)).astype("<f4").tobytes()
    if spec.qtype == QT.F32:
        return (1.0 + 0.05 * rng.standard_normal(n)).astype("<f4").tobytes()
    return make_blocks(spec.qtype, spec.nbytes // GGML_QUANT_SIZES[QT(spec.qtype)][1],
                       1.0, rng).tobytes()


def _pool_writer(pool: Pool, nbytes: int, start_block: int,
                 chunk: int = 64 << 20) -> Callable[[int], None]:
    """Write ``nbytes`` by tiling the pool from ``start_block`` (a per-tensor rotation)."""
    def write(fd: int) -> None:
        mv = memoryview(pool.data)
        plen = len(mv)
        pos = (start_block % pool.nblocks) * pool.type_size
        left = nbytes
        while left:  # gather pool pieces into writes of about `chunk` bytes
            pieces = []
            size = 0
            while left and size < chunk:
                n = min(plen - pos, left)
                pieces.append(mv[pos:pos + n])
                size += n
                left -= n
                pos = (pos + n) % plen
            write_all(fd, pieces)
    return write


def _bytes_writer(data: bytes) -> Callable[[int], None]:
    return lambda fd: write_all(fd, [data])


def _start_block(seed: int, name: str) -> int:
    """Where in its pool a tensor's tiling starts (so tensors of one kind differ)."""
    h = hashlib.blake2b(f"{seed}/start/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def _metadata_kvs(cfg: SynthConfig, br: Breakage, tok_kvs: list[bytes]) -> list[bytes]:
    """The model's metadata pairs (less the key a breakage drops), tokenizer pairs last."""
    c = cfg
    kvs: list[tuple[str, VT, object]] = [
        ("general.architecture", VT.STRING, br.arch if br.arch is not None else c.arch),
        ("general.type", VT.STRING, "model"),
        ("general.name", VT.STRING, c.name),
        ("general.description", VT.STRING,
         f"synthetic Llama model with random weights (ntx synth_gguf, seed {c.seed})"),
        ("general.file_type", VT.UINT32, int(_FILE_TYPE[c.type])),
        ("general.quantization_version", VT.UINT32, 2),
    ]
    if c.alignment != DEFAULT_ALIGNMENT:
        kvs.append(("general.alignment", VT.UINT32, c.alignment))
    a = c.arch  # the keys' prefix
    kvs += [
        (a + ".block_count", VT.UINT32, c.n_layers),
        (a + ".context_length", VT.UINT32, c.context_length),
        (a + ".embedding_length", VT.UINT32, c.d_model),
        (a + ".feed_forward_length", VT.UINT32, c.d_ff),
        (a + ".attention.head_count", VT.UINT32, c.n_heads),
        (a + ".attention.head_count_kv", VT.UINT32, c.n_kv_heads),
        (a + ".rope.freq_base", VT.FLOAT32, float(c.rope_base)),
        (a + ".attention.layer_norm_rms_epsilon", VT.FLOAT32, float(c.rms_eps)),
        (a + ".vocab_size", VT.UINT32, c.vocab_size),
        (a + ".rope.dimension_count", VT.UINT32, c.hd),
    ]
    if c.head_dim is not None:
        kvs += [(a + ".attention.key_length", VT.UINT32, c.hd),
                (a + ".attention.value_length", VT.UINT32, c.hd)]
    out = [encode_kv(k, t, v) for k, t, v in kvs if k != br.drop_key]
    out += [raw for raw in tok_kvs if raw_key(raw) != br.drop_key]
    return out


def _broken_plan(plan: list[TensorSpec], br: Breakage) -> list[TensorSpec]:
    """The plan with a breakage's tensor-level changes: dropped, duplicated, retyped (rows
    widened to the forced type's block) or reshaped tensors."""
    specs: list[TensorSpec] = []
    for t in plan:
        if t.name == br.drop_tensor:
            continue
        if br.tensor_type and t.name in br.tensor_type:
            qt = QT[br.tensor_type[t.name]]
            block_elems = GGML_QUANT_SIZES[qt][0]  # any gguf type, not only those ntx reads
            t = dataclasses.replace(t, qtype=int(qt), shape=(round_up(t.shape[0], block_elems), *t.shape[1:]))
        if t.name == br.wrong_shape:
            shape = (t.shape[0], max(1, t.shape[1] // 2), *t.shape[2:]) if len(t.shape) > 1 \
                else (t.shape[0] // 2,)
            t = dataclasses.replace(t, shape=shape)
        specs.append(t)
        if t.name == br.duplicate_tensor:
            specs.append(t)
    return specs


@dataclass
class WriteStats:
    """What one ``write_llama_gguf`` call wrote, and how fast."""

    paths: list[pathlib.Path]
    bytes_written: int
    seconds: float
    plan: list[TensorSpec] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / max(self.seconds, 1e-9)


def write_llama_gguf(path: str | os.PathLike, config: SynthConfig, *,
                     breakage: Breakage | str | None = None, split: int = 1,
                     progress: bool = False, stats: list | None = None) -> pathlib.Path:
    """Write a synthetic Llama GGUF; returns its path (for ``split > 1``, the first shard's).

    ``breakage`` (a :class:`Breakage` or a key of ``BREAKAGES``) makes a file the loader
    must reject. ``split > 1`` writes a gguf-split set ``NAME-0000i-of-0000N.gguf`` directly.
    ``stats``, if a list, receives one :class:`WriteStats`.
    """
    cfg = config
    br = resolve_breakage(breakage)
    path = pathlib.Path(path)
    t0 = time.perf_counter()
    if cfg.tokenizer_from is not None:
        tok_kvs, n_vocab = tokenizer_kvs_from(cfg.tokenizer_from)
        if n_vocab != cfg.vocab_size:
            raise ConfigError(
                f"the tokenizer of {cfg.tokenizer_from} has {n_vocab} tokens but the model's "
                f"vocab_size is {cfg.vocab_size}; set vocab_size={n_vocab} (--vocab {n_vocab})")
    else:
        tok_kvs = minimal_tokenizer_kvs(cfg.vocab_size)
    plan = tensor_plan(cfg)
    for name in (br.drop_tensor, br.duplicate_tensor, br.wrong_shape, *(br.tensor_type or {})):
        if name is not None and name not in {t.name for t in plan}:
            raise ConfigError(f"breakage names tensor {name!r}, which this model does not have")

    specs = _broken_plan(plan, br)

    pools = Pools(cfg.seed)

    def entry(t: TensorSpec) -> TensorEntry:
        nbytes = t.nbytes
        if len(t.shape) < 2:
            return TensorEntry(t.name, t.shape, t.qtype, nbytes, _bytes_writer(_small_tensor(t, cfg)))
        pool = pools.get(t.qtype, t.std)
        return TensorEntry(t.name, t.shape, t.qtype, nbytes,
                           _pool_writer(pool, nbytes, _start_block(cfg.seed, t.name)))

    entries = [entry(t) for t in specs]
    meta = _metadata_kvs(cfg, br, tok_kvs)
    version = br.version if br.version is not None else GGUF_VERSION
    magic = b"GGUX" if br.bad_magic else GGUF_MAGIC
    total = sum(round_up(e.nbytes, cfg.alignment) for e in entries)

    if split > 1:
        paths = split_names(path, split)
        groups = partition([e.nbytes for e in entries], split)
    else:
        paths = [path]
        groups = [(0, len(entries))]
    written = 0
    label = f"writing {paths[0].name}" + (f" (+{split - 1} shards)" if split > 1 else "")
    try:
        with progress_bar(total, label, progress) as advance:
            for i, (p, (a, b)) in enumerate(zip(paths, groups)):
                if split > 1:
                    kvs = (meta if i == 0 else []) + split_kvs(i, split, len(entries))
                    if i > 0 and cfg.alignment != DEFAULT_ALIGNMENT:
                        kvs.append(encode_kv("general.alignment", VT.UINT32, cfg.alignment))
                else:
                    kvs = meta
                written += write_gguf(p, kvs, entries[a:b], version=version, magic=magic,
                                      alignment=cfg.alignment, advance=advance)
    except BaseException as e:  # disk full, Ctrl-C: leave no half-written model behind
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()
        if isinstance(e, OSError):
            raise NtxError(f"cannot write {e.filename or paths[0]}: {e.strerror or e}") from e
        raise
    if br.truncate is not None:
        last = paths[-1]
        cut = br.truncate if br.truncate >= 0 else max(1, entries[groups[-1][1] - 1].nbytes // 2)
        size = last.stat().st_size
        os.truncate(last, max(0, size - cut))
        written -= min(cut, size)
    if stats is not None:
        stats.append(WriteStats(paths, written, time.perf_counter() - t0, plan))
    return paths[0]
