"""The GGUF index (shared/gguf_index.py): hyper-parameters, tensor offsets, layer spans and the
image layout, checked against gguf-py's independent parser; split sets; and every way a file can
be unusable, each ending as one ``ModelError`` line (and one ``ntxctl: error:`` line)."""

from __future__ import annotations

import array
import copy
import os
import pathlib
import resource
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import GGUFValueType as VT

import synth_gguf as sg
from ntx.ctl import cli
from ntx.shared.align import DIRECT_ALIGN_BYTES
from ntx.shared.errors import ModelError, NtxError
from ntx.shared.gguf_index import ModelIndex, open_model, read_header

try:
    from . import synth_models as sm
    from .gguf_mutate import GGUFParts
    from .pipeline_util import own_instance
except ImportError:  # tests/ is not a package
    import synth_models as sm
    from gguf_mutate import GGUFParts
    from pipeline_util import own_instance

data_region_start, gguf_reader, reader_meta = sm.data_region_start, sm.gguf_reader, sm.reader_meta
tiny_config, write_header_only_gguf, write_tiny = sm.tiny_config, sm.write_header_only_gguf, sm.write_tiny


# ---------------------------------------------------------------------------------------------
# Helpers


def all_tensors(idx: ModelIndex) -> dict:
    out = {f"{name}.weight": t for name, t in idx.globals.items()}
    for layer in idx.layers:
        for short, t in layer.tensors.items():  # "attn_q.weight" is kept as "attn_q", a bias as "attn_q.bias"
            out[f"blk.{layer.index}.{short}" + ("" if short.endswith(".bias") else ".weight")] = t
    return out


def check_against_gguf_py(idx: ModelIndex) -> None:
    """Every tensor of the index has the name, type, shape, absolute offset and byte count that
    gguf-py's GGUFReader gives for the file it is in, and the index has no tensor gguf-py lacks."""
    ours = all_tensors(idx)
    theirs = {}
    for p in idx.paths:
        for t in gguf_reader(p).tensors:
            assert t.name not in theirs
            theirs[t.name] = (p, t)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        p, r = theirs[name]
        assert t.path == p, name
        assert t.ggml_type == r.tensor_type, name
        assert t.shape == tuple(int(d) for d in reversed(r.shape.tolist())), name
        assert t.offset == r.data_offset, name
        assert t.nbytes == r.n_bytes, name


def check_spans_and_slots(idx: ModelIndex, alignment: int = 32) -> None:
    """Each layer's spans cover exactly its tensors, one span per file, and ``image_offset`` maps
    every tensor to where its bytes land when the spans are laid out in the image layout."""
    tensors = all_tensors(idx)
    file_bytes = {p: np.memmap(p, dtype=np.uint8, mode="r") for p in idx.paths}
    for layer in idx.layers:
        ts = list(layer.tensors.values())
        assert sorted(layer.tensors) == sorted(
            ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
            + (["attn_q.bias", "attn_k.bias", "attn_v.bias"] if idx.hparams.qkv_bias else []))
        assert sorted(s.path for s in layer.spans) == sorted({t.path for t in ts})  # one span per file
        for s in layer.spans:
            mine = [t for t in ts if t.path == s.path]
            assert s.offset == min(t.offset for t in mine)
            assert s.offset + s.nbytes == max(t.offset + t.nbytes for t in mine)
            # only alignment padding between this layer's tensors
            assert s.nbytes - sum(t.nbytes for t in mine) < alignment * len(mine)
            for name, other in tensors.items():  # no other tensor inside the span
                if other.path == s.path and not name.startswith(f"blk.{layer.index}."):
                    assert other.offset + other.nbytes <= s.offset or other.offset >= s.offset + s.nbytes, name
            assert s.slot_base % DIRECT_ALIGN_BYTES == 0
            assert s.head == s.offset % DIRECT_ALIGN_BYTES
            assert s.region_bytes % DIRECT_ALIGN_BYTES == 0 and s.region_bytes >= s.head + s.nbytes
        # regions tile the slot buffer without overlap
        bases = sorted((s.slot_base, s.region_bytes) for s in layer.spans)
        pos = 0
        for base, size in bases:
            assert base == pos
            pos += size
        assert pos == layer.image_bytes
        # fill a slot buffer from the spans (what a reader does) and find every tensor in it
        slot = np.zeros(layer.image_bytes, dtype=np.uint8)
        for s in layer.spans:
            slot[s.slot_base + s.head : s.slot_base + s.head + s.nbytes] = file_bytes[s.path][s.offset : s.offset + s.nbytes]
        for short, t in layer.tensors.items():
            off = layer.image_offset(short)
            assert 0 <= off and off + t.nbytes <= layer.image_bytes
            want = file_bytes[t.path][t.offset : t.offset + t.nbytes]
            assert np.array_equal(slot[off : off + t.nbytes], want), f"layer {layer.index} {short}"
    assert idx.max_layer_image_bytes == max(layer.image_bytes for layer in idx.layers)


