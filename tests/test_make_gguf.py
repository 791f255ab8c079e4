"""The synthetic Llama GGUF generator (scripts/synth_gguf, scripts/make_gguf.py)."""

from __future__ import annotations

import math
import pathlib
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import synth_gguf as sg

from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import read_header

QT = gguf.GGMLQuantizationType
REPO = pathlib.Path(__file__).resolve().parents[1]


def _tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("typ", sg.ALL_TYPES)
def test_every_type_writes_a_finite_tiny_model(tmp_path, typ):
    cfg = sg.preset_config("tiny", type=typ, n_layers=2)
    path = sg.write_llama_gguf(tmp_path / "m.gguf", cfg)
    plan = {t.name: t for t in sg.tensor_plan(cfg)}
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 2
    assert {t.name for t in r.tensors} == set(plan)
    for t in r.tensors:
        spec = plan[t.name]
        assert tuple(int(x) for x in t.shape) == spec.shape, t.name
        assert int(t.tensor_type) == spec.qtype, t.name
        vals = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(vals).all(), t.name
        if len(spec.shape) == 1:
            assert t.tensor_type == QT.F32
            assert 0.5 < vals.mean() < 1.5  # norm weights near one
        else:
            want = 1.0 / math.sqrt(spec.shape[0])
            assert 0.75 * want < vals.std() < 1.25 * want, (t.name, vals.std(), want)
            assert abs(vals.mean()) < 0.15 * want, t.name
    if typ in sg.MATRIX_TYPES:
        assert {t.tensor_type for t in r.tensors if len(t.shape) > 1} == {QT[typ]}


def test_q4_k_m_mix_follows_llama_cpp_on_32_layers(tmp_path):
    cfg = sg.preset_config("tiny", type="Q4_K_M", n_layers=32, d_model=256, d_ff=256)
    path = sg.write_llama_gguf(tmp_path / "m.gguf", cfg)
    types = {name: t.tensor_type.name for name, t in _tensors(path).items()}
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    assert [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more
    for i in (4, 5, 7, 8, 26):
        assert types[f"blk.{i}.attn_v.weight"] == "Q4_K"
        assert types[f"blk.{i}.ffn_down.weight"] == "Q4_K"
    for i in (0, 6, 31):
        for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{k}.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    assert types["output_norm.weight"] == "F32"
    r = gguf.GGUFReader(path)
    assert r.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_mix_rules_without_writing():
    # Q5_K_M: base Q5_K, same use_more_bits layers get Q6_K
    t = sg.tensor_types(sg.preset_config("tiny", type="Q5_K_M", n_layers=32))
    assert t["blk.6.attn_v.weight"] == "Q6_K" and t["blk.7.attn_v.weight"] == "Q5_K"
    assert t["blk.4.ffn_down.weight"] == "Q5_K" and t["blk.30.ffn_down.weight"] == "Q6_K"
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q5_K"
    # 70B (80 layers, GQA): attn_v that would be Q4_K becomes Q5_K
    t = sg.tensor_types(sg.preset_config("llama3-70b", type="Q4_K_M"))
    assert t["blk.10.attn_v.weight"] == "Q5_K" and t["blk.12.attn_v.weight"] == "Q6_K"
    assert t["blk.9.attn_v.weight"] == "Q6_K" and t["blk.70.attn_v.weight"] == "Q6_K"
    assert t["blk.10.ffn_down.weight"] == "Q4_K"
    # SmolLM2 shape: d=576 is not a multiple of 256 -> llama.cpp's fallbacks; tied output -> Q8_0
    t = sg.tensor_types(sg.preset_config("smollm2-135m", type="Q4_K_M"))
    assert "output.weight" not in t
    assert t["token_embd.weight"] == "Q8_0"
    assert t["blk.0.attn_q.weight"] == "Q5_0"       # Q4_K -> Q5_0
    assert t["blk.0.ffn_down.weight"] == "Q6_K"     # ff=1536 is a multiple of 256
    assert t["blk.4.ffn_down.weight"] == "Q4_K"
    assert sg.tensor_types(sg.preset_config("smollm2-135m", type="Q6_K"))[
        "blk.0.attn_q.weight"] == "Q8_0"             # Q6_K -> Q8_0
    assert sg.tensor_types(sg.preset_config("smollm2-135m", type="Q5_K"))[
        "blk.0.attn_q.weight"] == "Q5_1"             # Q5_K -> Q5_1


def test_presets_have_the_real_sizes():
    gb = lambda p, t: sum(x.nbytes for x in sg.tensor_plan(sg.preset_config(p, type=t))) / 1e9  # noqa: E731
    assert 4.8 < gb("llama3-8b", "Q4_K_M") < 5.0     # Meta-Llama-3-8B Q4_K_M: 4.92 GB
    assert 42.0 < gb("llama3-70b", "Q4_K_M") < 43.0  # Llama-3-70B Q4_K_M: 42.5 GB
    c = sg.preset_config("llama3-70b", n_layers=3)
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads) == (3, 8192, 28672, 64, 8)


