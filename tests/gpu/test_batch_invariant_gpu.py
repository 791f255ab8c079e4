"""Batch invariance on the GPU (issue 28 item 3), the cuda backend with ``--kernels
batch-invariant=on``: a row's results do not depend on how many rows share its pass.

  * kernels: every row of gemm (and gemm_group, gemm(accumulate)) of x[:T] is the bits of that
    row multiplied alone, T in 1..512 across every path boundary, for each kernel family (mmq:
    Q4_K, Q6_K; mm: Q4_1, Q8_0, F16; the matvec: F32), in the mode's rows form
    (``invariant-rows=on``: the i16 matvec to 8 rows, then matvec_rows) and its fixed form
    (``invariant-fixed=on``: the K-quants' fixed-point matvec to 2 rows, then fixed-point mmq;
    tests/gpu/test_fixed_point_gpu.py has its kernels alone); attention likewise, and
    a token tree's rows (the ordered tree kernel) the bits of a plain row over its path laid out
    in order;
  * the model: one sequence's logits, bit for bit, alone and in passes of 8, 64 and 512 rows
    with sequences that join and leave, its last steps verified as a tree (the scenario of
    tests/test_batch_invariant.py, where the cpu backend passes it), on a synthetic Q4_K_M
    (mmq) and the real SmolLM2 (NTX_TEST_MODEL: mm), in every form (the fixed form's products
    at 1-2 rows read the planes the fused norm, swiglu and attention combine write);
  * the engine: greedy tokens alone, batched with requests that join and leave mid-generation,
    and with ngram speculation verifying trees wider than a graph bucket, all the same.

Run: NTX_TEST_MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf python -m pytest -q tests/gpu/test_batch_invariant_gpu.py
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from gguf import GGMLQuantizationType as QT  # noqa: E402

import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)
from ntx.ctl.local import LocalEngine, build_local_engine  # noqa: E402
from ntx.daemons.compute.batch import SeqChunk  # noqa: E402
from ntx.daemons.compute.cuda import attention as A  # noqa: E402
from ntx.daemons.compute.cuda import gemm as G  # noqa: E402
from ntx.daemons.compute.cuda import runtime  # noqa: E402
from ntx.daemons.compute.cuda.memory import attention_rows, invariant_path  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
from ntx.shared.gguf_index import open_model  # noqa: E402
from ntx.shared.kernel_options import KernelOptions  # noqa: E402
from ntx.shared.messages import EngineRequest  # noqa: E402
from ntx.shared.quant_types import quant_type  # noqa: E402

from ..test_batch_invariant import (PASS_ROWS, assert_same_rows, sequence_logits_alone,  # noqa: E402
                                    sequence_logits_batched)
from .test_kernels import W, kv_pages, random_parents, random_weights  # noqa: E402

ON = KernelOptions(batch_invariant=True)
BI = runtime.standalone(ON)
BI_ROWS = runtime.standalone(KernelOptions(batch_invariant=True, invariant_rows=True))
BI_FIXED = runtime.standalone(KernelOptions(batch_invariant=True, invariant_fixed=True))
# --kernels of each form of the mode, and the standalone context of each
FORMS = {"mmq-mm": "batch-invariant=on", "rows": "batch-invariant=on,invariant-rows=on",
         "fixed": "batch-invariant=on,invariant-fixed=on"}
CONTEXTS = {"mmq-mm": BI, "rows": BI_ROWS, "fixed": BI_FIXED}
ROWS = (1, 2, 3, 8, 9, 63, 64, 65, 512)  # across every boundary of the default's paths and chunks
MAX_ROWS = max(ROWS)


# ------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q4_1, QT.Q8_0, QT.F16, QT.F32])
def test_gemm_rows_are_the_bits_of_each_row_alone(qt, form):
    ctx = CONTEXTS[form]
    rng = np.random.default_rng(int(qt))
    n_rows, n_cols = 320, 1024
    w = W(random_weights(qt, n_rows, n_cols, rng), qt, n_rows, n_cols)
    w2 = W(random_weights(qt, 96, n_cols, rng), qt, 96, n_cols)
    x = cp.asarray(rng.standard_normal((MAX_ROWS, n_cols)).astype(np.float32))
    alone = np.stack([cp.asnumpy(G.gemm(ctx, w, x[i:i + 1]))[0] for i in range(MAX_ROWS)])  # [512, n_rows]
    alone2 = np.stack([cp.asnumpy(G.gemm(ctx, w2, x[i:i + 1]))[0] for i in range(MAX_ROWS)])
    base = cp.asarray(rng.standard_normal((MAX_ROWS, n_rows)).astype(np.float32))
    for T in ROWS:
        fixed_rows = ctx.tuning().fx_matvec_rows if form == "fixed" else 0
        assert G.path(ctx, w, T) == invariant_path(quant_type(qt), n_cols, T, form == "rows", fixed_rows), (qt, T)
        np.testing.assert_array_equal(cp.asnumpy(G.gemm(ctx, w, x[:T])), alone[:T], err_msg=f"{qt.name} gemm T={T}")
        a, b = G.gemm_group(ctx, x[:T], [(w, None), (w2, None)])  # x quantized once for both
        np.testing.assert_array_equal(cp.asnumpy(a), alone[:T], err_msg=f"{qt.name} group T={T}")
        np.testing.assert_array_equal(cp.asnumpy(b), alone2[:T], err_msg=f"{qt.name} group T={T}")
        acc = base[:T].copy()
        G.gemm(ctx, w, x[:T], acc, accumulate=True)
        np.testing.assert_array_equal(cp.asnumpy(acc), cp.asnumpy(base[:T]) + alone[:T],
                                      err_msg=f"{qt.name} accumulate T={T}")


def _cache(rng, n_slots: int, n_kv: int, max_ctx: int, hd: int):
    return (rng.standard_normal((n_slots, n_kv, max_ctx, hd)).astype(np.float16),
            rng.standard_normal((n_slots, n_kv, max_ctx, hd)).astype(np.float16))


def test_attention_rows_are_the_bits_of_each_row_alone():
    """Decode and prompt rows of 8 sequences: the mode's splits are the one-row count at every
    T, and a wide pass runs in launches of the rows its workspace holds (memory.attention_rows)."""
    rng = np.random.default_rng(5)
    n_slots, n_kv, max_ctx, hd, group = 8, 2, 1024, 64, 4
    H = n_kv * group
    ck, cv = _cache(rng, n_slots, n_kv, max_ctx, hd)
    kv = kv_pages(ck, cv, rng)
    slots = cp.asarray(rng.integers(0, n_slots, MAX_ROWS).astype(np.int32))
    lens = cp.asarray(rng.integers(1, max_ctx + 1, MAX_ROWS).astype(np.int32))
    q = cp.asarray(rng.standard_normal((MAX_ROWS, H, hd)).astype(np.float32))
    S = A.attention_splits(1, n_kv, max_ctx, BI)
    alone = np.stack([cp.asnumpy(A.attention(BI, q[i:i + 1], kv, 0, slots[i:i + 1], lens[i:i + 1]))[0]
                      for i in range(MAX_ROWS)])
    for T in ROWS:
        assert A.attention_splits(T, n_kv, max_ctx, BI) == S
        ws = A.attention_workspace(attention_rows(T, runtime.invariant_tuning(runtime.tuning())), H, hd, S)
        out = A.attention(BI, q[:T], kv, 0, slots[:T], lens[:T], n_splits=S, workspace=ws)
        np.testing.assert_array_equal(cp.asnumpy(out), alone[:T], err_msg=f"attention T={T}")


def test_tree_rows_are_the_bits_of_their_path_in_order():
    """A 300-row token tree after a 70-key prefix (its rows scattered over 10 pages): each tree
    row, by the ordered tree kernel (kv_lens its path's length), is the bits of a plain row whose
    cache holds the prefix and then its path's keys in order; in one launch and in launches of
    64 rows."""
    rng = np.random.default_rng(9)
    n_tree, base, n_kv, max_ctx, hd, group = 300, 70, 2, 1024, 128, 4
    H = n_kv * group
    parents = random_parents(n_tree, rng)
    depth = [0] * n_tree
    for j in range(1, n_tree):
        depth[j] = depth[parents[j]] + 1
    checked = sorted({n_tree - 1, int(np.argmax(depth)), 1, 2, 37, 150, 151, 299} - {0}) + [0]
    ck, cv = _cache(rng, 1 + len(checked), n_kv, max_ctx, hd)
    tree_k = rng.standard_normal((n_tree, n_kv, hd)).astype(np.float16)
    tree_v = rng.standard_normal((n_tree, n_kv, hd)).astype(np.float16)
    ck[0, :, base:base + n_tree] = tree_k.transpose(1, 0, 2)
    cv[0, :, base:base + n_tree] = tree_v.transpose(1, 0, 2)
    for s, j in enumerate(checked, start=1):  # slot s: the prefix, then row j's path in order
        path = [j]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        ck[s, :, :base], cv[s, :, :base] = ck[0, :, :base], cv[0, :, :base]
        ck[s, :, base:base + len(path)] = tree_k[path].transpose(1, 0, 2)
        cv[s, :, base:base + len(path)] = tree_v[path].transpose(1, 0, 2)
    kv = kv_pages(ck, cv, rng)
    q = rng.standard_normal((n_tree, H, hd)).astype(np.float32)
    visible = SeqChunk(0, base, tuple(range(n_tree)), parents=parents).visible()
    mask = cp.asarray(A.pack_tree_mask(visible, A.tree_mask_words(n_tree)))
    logical_lens = cp.asarray(np.array([base + d + 1 for d in depth], dtype=np.int32))
    S = A.attention_splits(1, n_kv, max_ctx, BI)
    args = (cp.asarray(q), kv, 0, cp.zeros(n_tree, cp.int32), logical_lens)
    tree_args = dict(tree_base=cp.full(n_tree, base, cp.int32), tree_mask=mask, n_splits=S)
    whole = cp.asnumpy(A.attention(BI, *args, workspace=A.attention_workspace(n_tree, H, hd, S), **tree_args))
    chunked = cp.asnumpy(A.attention(BI, *args, workspace=A.attention_workspace(64, H, hd, S), **tree_args))
    np.testing.assert_array_equal(chunked, whole)
    plain = cp.asnumpy(A.attention(BI, cp.asarray(q[checked]), kv, 0,
                                   cp.asarray(np.arange(1, 1 + len(checked), dtype=np.int32)),
                                   cp.asarray(np.array([base + depth[j] + 1 for j in checked], dtype=np.int32)),
                                   n_splits=S))
    for k, j in enumerate(checked):
        np.testing.assert_array_equal(whole[j], plain[k], err_msg=f"tree row {j} (depth {depth[j]})")


# ------------------------------------------------------------------------------ the model
def _smollm2() -> str | None:
    p = os.environ.get("NTX_TEST_MODEL")
    return p if p and os.path.exists(p) else None


@pytest.fixture(scope="module")
def q4km(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bi") / "bi-q4km.gguf"
    cfg = sg.preset_config("tiny", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type="Q4_K_M", seed=13)
    sg.write_llama_gguf(path, cfg)
    return str(path)


def _model_path(which: str, q4km: str) -> str:
    if which == "smollm2":
        p = _smollm2()
        if p is None:
            pytest.skip("NTX_TEST_MODEL (SmolLM2 GGUF) not set on this machine")
        return p
    return q4km


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("which", ["q4km", "smollm2"])
def test_a_sequence_logits_do_not_depend_on_its_pass(which, form, q4km):
    """The scenario tests/test_batch_invariant.py runs on the cpu backend, on the cuda backend
    in the mode: one sequence's logit rows, alone and in passes of 8, 64, 512 (a 511-row tree of
    another sequence: an eager pass, attention in 64-row launches), 2, 1, 8 rows, and its last
    steps verified as a tree, are the same bits."""
    engine = build_local_engine(_model_path(which, q4km), backend="cuda",
                                options=EngineOptions(max_batch=8, ctx=1024, kernels=FORMS[form]))
    model = engine.core.model
    assert model.backend.kernels.batch_invariant and model.backend.tuning.batch_invariant
    assert model.backend.tuning.invariant_rows == (form == "rows")
    assert model.backend.tuning.invariant_fixed == (form == "fixed")
    tokens, alone = sequence_logits_alone(model)
    batched, sizes = sequence_logits_batched(model, tokens)
    assert sizes == PASS_ROWS
    assert_same_rows(alone, batched, sizes)


def _engine(model: str, form: str, **options) -> LocalEngine:
    return LocalEngine(build_engine(model, "cuda", options=EngineOptions(
        max_batch=4, ctx=1024, kernels=FORMS[form], **options)))


def _run(engine: LocalEngine, requests: dict[str, tuple[list[int], int]], joins: dict[str, int]) -> dict[str, dict]:
    """Greedy requests (id: (prompt, max tokens)); those in ``joins`` are submitted at that step
    of the engine, the others at once. Returns each request's done event."""
    for rid, (prompt, n) in requests.items():
        if rid not in joins:
            engine.submit(EngineRequest(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n)))
    done, step = {}, 0
    while engine.has_work or any(s >= step for s in joins.values()):
        for rid, at in joins.items():
            if at == step:
                prompt, n = requests[rid]
                engine.submit(EngineRequest(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n)))
        for ev in engine.step():
            assert ev["type"] != "error", ev
            if ev["type"] == "done":
                done[ev["id"]] = ev
        step += 1
    return done