def run_cli_inprocess(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``ntxctl ARGS`` through the console entry point, in this process."""
    monkeypatch.setattr(sys, "argv", ["ntxctl", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ntx.ctl.cli", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_error_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ntxctl: error: ")
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ---------------------------------------------------------------------------------------------
# The real model


@pytest.fixture(scope="module")
def smol_index(smollm2_path) -> ModelIndex:
    return open_model(smollm2_path)


def test_smollm2_hparams(smol_index, smollm2_path):
    hp = smol_index.hparams
    assert smol_index.architecture == "llama"
    assert smol_index.paths == (str(smollm2_path),)
    assert (hp.n_layers, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv) == (30, 576, 1536, 9, 3)
    assert (hp.head_dim, hp.rope_dim, hp.q_dim, hp.kv_dim) == (64, 64, 576, 192)
    assert hp.n_vocab == 49152
    assert hp.rope_base == 100000.0
    assert hp.rope_scaling.kind == "none"
    assert hp.rms_eps == pytest.approx(1e-5)
    assert hp.n_ctx_train == 8192
    assert hp.tied_embeddings and "output" not in smol_index.globals
    assert smol_index.file_type == "Q4_1"
    assert {t.type_name for layer in smol_index.layers for t in layer.tensors.values() if len(t.shape) == 2} == {"Q4_1"}
    assert set(smol_index.globals) == {"token_embd", "output_norm"}
    # the same facts as gguf-py reads them
    r = gguf_reader(smollm2_path)
    assert reader_meta(r, "llama.block_count") == hp.n_layers
    assert reader_meta(r, "llama.embedding_length") == hp.n_embd
    assert reader_meta(r, "llama.attention.head_count_kv") == hp.n_head_kv
    assert reader_meta(r, "llama.rope.freq_base") == hp.rope_base
    assert smol_index.metadata["general.architecture"] == "llama"
    assert len(smol_index.metadata["tokenizer.ggml.tokens"]) == 49152


def test_smollm2_offsets_agree_with_gguf_py(smol_index):
    check_against_gguf_py(smol_index)


def test_smollm2_spans_and_image_layout(smol_index):
    check_spans_and_slots(smol_index)
    # SmolLM2 is laid out in HF order (layers 0, 1, 10, 11, ...), yet each layer is one span
    assert all(len(layer.spans) == 1 for layer in smol_index.layers)
    starts = [layer.spans[0].offset for layer in smol_index.layers]
    assert starts != sorted(starts)


def test_inspect_prints_hparams(smollm2_path):
    r = run_cli("inspect", str(smollm2_path))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    fields = {}
    for line in r.stdout.splitlines()[1:]:
        k, _, v = line.strip().partition(" ")
        fields[k] = v.strip()
    assert "llama" in r.stdout.splitlines()[0] and "Q4_1" in r.stdout.splitlines()[0]
    assert fields["n_layers"] == "30"
    assert fields["n_embd"] == "576"
    assert fields["rope_scaling"] == "none"  # read as a person writes it, not a Python repr
    # per layer: its bytes and the file byte spans one streamed pass reads
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(30))
    idx = open_model(smollm2_path)
    for row, layer in zip(rows, idx.layers):
        assert row[3] == ",".join(f"{sp.offset}-{sp.offset + sp.nbytes}" for sp in layer.spans)
    assert fields["n_ff"] == "1536"
    assert fields["n_head"] == "9"
    assert fields["n_head_kv"] == "3"
    assert fields["n_vocab"] == "49152"
    assert float(fields["rope_base"]) == 100000.0
    assert fields["tied_embeddings"] == "True"


# ---------------------------------------------------------------------------------------------
# Header only: no tensor data is read


@pytest.mark.parametrize("order", ["convert", "hf", "quantize"])
def test_synthetic_orders_agree_with_gguf_py(tmp_path, order):
    p = write_tiny(tmp_path, n_layers=3, order=order, rope_freqs=True, type="Q4_K_M")
    idx = open_model(p)
    assert idx.hparams.n_layers == 3 and not idx.hparams.tied_embeddings
    assert set(idx.globals) == {"token_embd", "output_norm", "output", "rope_freqs"}
    assert idx.hparams.rope_scaling.kind == "llama3"
    check_against_gguf_py(idx)
    check_spans_and_slots(idx)


@pytest.mark.parametrize("order", ["convert", "hf"])
def test_qwen2_layers_hold_their_biases(tmp_path, order):
    """A Qwen2 file: each layer's q, k, v biases are among its tensors (in its image, so they
    stream with it), the hyper-parameters say what the block does differently, and a Llama has
    neither."""
    idx = open_model(write_tiny(tmp_path, "q.gguf", n_layers=3, arch="qwen2", order=order))
    hp = idx.hparams
    assert hp.qkv_bias and hp.rope_neox
    for layer in idx.layers:
        assert {n: t.shape for n, t in layer.tensors.items() if n.endswith(".bias")} == {
            "attn_q.bias": (hp.q_dim,), "attn_k.bias": (hp.kv_dim,), "attn_v.bias": (hp.kv_dim,)}
    check_against_gguf_py(idx)
    check_spans_and_slots(idx)
    llama = open_model(write_tiny(tmp_path, "l.gguf", n_layers=3)).hparams
    assert not llama.qkv_bias and not llama.rope_neox


def test_read_header_agrees_with_gguf_py(tmp_path):
    """The raw header (what the synthetic writer and split read through) matches gguf-py's
    parse, with a non-default alignment; each pair's raw bytes decode to the same pair."""
    p = write_tiny(tmp_path, type="Q5_K_M", alignment=64)
    h = read_header(p)
    r = gguf_reader(p)
    assert h.alignment == 64 and r.alignment == 64 and h.data_start == r.data_offset
    assert [kv.key for kv in h.kvs] == [k for k in r.fields if not k.startswith("GGUF.")]
    assert h.kv("general.architecture").value == "llama" and h.kv("nope") is None
    toks = h.kv("tokenizer.ggml.tokens")
    assert toks.value == r.fields["tokenizer.ggml.tokens"].contents()
    for kv in h.kvs:
        assert kv.raw[8 : 8 + len(kv.key.encode())] == kv.key.encode()
    assert sum(len(kv.raw) for kv in h.kvs) == r.tensors[0].field.offset - r.fields[h.kvs[0].key].offset
    for t, rt in zip(h.tensors, r.tensors, strict=True):
        assert t.name == rt.name and t.nbytes == rt.n_bytes and t.type_id == rt.tensor_type
        assert t.ne == tuple(int(d) for d in rt.shape)
        assert h.data_start + t.rel_offset == rt.data_offset and rt.data_offset % 64 == 0