def _split_check(paths, original):
    orig = read_header(original)
    seen = []
    with open(original, "rb") as f0:
        for i, p in enumerate(paths):
            assert p.name.endswith(f"-{i + 1:05d}-of-{len(paths):05d}.gguf")
            r = gguf.GGUFReader(p)
            assert r.fields["split.no"].contents() == i
            assert r.fields["split.count"].contents() == len(paths)
            assert r.fields["split.tensors.count"].contents() == len(orig.tensors)
            assert ("general.architecture" in r.fields) == (i == 0)
            assert len(r.tensors) > 0
            for t in r.tensors:
                o = next(x for x in orig.tensors if x.name == t.name)
                f0.seek(orig.data_start + o.rel_offset)
                assert f0.read(o.nbytes) == bytes(t.data.reshape(-1).view(np.uint8)), t.name
                seen.append(t.name)
    assert sorted(seen) == sorted(t.name for t in orig.tensors)  # all present, once
    assert seen == [t.name for t in orig.tensors]                 # order kept


def test_split_into_3_shards(tmp_path):
    cfg = sg.preset_config("tiny", type="Q4_K_M", n_layers=6)
    src = sg.write_llama_gguf(tmp_path / "m.gguf", cfg)
    paths = sg.split_gguf(src, 3)
    assert len(paths) == 3
    _split_check(paths, src)


def test_write_split_directly_matches_split_of_single_file(tmp_path):
    cfg = sg.preset_config("tiny", type="Q8_0", n_layers=5)
    single = sg.write_llama_gguf(tmp_path / "one.gguf", cfg)
    first = sg.write_llama_gguf(tmp_path / "set.gguf", cfg, split=3)
    paths = sorted(tmp_path.glob("set-*-of-00003.gguf"))
    assert first == paths[0] and len(paths) == 3
    _split_check(paths, single)


def test_tensors_differ_and_seed_is_deterministic(tmp_path):
    cfg = sg.preset_config("tiny", type="Q4_K", n_layers=2)
    a = sg.write_llama_gguf(tmp_path / "a.gguf", cfg)
    b = sg.write_llama_gguf(tmp_path / "b.gguf", cfg)
    c = sg.write_llama_gguf(tmp_path / "c.gguf", sg.preset_config("tiny", type="Q4_K",
                                                                   n_layers=2, seed=1))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    t = _tensors(a)
    assert bytes(t["blk.0.attn_q.weight"].data) != bytes(t["blk.1.attn_q.weight"].data)
    assert bytes(t["blk.0.ffn_gate.weight"].data) != bytes(t["blk.0.ffn_up.weight"].data)


@pytest.mark.parametrize("order", sg.ORDERS)
def test_orders_keep_layers_contiguous(tmp_path, order):
    cfg = sg.preset_config("tiny", type="F16", n_layers=12, rope_freqs=True, order=order)
    lay = read_header(sg.write_llama_gguf(tmp_path / "m.gguf", cfg))
    names = [t.name for t in lay.tensors]
    offsets = [t.rel_offset for t in lay.tensors]
    assert offsets == sorted(offsets)
    layers = [int(n.split(".")[1]) if n.startswith("blk.") else None for n in names]
    runs = [k for i, k in enumerate(layers) if k is not None and (i == 0 or layers[i - 1] != k)]
    assert sorted(runs) == list(range(12))  # each layer is one contiguous run
    if order == "convert":
        assert names[:2] == ["rope_freqs.weight", "token_embd.weight"]
        assert names[-2:] == ["output_norm.weight", "output.weight"] and runs == list(range(12))
    elif order == "hf":
        assert runs == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
        assert names[2:5] == ["blk.0.attn_norm.weight", "blk.0.ffn_down.weight",
                              "blk.0.ffn_gate.weight"]
    else:
        assert names[:4] == ["output.weight", "output_norm.weight", "rope_freqs.weight",
                             "token_embd.weight"]
        assert runs == list(range(12)) and names[4] == "blk.0.attn_k.weight"