def _quoting_prompt(model: str) -> list[int]:
    """A passage, then its start again: what follows is the passage quoted, which ngram lookup
    drafts as long chains, with branches where the passage repeats itself."""
    text = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "draft_tasks" / "summarise.txt"
    if "bi-q4km" in model:  # a synthetic vocabulary: a random passage of ids
        rng = np.random.default_rng(2)
        passage = [int(t) for t in rng.integers(3, 1000, 240)]
    else:
        from ntx.ctl.tokenizer import Tokenizer

        passage = Tokenizer.from_metadata(open_model(model).metadata).encode(text.read_text())[:240]
    return passage + passage[:12]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("which", ["q4km", "smollm2"])
def test_greedy_tokens_alone_batched_and_speculated(which, form, q4km):
    """One request's greedy tokens: alone; beside requests that join at steps 2 and 5 and end
    (their max_tokens) before it does; and with ngram speculation (draft trees up to 511 tokens,
    16 wide, drafted every pass) verifying trees wider than a graph bucket: all the same."""
    model = _model_path(which, q4km)
    prompt = _quoting_prompt(model)
    n = 48
    plain = _engine(model, form)  # one engine for both runs: the second starts after the first has ended
    alone = _run(plain, {"w": (prompt, n)}, {})["w"]["tokens"]
    others = {"j1": ([17, 300, 4, 61, 9], 6), "j2": (prompt[5:60], 20), "j3": ([40, 41, 42], 30)}
    batched = _run(plain, {"wb": (prompt, n), **others}, {"j1": 2, "j2": 5})
    assert batched["wb"]["tokens"] == alone
    spec_engine = _engine(model, form, draft="ngram", draft_tokens=511, draft_width=16, draft_fixed=True)
    backend = spec_engine.core.model.backend
    pass_rows: list[int] = []
    begin = backend.begin_pass

    def counted(batch):
        pass_rows.append(batch.n_tokens)
        return begin(batch)

    backend.begin_pass = counted
    speculated = _run(spec_engine, {"w": (prompt, n), "j1": others["j1"]}, {"j1": 3})
    assert speculated["w"]["tokens"] == alone
    spec = speculated["w"].get("speculation") or {}
    if which == "smollm2":  # real text is quoted, so lookup drafts: verified trees above the buckets
        assert spec.get("verify_passes", 0) > 0 and max(pass_rows) > 64, (spec, max(pass_rows))