def test_index_ignores_garbage_tensor_data(tmp_path):
    """Overwriting every tensor byte with garbage changes nothing in the index: it never looks
    at tensor data."""
    p = write_tiny(tmp_path)
    before = open_model(p)
    start = data_region_start(p)
    size = p.stat().st_size
    assert start < size
    with open(p, "r+b") as f:
        f.seek(start)
        f.write(np.random.default_rng(1).integers(0, 256, size - start, dtype=np.uint8).tobytes())
    after = open_model(p)
    assert after == before


def test_index_of_a_huge_sparse_file_reads_no_data(tmp_path):
    """A Llama-3-70B-shaped Q4_K_M file (~40 GB) whose data region is a hole: indexing it takes a
    fraction of a second and faults in almost no pages, so no tensor data was touched."""
    cfg = sg.preset_config("llama3-70b", type="Q4_K_M")
    p = write_header_only_gguf(tmp_path / "huge.gguf", cfg)
    st = p.stat()
    assert st.st_size > 35e9
    if st.st_blocks * 512 > 16 << 20:
        pytest.skip("this filesystem does not keep sparse files sparse")
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    idx = open_model(p)
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    faults = (ru1.ru_minflt - ru0.ru_minflt) + (ru1.ru_majflt - ru0.ru_majflt)
    assert idx.hparams.n_layers == 80 and idx.hparams.n_head_kv == 8
    assert idx.layer_bytes_total + idx.global_bytes_total > 35e9
    # Touching the data would fault ~10 million pages; the header is a few hundred KB.
    assert faults < 20_000, faults
    assert dt < 2.0, dt
    p.unlink()