def test_rope_freqs_llama31():
    f = sg.llama31_rope_factors(128, 500000.0)
    assert f.shape == (64,) and f[0] == 1.0 and f[-1] == 8.0
    assert np.all(np.diff(f) >= 0) and np.all((f >= 1) & (f <= 8))


def test_minimal_tokenizer_is_usable(tmp_path):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    p = sg.write_llama_gguf(tmp_path / "m.gguf", sg.preset_config("tiny", n_layers=1))
    r = gguf.GGUFReader(p)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    assert len(tokens) == 512 and r.fields["llama.vocab_size"].contents() == 512
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert tokens[r.fields["tokenizer.ggml.bos_token_id"].contents()] == "<|begin_of_text|>"
    assert tokens[r.fields["tokenizer.ggml.eos_token_id"].contents()] == "<|eot_id|>"
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                          [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "the synthetic model, ünïcödé ok"
    ids = tok.encode(text).ids
    assert max(ids) < 512 and len(ids) < len(text.encode())  # merges are used
    assert tok.decode(ids) == text
    with pytest.raises(ConfigError, match="too small"):
        sg.write_llama_gguf(tmp_path / "x.gguf", sg.preset_config("tiny", vocab_size=100))


def test_tokenizer_from_smollm2(tmp_path, smollm2_path):
    cfg = sg.preset_config("smollm2-135m", n_layers=2, type="Q8_0", tokenizer_from=smollm2_path)
    p = sg.write_llama_gguf(tmp_path / "s.gguf", cfg)
    src = {kv.key: kv.raw for kv in read_header(smollm2_path).kvs}
    got = {kv.key: kv.raw for kv in read_header(p).kvs}
    tok_keys = [k for k in src if k.startswith("tokenizer.")]
    assert tok_keys and all(got[k] == src[k] for k in tok_keys)
    # the tiny preset's vocab (512) disagrees with SmolLM2's 49152: a clear error
    with pytest.raises(ConfigError, match="49152"):
        sg.write_llama_gguf(tmp_path / "t.gguf",
                            sg.preset_config("tiny", tokenizer_from=smollm2_path))
    # ... unless the vocab is overridden to match
    sg.write_llama_gguf(tmp_path / "t.gguf", sg.preset_config(
        "tiny", n_layers=1, vocab_size=49152, tokenizer_from=smollm2_path))


def _header(path):
    with open(path, "rb") as f:
        return f.read(4), struct.unpack("<IQQ", f.read(20))


def test_breakages(tmp_path):
    cfg = sg.preset_config("tiny", type="Q4_K_M", n_layers=2)
    good = read_header(sg.write_llama_gguf(tmp_path / "good.gguf", cfg))
    names = [t.name for t in good.tensors]

    def w(kind):
        return sg.write_llama_gguf(tmp_path / f"{kind}.gguf", cfg, breakage=kind)

    lay = read_header(w("drop_tensor"))
    assert "blk.0.attn_q.weight" not in [t.name for t in lay.tensors]
    assert len(lay.tensors) == len(names) - 1
    lay = read_header(w("duplicate_name"))
    assert [t.name for t in lay.tensors].count("blk.0.attn_k.weight") == 2
    lay = read_header(w("wrong_shape"))
    t = next(t for t in lay.tensors if t.name == "blk.0.ffn_up.weight")
    assert t.ne == (256, 256)  # should be (256, 512)
    assert read_header(w("bad_arch")).kv("general.architecture").value == "mamba"
    assert read_header(w("missing_key")).kv("llama.block_count") is None
    lay = read_header(w("q2_k"))
    assert next(t for t in lay.tensors if t.name == "blk.0.attn_q.weight").type_id == QT.Q2_K
    lay = read_header(w("iq2_xxs"))
    assert next(t for t in lay.tensors if t.name == "blk.0.ffn_gate.weight").type_id == QT.IQ2_XXS
    assert _header(w("version1"))[1][0] == 1
    assert _header(w("bad_magic"))[0] == b"GGUX"
    p = w("truncate")
    last = good.tensors[-1]
    assert p.stat().st_size < good.data_start + last.rel_offset + last.nbytes
    full = read_header(p)  # the header is intact; the data is short
    assert len(full.tensors) == len(names)
    custom = sg.Breakage(drop_tensor="output_norm.weight", arch="gpt2")
    lay = read_header(sg.write_llama_gguf(tmp_path / "c.gguf", cfg, breakage=custom))
    assert lay.kv("general.architecture").value == "gpt2"
    assert "output_norm.weight" not in [t.name for t in lay.tensors]
    with pytest.raises(ConfigError):
        sg.write_llama_gguf(tmp_path / "x.gguf", cfg, breakage="nope")


def test_config_errors():
    with pytest.raises(ConfigError, match="preset"):
        sg.preset_config("llama9")
    with pytest.raises(ConfigError, match="n_kv_heads"):
        sg.tensor_plan(sg.preset_config("tiny", n_kv_heads=3))
    with pytest.raises(ConfigError, match="type"):
        sg.tensor_plan(sg.preset_config("tiny", type="Q3_K_M"))


def test_cli(tmp_path):
    out = tmp_path / "cli.gguf"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_gguf.py"), str(out), "--preset", "tiny",
         "--type", "Q4_K_M", "--layers", "3", "--split", "2", "--seed", "7", "-q"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("wrote ") and "GB/s" in last
    shards = sorted(tmp_path.glob("cli-*-of-00002.gguf"))
    assert len(shards) == 2
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "make_gguf.py"),
                          str(tmp_path / "x.gguf"), "--kv-heads", "3", "-q"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "n_kv_heads" in bad.stderr


