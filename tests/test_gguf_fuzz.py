"""Fuzzing the GGUF index (issue 12 item 9): thousands of mutations of small valid models per
run — byte flips, truncations, metadata values swapped for hostile ones, tensor records bent —
each either indexed into a model whose every used value is sane, or refused with one printable
``ModelError`` line. Any other exception, or a message carrying a control character, fails.

Each run draws a fresh seed (a fixed one with ``NTX_FUZZ_SEED=N``; ``NTX_FUZZ_CASES`` sets the
count); a failure names the seed and the case, and ``NTX_FUZZ_SEED=S NTX_FUZZ_CASES=I+1``
replays it (case i depends only on the seed and i).
"""

from __future__ import annotations

import copy
import math
import os
import random
import struct

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.errors import ModelError, NtxError
from ntx.shared.gguf_index import MAX_CONTEXT, ModelIndex, open_model

try:
    from . import synth_models as sm
    from .gguf_mutate import GGUFParts
except ImportError:  # tests/ is not a package
    import synth_models as sm
    from gguf_mutate import GGUFParts

SEED = int(os.environ.get("NTX_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
CASES = int(os.environ.get("NTX_FUZZ_CASES") or 3000)

_INTS = [0, 1, 2, 3, 7, 31, 32, 63, 64, 256, 4095, 4096, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
         1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
_FLOATS = [0.0, -0.0, 1e-45, 1e-5, 1.0, -1.0, 1e38, 3.4e38, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324]
_STRINGS = ["", "llama", "gpt2", "smollm", "none", "linear", "32", "nan", "\x1b[31m", "\nFAKE: model OK",
            "\u202e", "a" * 300, "9" * 5000, "\x00", "\ufffd"]
_NAMES = [b"blk." + b"9" * 5000 + b".attn_q.weight", b"blk.007.attn_q.weight", b"blk.-1.attn_q.weight",
          b"blk.4096.attn_q.weight", b"blk.2.attn_q.weight", b"blk.0.attn_q.weight\n", "blk.\u0661.attn_q.weight".encode(),
          b"\x1b[2J\nFAKE: model OK", b"\xff\xfe", b"", b"output.weight", b"rope_freqs.weight", b"token_embd.weight",
          b"blk.0.attn_q.weight", b"x" * 63, b"x" * 64]
_VALUE_TYPES = [VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.FLOAT32, VT.BOOL, VT.UINT64,
                VT.INT64, VT.FLOAT64, VT.STRING]
_RANGES = {VT.UINT8: (0, 255), VT.INT8: (-128, 127), VT.UINT16: (0, 65535), VT.INT16: (-32768, 32767),
           VT.UINT32: (0, (1 << 32) - 1), VT.INT32: (-(1 << 31), (1 << 31) - 1), VT.UINT64: (0, (1 << 64) - 1),
           VT.INT64: (-(1 << 63), (1 << 63) - 1)}


def _scalar(rng: random.Random, vtype: VT):
    if vtype == VT.STRING:
        return rng.choice(_STRINGS)
    if vtype == VT.BOOL:
        return rng.random() < 0.5
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        return rng.choice(_FLOATS) if rng.random() < 0.8 else rng.uniform(-1e6, 1e6)
    lo, hi = _RANGES[vtype]
    v = rng.choice(_INTS + [-1, -(1 << 31)]) if rng.random() < 0.8 else rng.randint(lo, hi)
    return min(max(v, lo), hi)


_NUMPY = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4", VT.INT32: "<i4",
          VT.FLOAT32: "<f4", VT.BOOL: "?", VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8"}


def _packed(vtype: VT, values: list) -> bytes:
    """Scalars of one GGUF type as the file stores them (a float32 too large becomes inf)."""
    if vtype == VT.STRING:
        return b"".join(struct.pack("<Q", len(b)) + b for b in (v.encode() for v in values))
    with np.errstate(over="ignore"):
        return np.array(values, dtype=_NUMPY[vtype]).tobytes()


def _encode_value(rng: random.Random) -> bytes:
    """A random value's type id and bytes: a scalar, a string, or an array (possibly nested)."""
    r = rng.random()
    if r < 0.75:
        vtype = rng.choice(_VALUE_TYPES)
        return struct.pack("<I", vtype) + _packed(vtype, [_scalar(rng, vtype)])
    if r < 0.95:
        etype = rng.choice(_VALUE_TYPES)
        n = rng.choice([0, 1, 2, 10, 500, 512, 513])
        return struct.pack("<IIQ", VT.ARRAY, etype, n) + _packed(etype, [_scalar(rng, etype) for _ in range(n)])
    if r < 0.98:
        return struct.pack("<IIQIIQ", VT.ARRAY, VT.ARRAY, 1, VT.ARRAY, VT.UINT8, 0)  # nested
    return struct.pack("<IIQ", VT.ARRAY, VT.STRING, rng.choice(_INTS))  # a count with nothing behind it


def _key_of(raw: bytes) -> bytes:
    (n,) = struct.unpack_from("<Q", raw)
    return raw[8 : 8 + n]


def _with_value(key: bytes, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + value


# -- mutations: each changes the parts in place and returns a short description ----------------------


def m_kv_value(rng, p):
    i = rng.randrange(len(p.kvs))
    key = _key_of(p.kvs[i])
    p.kvs[i] = _with_value(key, _encode_value(rng))
    return f"value of {key!r}"


def m_kv_swap(rng, p):
    i, j = rng.randrange(len(p.kvs)), rng.randrange(len(p.kvs))
    key_i = _key_of(p.kvs[i])
    p.kvs[i] = _with_value(key_i, p.kvs[j][8 + len(_key_of(p.kvs[j])) :])
    return f"value of {key_i!r} from {_key_of(p.kvs[j])!r}"


def m_kv_key(rng, p):
    i = rng.randrange(len(p.kvs))
    key = rng.choice([_key_of(p.kvs[rng.randrange(len(p.kvs))]), rng.choice(_STRINGS).encode(), b"general.alignment",
                      b"llama.rope.scaling.type", b"llama.attention.key_length", b"tokenizer.ggml.scores"])
    p.kvs[i] = _with_value(key, p.kvs[i][8 + len(_key_of(p.kvs[i])) :])
    return f"key #{i} renamed {key[:40]!r}"


def m_kv_drop_or_copy(rng, p):
    i = rng.randrange(len(p.kvs))
    if rng.random() < 0.5:
        return f"dropped {_key_of(p.kvs.pop(i))!r}"
    p.kvs.insert(rng.randrange(len(p.kvs) + 1), p.kvs[i])
    return f"copied {_key_of(p.kvs[i])!r}"


def m_alignment(rng, p):
    vtype = rng.choice(_VALUE_TYPES)
    v = _scalar(rng, vtype)
    raw = _with_value(b"general.alignment", struct.pack("<I", vtype) + _packed(vtype, [v]))
    try:
        p.kvs[p.key_index("general.alignment")] = raw
    except KeyError:
        p.kvs.append(raw)
    return f"general.alignment = {vtype.name} {v!r}"


def m_tensor_name(rng, p):
    t = rng.choice(p.tensors)
    old, t.name = t.name, rng.choice(_NAMES + [rng.choice(p.tensors).name])
    return f"tensor {old!r} renamed {t.name[:40]!r}"


def m_tensor_ne(rng, p):
    t = rng.choice(p.tensors)
    if rng.random() < 0.2 or not t.ne:  # (an earlier mutation may have left no dimension)
        t.ne = [rng.choice(_INTS) for _ in range(rng.choice([0, 1, 2, 3, 4, 5]))]
    else:
        # (doubling stays a uint64: an earlier mutation may have left 2^64 - 1 there; seed 1922309397)
        t.ne[rng.randrange(len(t.ne))] = rng.choice(_INTS + [min(t.ne[0] * 2, (1 << 64) - 1), t.ne[-1] // 2])
    return f"tensor {t.name!r} ne {t.ne}"


def m_tensor_type(rng, p):
    t = rng.choice(p.tensors)
    t.type_id = rng.choice([0, 1, 2, 3, 6, 7, 8, 10, 12, 13, 14, 16, 30, 39, 40, 1000, (1 << 32) - 1])
    return f"tensor {t.name!r} type {t.type_id}"


def m_tensor_offset(rng, p):
    t = rng.choice(p.tensors)
    t.rel_offset = rng.choice([0, 1, 32, t.rel_offset + 32, t.rel_offset - 32, rng.choice(p.tensors).rel_offset,
                               (1 << 64) - 1, (1 << 63), len(p.data)])
    t.rel_offset %= 1 << 64
    return f"tensor {t.name!r} offset {t.rel_offset}"


def m_counts(rng, p):
    p.counts = (rng.choice([0, len(p.tensors) - 1, len(p.tensors) + 1, 1 << 16, (1 << 64) - 1]),
                rng.choice([0, len(p.kvs) - 1, len(p.kvs) + 1, (1 << 20) + 1, (1 << 64) - 1]))
    return f"counts {p.counts}"


def m_version(rng, p):
    p.version = rng.choice([0, 1, 2, 4, (1 << 32) - 1])
    return f"version {p.version}"


PARTS_MUTATIONS = [m_kv_value, m_kv_value, m_kv_swap, m_kv_key, m_kv_drop_or_copy, m_alignment, m_tensor_name,
                   m_tensor_ne, m_tensor_type, m_tensor_offset, m_tensor_offset, m_counts, m_version]


def mutate(rng: random.Random, base: GGUFParts) -> tuple[bytes, int, list[str]]:
    """A mutated file: its header bytes (data section cut off), its full size, what was done."""
    p = copy.deepcopy(base)
    p.data = b""
    done = [m(rng, p) for m in rng.choices(PARTS_MUTATIONS, k=rng.choice([1, 1, 2, 3]))] if rng.random() < 0.8 else []
    head = bytearray(p.encode())
    size = len(head) + len(base.data)
    if rng.random() < 0.3 or not done:  # byte flips anywhere in the header
        for _ in range(rng.choice([1, 2, 4, 16])):
            at = rng.randrange(len(head))
            head[at] = rng.randrange(256) if rng.random() < 0.5 else head[at] ^ (1 << rng.randrange(8))
            done.append(f"byte {at} = {head[at]}")
    if rng.random() < 0.15:  # truncation, in the header or in the data
        size = rng.randrange(size)
        done.append(f"truncated to {size}")
    return bytes(head[:size]), size, done


def check_sane(idx: ModelIndex) -> None:
    """What an index that was not refused promises: every value in range, every tensor in its file."""
    hp = idx.hparams
    assert math.isfinite(hp.rms_eps) and 0 < hp.rms_eps <= 1, hp
    assert math.isfinite(hp.rope_base) and hp.rope_base >= 1, hp
    assert hp.rope_dim % 2 == 0 and 0 < hp.rope_dim <= hp.head_dim, hp
    assert 0 < hp.n_ctx_train <= MAX_CONTEXT and hp.n_layers == len(idx.layers) > 0, hp
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for t in [*idx.globals.values(), *(t for layer in idx.layers for t in layer.tensors.values())]:
        assert 0 < t.nbytes and t.offset + t.nbytes <= os.path.getsize(t.path), f"tensor {t.name} outside its file"
        ranges.setdefault(t.path, []).append((t.offset, t.offset + t.nbytes, t.name))
    for spans in ranges.values():
        spans.sort()
        for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
            assert a_end <= b_start, f"tensors {a} and {b} overlap"
    assert idx.name.isprintable() and idx.file_type and idx.max_layer_image_bytes > 0


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two small valid models: the tiny one (tied, Q4_K_M), and one with an output head,
    rope_freqs and a 64-byte alignment."""
    d = tmp_path_factory.mktemp("fuzz-base")
    return [GGUFParts.of(sm.write_tiny(d, "a.gguf")),
            GGUFParts.of(sm.write_tiny(d, "b.gguf", type="Q8_0", tied_embeddings=False, rope_freqs=True, alignment=64))]


def test_mutated_files_raise_only_one_printable_model_error_line(tmp_path, bases, record_property):
    record_property("fuzz_seed", SEED)
    print(f"GGUF fuzz: seed {SEED}, {CASES} cases (NTX_FUZZ_SEED={SEED} replays them)")
    path = tmp_path / "fuzzed.gguf"
    outcomes = {"indexed": 0, "refused": 0}
    for case in range(CASES):
        rng = random.Random(f"{SEED}:{case}")
        head, size, done = mutate(rng, bases[case % len(bases)])
        where = f"NTX_FUZZ_SEED={SEED} case {case}: {'; '.join(done)}"
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)  # the data section as a hole: the index must not read it
        try:
            idx = open_model(path)
        except ModelError as e:
            msg = str(e)
            assert msg.isprintable() and msg.startswith(f"{path}: ") and len(msg) < 1000, f"{where}: {msg!r}"
            outcomes["refused"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{where}: {type(e).__name__} escaped the index: {e!r}")
        outcomes["indexed"] += 1
        try:
            check_sane(idx)
        except AssertionError as e:
            raise AssertionError(f"{where}: indexed, but {e}") from e
        try:
            Tokenizer.from_metadata(idx.metadata)
        except NtxError as e:
            assert str(e).isprintable(), f"{where}: {str(e)!r}"
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{where}: {type(e).__name__} escaped the tokenizer: {e!r}")
    print(f"GGUF fuzz: {outcomes}")
    assert outcomes["refused"] > CASES // 2 and outcomes["indexed"] > 0, outcomes  # the mutations bite, not all