# ---------------------------------------------------------------------------------------------
# Split sets


@pytest.fixture(scope="module")
def single_and_split(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    single = write_tiny(d, "model.gguf", n_layers=4, type="Q4_K_M")
    shards = sg.split_gguf(single, 3, out=d / "split.gguf")
    return single, shards


def test_split_set_indexes_like_the_single_file(single_and_split):
    single, shards = single_and_split
    assert [s.name for s in shards] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    one = open_model(single)
    for entry in (shards[0], shards[2]):  # any shard names the whole set
        many = open_model(entry)
        assert many.paths == tuple(str(s) for s in shards)
        assert many.hparams == one.hparams
        a, b = all_tensors(one), all_tensors(many)
        assert set(a) == set(b)
        for name in a:
            assert (a[name].ggml_type, a[name].shape, a[name].nbytes) == (b[name].ggml_type, b[name].shape, b[name].nbytes)
        assert {t.path for t in b.values()} == set(many.paths)  # tensors really are spread out
    check_against_gguf_py(many)  # per-file paths and offsets
    check_spans_and_slots(many)
    # the cut between shards falls inside some layer: that layer has one span per file
    assert any(len(layer.spans) == 2 for layer in many.layers)
    # and the tensor bytes are the single file's
    for name, t in all_tensors(many).items():
        s = all_tensors(one)[name]
        with open(t.path, "rb") as f1, open(s.path, "rb") as f2:
            f1.seek(t.offset)
            f2.seek(s.offset)
            assert f1.read(t.nbytes) == f2.read(s.nbytes), name


def test_split_set_with_a_missing_shard(tmp_path, monkeypatch, capsys):
    d = tmp_path
    single = write_tiny(d, "model.gguf", n_layers=4)
    shards = sg.split_gguf(single, 3, out=d / "split.gguf")
    shards[1].unlink()
    for entry in (shards[0], shards[2]):
        with pytest.raises(ModelError) as ei:
            open_model(entry)
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith(str(entry))
        assert "missing shard" in msg and "split-00002-of-00003.gguf" in msg
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "inspect", str(shards[0]))
    assert_one_error_line(code, out, err, "missing shard", "split-00002-of-00003.gguf")
    assert out == ""


# ---------------------------------------------------------------------------------------------
# Unusable inputs: one line naming the path and the problem, nothing loaded


def _text_file(d: pathlib.Path) -> pathlib.Path:
    p = d / "notes.gguf"
    p.write_text("these are not the weights you are looking for\n" * 10)
    return p


def _broken(breakage, **overrides):
    return lambda d: write_tiny(d, "broken.gguf", breakage=breakage, **overrides)


def _missing_shard(d: pathlib.Path) -> pathlib.Path:
    first = write_tiny(d, "set.gguf", split=3)
    (d / "set-00003-of-00003.gguf").unlink()
    return first