def test_activations_stay_finite_and_scaled_through_all_layers(tmp_path):
    """A plain numpy Llama forward (RMSNorm, GQA attention, SwiGLU; RoPE left out: it does
    not change scales) over a 16-layer Q4_K_M model: the residual stream grows slowly and
    the logits are finite and of moderate size."""
    cfg = sg.preset_config("tiny", type="Q4_K_M", n_layers=16)
    t = {k: gguf.quants.dequantize(v.data, v.tensor_type).astype(np.float64)
         for k, v in _tensors(sg.write_llama_gguf(tmp_path / "m.gguf", cfg)).items()}
    hd, nh, nkv = cfg.hd, cfg.n_heads, cfg.n_kv_heads

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * w

    ids = np.array([1, 50, 300, 7, 99, 260])
    x = t["token_embd.weight"][ids]                      # x: [S, D]
    S = len(ids)
    mask = np.triu(np.full((S, S), -np.inf), 1)
    rms = []
    for i in range(cfg.n_layers):
        p = lambda k: t[f"blk.{i}.{k}.weight"]  # noqa: E731  (rows = outputs: y = x @ W.T)
        h = norm(x, p("attn_norm"))
        q = (h @ p("attn_q").T).reshape(S, nh, hd)
        k = np.repeat((h @ p("attn_k").T).reshape(S, nkv, hd), nh // nkv, axis=1)
        v = np.repeat((h @ p("attn_v").T).reshape(S, nkv, hd), nh // nkv, axis=1)
        a = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(S, nh * hd) @ p("attn_output").T
        h = norm(x, p("ffn_norm"))
        g, u = h @ p("ffn_gate").T, h @ p("ffn_up").T
        x = x + (g / (1 + np.exp(-g)) * u) @ p("ffn_down").T
        rms.append(float(np.sqrt((x * x).mean())))
    logits = norm(x, t["output_norm.weight"]) @ t["output.weight"].T   # [S, V]
    assert np.isfinite(logits).all()
    assert 0.3 < rms[0] < 3 and rms[-1] < 10 * rms[0], rms
    assert 0.2 < logits.std() < 5, logits.std()