BAD_INPUTS = {
    "text_file": (_text_file, ["not a GGUF file"]),
    "bad_magic": (_broken("bad_magic"), ["not a GGUF file", "GGUX"]),
    "version1": (_broken("version1"), ["unsupported GGUF version 1"]),
    "truncated": (_broken("truncate"), ["truncated file", "output.weight"]),
    "truncated_header": (lambda d: _truncate_to(_broken(None)(d), 200), ["truncated file"]),
    "arch_mamba": (_broken("bad_arch"), ["unsupported architecture", "'mamba'", "supported: llama, qwen2"]),
    "qwen2_missing_bias": (_broken(sg.Breakage(drop_tensor="blk.1.attn_k.bias"), arch="qwen2"),
                           ["missing tensor", "blk.1.attn_k.bias"]),
    "qwen2_bias_wrong_shape": (_broken(sg.Breakage(wrong_shape="blk.0.attn_q.bias"), arch="qwen2"),
                               ["blk.0.attn_q.bias", "has shape [128]", "expected [256]"]),
    "q2_k": (_broken("q2_k"), ["unsupported quant type", "Q2_K", "blk.0.attn_q.weight"]),
    "iq2_xxs": (_broken("iq2_xxs"), ["unsupported quant type", "IQ2_XXS", "blk.0.ffn_gate.weight"]),
    "missing_tensor": (_broken("drop_tensor"), ["missing tensor", "blk.0.attn_q.weight"]),
    "missing_output_norm": (_broken(sg.Breakage(drop_tensor="output_norm.weight")), ["missing tensor", "output_norm.weight"]),
    "missing_layer_key": (_broken("missing_key"), ["missing metadata key", "llama.block_count"]),
    "wrong_shape": (_broken("wrong_shape"), ["blk.0.ffn_up.weight", "has shape [256, 256]", "expected [512, 256]"]),
    "duplicate": (_broken("duplicate_name"), ["duplicate tensor name", "blk.0.attn_k.weight"]),
    "missing_shard": (_missing_shard, ["missing shard", "set-00003-of-00003.gguf"]),
    "no_such_path": (lambda d: d / "nowhere" / "model.gguf", ["no such file"]),
    "directory": (lambda d: d, ["is a directory"]),
}


def _truncate_to(p: pathlib.Path, n: int) -> pathlib.Path:
    os.truncate(p, n)
    return p


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_unusable_input_is_one_error_line(tmp_path, monkeypatch, capsys, case):
    make, needles = BAD_INPUTS[case]
    p = make(tmp_path)
    result = None
    with pytest.raises(ModelError) as ei:
        result = open_model(p)
    assert result is None  # nothing was loaded
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}: "), msg
    for n in needles:
        assert n in msg, (n, msg)
    # the command line says the same in one line, with no traceback and no output
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "inspect", str(p))
    assert_one_error_line(code, out, err, str(p), *needles)
    assert out == ""


@pytest.mark.parametrize("case", ["text_file", "q2_k"])
def test_unusable_input_through_the_installed_cli(tmp_path, case):
    make, needles = BAD_INPUTS[case]
    p = make(tmp_path)
    r = run_cli("inspect", str(p))
    assert_one_error_line(r.returncode, r.stdout, r.stderr, str(p), *needles)
    assert r.stdout == ""


def test_tiny_config_is_what_the_bad_inputs_assume():
    # wrong_shape halves ffn_up's ne[1] (512 -> 256) of a d_model 256 / d_ff 512 model
    cfg = tiny_config()
    assert (cfg.d_model, cfg.d_ff) == (256, 512)


# ---------------------------------------------------------------------------------------------
# Hostile headers (issue 12): every value the index uses is checked; nothing but one ModelError
# line escapes, and what the file says is quoted with its control characters escaped.


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory):
    """The pieces of a valid tiny model, for each attack to change."""
    return GGUFParts.of(write_tiny(tmp_path_factory.mktemp("attack")))


def _kv(key, vtype, value, subtype=None):
    return lambda p: p.set_kv(key, vtype, value, subtype)


def _tensor(tensor_name, **fields):
    def change(p):
        t = p.tensor(tensor_name)
        for k, v in fields.items():
            setattr(t, k, v(p) if callable(v) else v)
        return p
    return change


def _raw_kv(key: bytes, body: bytes):
    """A pair written byte by byte: ``body`` is its type id and value."""
    return lambda p: (p.kvs.append(struct.pack("<Q", len(key)) + key + body), p)[1]


_EPS, _ROPE = "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"
_FORGED = "\x1b[31m\nFAKE: model OK"
_FORGED_SHOWN = "\\x1b[31m\\nFAKE: model OK"

ATTACKS = {
    # non-finite or out-of-range numbers that used to reach compute (NaN logits, 16 GiB tables)
    "eps_nan": (_kv(_EPS, VT.FLOAT32, float("nan")), [_EPS, "nan"]),
    "eps_negative": (_kv(_EPS, VT.FLOAT32, -1e-5), [_EPS, "must be a finite number > 0"]),
    "eps_zero_in_float32": (_kv(_EPS, VT.FLOAT64, 1e-60), [_EPS]),
    "rope_base_inf": (_kv(_ROPE, VT.FLOAT32, float("inf")), [_ROPE, "inf"]),
    "rope_base_zero": (_kv(_ROPE, VT.FLOAT32, 0.0), [_ROPE]),
    "rope_dim_huge": (_kv("llama.rope.dimension_count", VT.UINT32, 1 << 31), ["llama.rope.dimension_count", "outside 2..64"]),
    "rope_dim_odd": (_kv("llama.rope.dimension_count", VT.UINT32, 63), ["llama.rope.dimension_count", "even"]),
    "context_huge": (_kv("llama.context_length", VT.UINT64, 1 << 63), ["llama.context_length", "outside"]),
    "heads_zero": (_kv("llama.attention.head_count", VT.UINT32, 0), ["llama.attention.head_count", "outside"]),
    "scaling_factor_nan": (_kv("llama.rope.scaling.factor", VT.FLOAT32, float("nan")), ["llama.rope.scaling.factor"]),
    "scaling_type_escape": (_kv("llama.rope.scaling.type", VT.STRING, "\x1b]0;pwned\x07"),
                            ["llama.rope.scaling.type", "\\x1b]0;pwned\\x07"]),
    # values of the wrong type (int() of a string, a NaN alignment)
    "block_count_string": (_kv("llama.block_count", VT.STRING, "2"), ["llama.block_count", "not an integer"]),
    "alignment_nan": (_kv("general.alignment", VT.FLOAT32, float("nan")), ["general.alignment", "nan"]),
    "alignment_string": (_kv("general.alignment", VT.STRING, "32"), ["general.alignment", "'32'"]),
    "alignment_3": (_kv("general.alignment", VT.UINT32, 3), ["general.alignment 3", "power of two"]),
    "alignment_huge": (_kv("general.alignment", VT.UINT64, 1 << 40), ["general.alignment", "power of two"]),
    "nested_array": (_raw_kv(b"general.nested", struct.pack("<IIQIQ", 9, 9, 1, 0, 0)), ["arrays of arrays"]),
    "duplicate_key": (lambda p: (p.kvs.append(p.kvs[p.key_index("general.architecture")]), p)[1],
                      ["duplicate metadata key general.architecture"]),
    # tokenizer fields of the wrong type or length
    "tokens_not_strings": (_kv("tokenizer.ggml.tokens", VT.ARRAY, list(range(512)), VT.INT32),
                           ["tokenizer.ggml.tokens", "not an array of strings"]),
    "token_type_strings": (_kv("tokenizer.ggml.token_type", VT.ARRAY, ["1"] * 512, VT.STRING),
                           ["tokenizer.ggml.token_type", "not an array of integers"]),
    "token_type_short": (_kv("tokenizer.ggml.token_type", VT.ARRAY, [1] * 10, VT.INT32), ["has 10 entries for 512 tokens"]),
    "bos_id_string": (_kv("tokenizer.ggml.bos_token_id", VT.STRING, "1"), ["tokenizer.ggml.bos_token_id", "not an integer"]),
    "add_bos_string": (_kv("tokenizer.ggml.add_bos_token", VT.STRING, "yes"), ["tokenizer.ggml.add_bos_token", "not a bool"]),
    "bos_id_outside_vocab": (_kv("tokenizer.ggml.bos_token_id", VT.UINT32, 70000),
                             ["tokenizer.ggml.bos_token_id is 70000, outside the vocabulary of"]),
    "eos_id_outside_vocab": (_kv("tokenizer.ggml.eos_token_id", VT.UINT32, 512),
                             ["tokenizer.ggml.eos_token_id is 512, outside the vocabulary of 512 tokens"]),
    "chat_template_number": (_kv("tokenizer.chat_template", VT.UINT32, 7), ["tokenizer.chat_template", "not a string"]),
    "vocab_short": (lambda p: _kv("tokenizer.ggml.token_type", VT.ARRAY, [1] * 500, VT.INT32)(  # bos/eos kept inside
                        _kv("tokenizer.ggml.tokens", VT.ARRAY, [f"t{i}" for i in range(500)], VT.STRING)(
                            _kv("tokenizer.ggml.bos_token_id", VT.UINT32, 1)(_kv("tokenizer.ggml.eos_token_id", VT.UINT32, 2)(p)))),
                    ["the tokenizer has 500 tokens", "vocabulary has 512"]),
    # tensor records: layer numbers, ranges, names that speak to the terminal
    "layer_5000_digits": (_tensor("blk.0.attn_q.weight", name=b"blk." + b"7" * 5000 + b".attn_q.weight"),
                          ["tensor info #2", "a name of 5018 bytes", "at most 63"]),
    "layer_leading_zeros": (_tensor("blk.1.attn_q.weight", name=b"blk." + b"0" * 40 + b"1.attn_q.weight"),
                            ["layer number 00000000000000000000...", "not a plain number"]),
    "layer_4096": (_tensor("blk.1.attn_q.weight", name=b"blk.4096.attn_q.weight"), ["layer number 4096"]),
    "overlapping_tensors": (_tensor("blk.0.attn_k.weight", rel_offset=lambda p: p.tensor("blk.0.attn_q.weight").rel_offset + 512),
                            ["tensors blk.0.attn_q.weight and blk.0.attn_k.weight overlap"]),
    "misaligned_tensor": (_tensor("blk.0.attn_k.weight", rel_offset=lambda p: p.tensor("blk.0.attn_k.weight").rel_offset + 1),
                          ["blk.0.attn_k.weight", "not a multiple of the alignment 32"]),
    "zero_dimension": (_tensor("blk.0.attn_q.weight", ne=[256, 0]), ["blk.0.attn_q.weight", "zero dimension"]),
    "offset_past_end": (_tensor("output_norm.weight", rel_offset=(1 << 64) - 32), ["truncated file", "output_norm.weight"]),
    "forged_line_in_tensor_name": (_tensor("blk.0.attn_q.weight", name=f"x{_FORGED}".encode(), type_id=999),
                                   [f"tensor x{_FORGED_SHOWN} has unknown type id 999"]),
    "forged_line_in_key": (_raw_kv(f"k{_FORGED}".encode(), struct.pack("<I", 99)), [f"k{_FORGED_SHOWN}"]),
    "forged_line_in_arch": (_kv("general.architecture", VT.STRING, _FORGED), ["unsupported architecture", _FORGED_SHOWN]),
    "too_many_tensors": (lambda p: setattr(p, "counts", ((1 << 16) + 1, len(p.kvs))) or p, ["corrupt header"]),
}


def assert_model_error_line(make, *needles: str) -> ModelError:
    with pytest.raises(ModelError) as ei:
        make()
    msg = str(ei.value)
    assert msg.isprintable(), repr(msg)  # no newline, no escape sequence, no bidi override
    for n in needles:
        assert n in msg, (n, msg)
    return ei.value


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_hostile_header_is_one_printable_error_line(tmp_path, monkeypatch, capsys, tiny_parts, attack):
    change, needles = ATTACKS[attack]
    p = change(copy.deepcopy(tiny_parts)).write(tmp_path / "hostile.gguf")
    assert_model_error_line(lambda: open_model(p), f"{p}: ", *needles)
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "inspect", str(p))
    assert_one_error_line(code, out, err, str(p), *needles)
    assert err.isascii() and "\x1b" not in err and out == ""


@pytest.mark.parametrize("attack", ["eps_nan", "rope_dim_huge", "overlapping_tensors", "tokens_not_strings", "forged_line_in_key"])
def test_plan_only_refuses_a_hostile_header(tmp_path, monkeypatch, capsys, tiny_parts, attack):
    change, needles = ATTACKS[attack]
    p = change(copy.deepcopy(tiny_parts)).write(tmp_path / "hostile.gguf")
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "start", "--model", str(p), "--backend", "cpu", "--plan-only",
                                         *own_instance("hostile"))
    assert_one_error_line(code, out, err, str(p), *needles)
    assert out == ""


def test_tokenizer_refuses_wrong_types_with_one_line(tiny_parts, tmp_path):
    """The tokenizer checks a metadata dict by the index's own table (tests build dicts)."""
    from ntx.ctl.tokenizer import Tokenizer

    md = dict(open_model(tiny_parts.write(tmp_path / "ok.gguf")).metadata)
    for key, bad in (("tokenizer.ggml.token_type", ["1"] * 512), ("tokenizer.ggml.eos_token_id", float("nan")),
                     ("tokenizer.ggml.merges", [1, 2]), ("tokenizer.ggml.pre", ["smollm"])):
        with pytest.raises(NtxError) as ei:
            Tokenizer.from_metadata({**md, key: bad})
        assert key in str(ei.value) and str(ei.value).isprintable()
    assert Tokenizer.from_metadata(md).vocab_size == 512


def test_forged_model_name_is_shown_escaped(tmp_path, monkeypatch, capsys, tiny_parts):
    p = _kv("general.name", VT.STRING, _FORGED)(copy.deepcopy(tiny_parts)).write(tmp_path / "named.gguf")
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "inspect", str(p))
    assert code == 0, err
    assert out.splitlines()[0].startswith(_FORGED_SHOWN) and "\x1b" not in out and "FAKE" not in out.splitlines()[1]


def test_split_name_with_no_shards(tmp_path, tiny_parts):
    p = tiny_parts.write(tmp_path / "m-00001-of-00000.gguf")
    assert_model_error_line(lambda: open_model(p), "shard 1 of 0")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "pipe.gguf"
    os.mkfifo(p)
    assert_model_error_line(lambda: open_model(p), "not a regular file")


def test_numeric_arrays_are_kept_packed(tiny_parts, tmp_path):
    """A numeric metadata array is one packed copy (array.array), equal to what gguf-py reads;
    its raw bytes are read from the file only when asked for."""
    parts = _kv("tokenizer.ggml.scores", VT.ARRAY, [i / 4 for i in range(512)], VT.FLOAT32)(copy.deepcopy(tiny_parts))
    p = parts.write(tmp_path / "scores.gguf")
    scores = read_header(p).kv("tokenizer.ggml.scores")
    assert isinstance(scores.value, array.array) and scores.value.typecode == "f"
    assert list(scores.value) == gguf_reader(p).fields["tokenizer.ggml.scores"].contents()
    assert scores.raw == parts.kvs[parts.key_index("tokenizer.ggml.scores")]
    assert open_model(p).metadata["tokenizer.ggml.scores"] == scores.value


_PEAK_RSS = """
import resource, sys
from ntx.ctl import cli
sys.argv = ["ntxctl", "inspect", sys.argv[1]]
try:
    cli.main()
except SystemExit as e:
    assert e.code in (0, None), e.code
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)
"""


def _inspect_peak_rss_bytes(path) -> int:
    r = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stderr.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_a_large_metadata_array_is_held_once(tmp_path, tiny_parts):
    """`inspect` of a file with a 64 MiB float array peaks less than two copies of the array above
    the same model without it (it was ~9 copies: a Python float per element, plus the raw bytes)."""
    array_bytes = 64 << 20
    values = np.arange(array_bytes // 4, dtype=np.float32)
    big = copy.deepcopy(tiny_parts)
    big.kvs.append(struct.pack("<Q", 11) + b"general.big" + struct.pack("<IIQ", 9, 6, values.size) + values.tobytes())
    del values
    base_rss = _inspect_peak_rss_bytes(tiny_parts.write(tmp_path / "base.gguf"))
    big_rss = _inspect_peak_rss_bytes(big.write(tmp_path / "big.gguf"))
    assert big_rss - base_rss < 2 * array_bytes, (base_rss, big_rss)
