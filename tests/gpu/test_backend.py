"""The cuda backend against the CPU reference: whole-model logits and greedy tokens, on SmolLM2
and on synthetic Llama-shaped models of every listed type; and the daemon pipeline on the GPU
with layers on all three tiers against the fully resident GPU run.

The SmolLM2 file is found through NTX_TEST_MODEL (the device machine has no registry access);
synthetic models are written here by scripts/synth_gguf.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from ntx.ctl.local import build_local_engine  # noqa: E402
from ntx.daemons.compute.backend import Pick, pick_on_host  # noqa: E402
from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared.messages import EngineRequest  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]


def _smollm2() -> str:
    p = os.environ.get("NTX_TEST_MODEL")
    if not p or not os.path.exists(p):
        pytest.skip("NTX_TEST_MODEL (SmolLM2 GGUF) not set on this machine")
    return p


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("synth")


def _synth(folder: pathlib.Path, qtype: str, **kw) -> str:
    path = folder / f"m-{qtype}-{'-'.join(f'{k}{v}' for k, v in sorted(kw.items()))}.gguf"
    if not path.exists():
        cfg = sg.preset_config("tiny", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                               vocab_size=1024, type=qtype, seed=7, **kw)
        sg.write_llama_gguf(path, cfg)
    return str(path)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    assert np.all(np.isfinite(a)), "non-finite GPU logits"
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def _logits_both(model: str, prompt: list[int], decode_steps: int):
    """Logits of a prefill (all positions) and of decode steps, on cpu and cuda."""
    outs = []
    for backend in ("cpu", "cuda"):
        eng = build_local_engine(model, backend=backend, options=_options(backend, ctx=256))
        m = eng.core.model
        m.backend.alloc_sequence(0, 256)
        pre = m.forward(StepBatch([SeqChunk(0, 0, tuple(prompt), all_logits=True)]))
        steps = []
        tok, pos = int(pre[-1].argmax()), len(prompt)
        for _ in range(decode_steps):
            lg = m.forward(StepBatch([SeqChunk(0, pos, (tok,))]))
            steps.append(lg[0])
            tok, pos = int(lg[0].argmax()), pos + 1
        outs.append((pre, np.stack(steps)))
    return outs


def _options(backend: str, ctx: int) -> EngineOptions:
    """The engine options of a comparison: on cpu the float32 numpy reference (``cpu-quantized=off``),
    which these tests hold the cuda backend to (the cpu backend's own int8 kernels are held to it
    in tests/test_cpu_kernels.py)."""
    return EngineOptions(max_batch=4, ctx=ctx, kernels="cpu-quantized=off" if backend == "cpu" else "")


def _greedy(model: str, backend: str, prompt_ids: list[int], n: int, **kw) -> list[int]:
    eng = build_local_engine(model, backend=backend, options=_options(backend, ctx=512), **kw)
    eng.submit(EngineRequest("g", list(prompt_ids), SamplingParams(temperature=0.0, max_tokens=n)))
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                return ev["tokens"]
    raise AssertionError("no done event")


def test_smollm2_logits_and_greedy_match_cpu():
    model = _smollm2()
    prompt = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 7352]  # 11 tokens: f16 GEMM prefill path
    (cpu_pre, cpu_dec), (gpu_pre, gpu_dec) = _logits_both(model, prompt, 6)
    # f16 KV cache and f16-rounded prefill GEMMs over 30 layers: about 1e-3 relative per product
    assert _rel(gpu_pre, cpu_pre) < 2e-2
    assert _rel(gpu_dec, cpu_dec) < 2e-2
    ids = [504, 3575, 282, 4649, 314]
    cpu = _greedy(model, "cpu", ids, 32)
    gpu = _greedy(model, "cuda", ids, 32)
    assert gpu == cpu


@pytest.mark.parametrize("qtype", TYPES)
def test_synthetic_every_type_logits_match_cpu(synth_dir, qtype):
    model = _synth(synth_dir, qtype)
    (cpu_pre, cpu_dec), (gpu_pre, gpu_dec) = _logits_both(model, list(range(3, 15)), 4)
    assert _rel(gpu_pre, cpu_pre) < 2e-2, qtype
    assert _rel(gpu_dec, cpu_dec) < 2e-2, qtype


def test_synthetic_rope_freqs_untied_greedy(synth_dir):
    model = _synth(synth_dir, "Q8_0", rope_freqs=True)
    (cpu_pre, _), (gpu_pre, _) = _logits_both(model, list(range(20, 30)), 1)
    assert _rel(gpu_pre, cpu_pre) < 2e-2
    assert _greedy(model, "cuda", [5, 6, 7], 24) == _greedy(model, "cpu", [5, 6, 7], 24)


@pytest.mark.parametrize("qtype,kw", [("Q4_K_M", {}), ("Q8_0", {"head_dim": 128, "tied_embeddings": True})])
def test_qwen2_logits_greedy_and_verify_rows_match_cpu(synth_dir, qtype, kw):
    """A Qwen2-shaped model (q, k, v biases; each head's halves rotated): logits of a prefill and
    of decode steps as the cpu reference's, the same greedy tokens, and the rows of a verify pass
    (a chain of drafted tokens in one chunk) as plain decode's, over the reordered keys in the cache."""
    model = _synth(synth_dir, qtype, arch="qwen2", **kw)
    (cpu_pre, cpu_dec), (gpu_pre, gpu_dec) = _logits_both(model, list(range(3, 15)), 4)
    assert _rel(gpu_pre, cpu_pre) < 2e-2
    assert _rel(gpu_dec, cpu_dec) < 2e-2
    assert _greedy(model, "cuda", [5, 6, 7], 24) == _greedy(model, "cpu", [5, 6, 7], 24)
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
    m = eng.core.model
    m.backend.alloc_sequence(1, 256)
    prompt = [9, 10, 11, 12, 13]
    plain = [m.forward(StepBatch([SeqChunk(1, 0, tuple(prompt), all_logits=True)]))[-1]]
    chain = [21, 22, 23]
    for i, t in enumerate(chain):
        plain.append(m.forward(StepBatch([SeqChunk(1, len(prompt) + i, (t,))]))[0])
    m.backend.free_sequence(1)
    m.backend.alloc_sequence(2, 256)
    m.forward(StepBatch([SeqChunk(2, 0, tuple(prompt[:-1]))]))
    # the last prompt token and the chain as one chunk of all-logits rows
    verify = m.forward(StepBatch([SeqChunk(2, len(prompt) - 1, (prompt[-1], *chain), all_logits=True)]))
    m.backend.free_sequence(2)
    # other kernels at 4 rows than at 1 (the default mode), so not the same bits: within the
    # rounding; keys read back in another order than stored would be far outside it
    assert _rel(verify, np.stack(plain)) < 2e-2


def test_batched_decode_equals_alone_and_graphs_replay():
    """Two sequences decoding in one pass (graph-captured) equal each run alone, step after step."""
    model = _smollm2()
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
    # 4 tokens each: the shared prefill pass (T = 8) and the decode passes take the same matvec path
    prompts = [[504, 3575, 282, 4649], [1780, 314, 216, 34]]
    alone = [_greedy(model, "cuda", p, 12) for p in prompts]
    for i, p in enumerate(prompts):
        eng.submit(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12)))
    done = {}
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                done[ev["id"]] = ev["tokens"]
    assert [done["r0"], done["r1"]] == alone
    assert eng.core.model.backend.graphs, "decode steps should have been captured in a CUDA graph"


def test_run_ahead_decodes_the_tokens_of_one_pass_at_a_time():
    """Greedy passes queued one ahead, fed the previous pass's top-1 on the device (the default
    on cuda), give the tokens of passes run one at a time; a request that ends on its stop
    token while a pass holding its row is queued, and a cancel, leave the others unchanged."""
    model = _smollm2()
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
    assert eng.core.run_ahead
    eos_prompt = eng.prompt_tokens(prompt="Reply with one word: yes or no. Is water wet?")
    prompts = {"a": [504, 3575, 282, 4649, 314], "b": [1780, 314, 216, 34], "eos": eos_prompt}
    out = {}
    for ahead in (False, True):
        eng.core.run_ahead = ahead
        fed0 = eng.core.passes_fed
        for rid, p in prompts.items():
            eng.submit(EngineRequest(f"{rid}-{ahead}", p, SamplingParams(temperature=0.0, max_tokens=24)))
        done, steps = {}, 0
        while eng.has_work:
            events = eng.cancel(f"b-{ahead}") if steps == 6 else []  # its done event
            for ev in events + eng.step():
                if ev["type"] == "done":
                    done[ev["id"].rsplit("-", 1)[0]] = (ev["tokens"], ev["finish_reason"])
            steps += 1
        out[ahead] = done
        assert (eng.core.passes_fed > fed0) == ahead
    assert out[True] == out[False]
    assert out[True]["eos"][1] == "stop" and out[True]["a"][1] == "length"
    assert out[True]["b"][1] == "cancelled"
    assert eng.core.model.backend.seq_pages == {}  # every sequence row and page went back


def test_streamed_layers_in_process_match_resident():
    """Layers that are not resident (read per pass into a device buffer) give the same tokens."""
    model = _smollm2()
    ids = [504, 3575, 282, 4649, 314]
    assert _greedy(model, "cuda", ids, 16, resident_layers=range(10)) == _greedy(model, "cuda", ids, 16)


def _assert_same_picks(got, want, picks) -> None:
    """The device's picks are the host's from the copied logits: ids and values exactly, the
    log-normaliser within 1e-4, the scored prompt token's logit (gathered on the device) exactly."""
    for g, w, p in zip(got, want, picks):
        if p.k == 0:
            np.testing.assert_array_equal(g.row, w.row)
            continue
        np.testing.assert_array_equal(g.ids, w.ids)
        np.testing.assert_array_equal(g.vals, w.vals)
        if p.lse:
            assert abs(g.lse - w.lse) < 1e-4 * max(1.0, abs(w.lse)), (g.lse, w.lse)
        assert g.token_val == w.token_val


def test_device_pick_equals_selection_from_copied_logits(synth_dir):
    """Sampling on the GPU, kernel level: the device-side top-k and log-normaliser give exactly
    the ids and values that selecting from the copied [N, V] logits gives, for every kind of row
    in one batch (scored prompt rows with their actual token's value, a sampler's top-40, greedy top-1, a whole row)."""
    eng = build_local_engine(_synth(synth_dir, "Q8_0"), backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
    m = eng.core.model
    for sid in range(3):
        m.backend.alloc_sequence(sid, 256)
    batch = StepBatch([SeqChunk(0, 0, (1, 50, 300, 7, 900), all_logits=True), SeqChunk(1, 0, (5, 6, 7)),
                       SeqChunk(2, 0, (8,))])
    picks = [Pick(5, lse=True, token=t) for t in (50, 300, 7, 900)] + [Pick(40, lse=True), Pick(1), Pick(0)]
    logits = m.forward(batch)  # [7, V] on the host
    got = m.forward(batch, picks=picks)  # the same pass again (the same KV positions rewritten)
    want = pick_on_host(logits, picks)
    _assert_same_picks(got, want, picks)


def test_picks_of_more_rows_than_the_head_buffer_go_through_it_in_chunks(synth_dir):
    """An eager pass (more rows than the largest bucket) runs its head in the kept arena's
    64-row buffers, a chunk of rows at a time (``CudaBackend._head_chunks``): a 150-row prompt
    chunk scored on every row, beside two short sequences, gives the same ids and values per row
    as selecting from its whole copied logits, with every kind of pick on both sides of the
    chunk boundaries (rows 63/64, 127/128), a whole row among them."""
    eng = build_local_engine(_synth(synth_dir, "Q8_0"), backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
    m = eng.core.model
    assert m.backend.max_graph_rows == 64
    for sid in range(3):
        m.backend.alloc_sequence(sid, 256)
    long = tuple(1 + (i * 37) % 500 for i in range(150))
    batch = StepBatch([SeqChunk(0, 0, long, all_logits=True), SeqChunk(1, 0, (5, 6, 7)), SeqChunk(2, 0, (8,))])
    n = len(long) + 2  # every row of the long chunk, the last of each short one
    assert len(batch.logit_rows) == n == 152
    kinds = {62: Pick(0), 63: Pick(40, lse=True), 64: Pick(1), 65: Pick(0), 127: Pick(3, token=9), 128: Pick(0),
             150: Pick(40, lse=True), 151: Pick(1)}
    picks = [kinds.get(i, Pick(5, lse=True, token=long[i + 1] if i + 1 < len(long) else None)) for i in range(n)]
    logits = m.forward(batch)  # [152, V] on the host, itself a chunk at a time
    assert logits.shape[0] == n and np.isfinite(logits).all()
    got = m.forward(batch, picks=picks)
    want = pick_on_host(logits, picks)
    _assert_same_picks(got, want, picks)


def test_engine_samples_on_device_as_from_full_logits(synth_dir):
    """Sampling on the GPU, engine level: seeded top-k sampling with logprobs, and greedy, give
    the same tokens and log-probabilities with device-side selection as with the whole logits
    copied to the host (the backend's pick replaced by the host path)."""
    model = _synth(synth_dir, "Q4_K")
    runs = []
    for device_pick in (True, False):
        eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=256))
        b = eng.core.model.backend
        if not device_pick:
            b.pick = lambda ws, picks, b=b: pick_on_host(b.logits(ws), picks)
        eng.submit(EngineRequest("s", [1, 2, 3, 4], SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=24),
                           logprobs=3))
        eng.submit(EngineRequest("g", [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=24), prompt_logprobs=2))
        done, lps = {}, []
        while eng.has_work:
            for ev in eng.step():
                if ev["type"] == "token" and ev["id"] == "s":
                    lps.append((ev["logprob"], ev["logprobs"]))
                if ev["type"] == "done":
                    done[ev["id"]] = ev
        runs.append((done, lps))
    (d_dev, lp_dev), (d_host, lp_host) = runs
    assert d_dev["s"]["tokens"] == d_host["s"]["tokens"]
    assert d_dev["g"]["tokens"] == d_host["g"]["tokens"]
    for (a, alts_a), (b, alts_b) in zip(lp_dev, lp_host):
        assert abs(a - b) < 1e-4 and [i for i, _ in alts_a] == [i for i, _ in alts_b]
    pa, pb = d_dev["g"]["prompt_logprobs"], d_host["g"]["prompt_logprobs"]
    assert pa[0] is None and pb[0] is None and len(pa) == len(pb) == 3
    for ea, eb in zip(pa[1:], pb[1:]):  # the actual prompt token's pair: from the device's gather
        assert [i for i, _ in ea] == [i for i, _ in eb]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ea, eb))


# ------------------------------------------------------------------------------ token trees
# A 12-row tree (rows 1 and 2 siblings, so are 4 and 5, 7 and 8) and a root-to-leaf path through
# it that is not its first rows: keeping it moves rows 2, 4, 7, 9, 11 down to 1, 2, 3, 4, 5
TREE_PARENTS = (-1, 0, 0, 1, 2, 2, 3, 4, 4, 7, 5, 9)
TREE_PATH = (0, 2, 4, 7, 9, 11)
TREE_TOKENS = (11, 200, 37, 901, 5, 64, 300, 18, 777, 2, 45, 123)
PROMPT = (1, 50, 300, 7, 900, 12, 13)


def test_tree_verify_logits_match_cpu(synth_dir):
    """Trees verified in one pass beside a plain decode row (three sequences, two trees of
    different sizes) give on cuda the logits of the cpu reference, every tree row."""
    model = _synth(synth_dir, "Q8_0")
    outs = []
    for backend in ("cpu", "cuda"):
        m = build_local_engine(model, backend=backend, options=_options(backend, ctx=256)).core.model
        for sid in range(3):
            m.backend.alloc_sequence(sid, 256)
        m.forward(StepBatch([SeqChunk(0, 0, PROMPT), SeqChunk(1, 0, PROMPT[:4]), SeqChunk(2, 0, PROMPT[2:])]))
        outs.append(m.forward(StepBatch([
            SeqChunk(0, len(PROMPT), TREE_TOKENS, all_logits=True, parents=TREE_PARENTS),
            SeqChunk(1, 4, (3,), all_logits=True),
            SeqChunk(2, len(PROMPT) - 2, (8, 9, 10, 11), all_logits=True, parents=(-1, 0, 0, 1)),
        ])))
    cpu, gpu = outs
    assert gpu.shape == cpu.shape == (len(TREE_TOKENS) + 5, cpu.shape[1])
    assert _rel(gpu, cpu) < 2e-2


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_kv_keep_path_decodes_as_the_plain_path(synth_dir, backend):
    """After a tree pass and kv_keep of one root-to-leaf path, the next decode step gives the
    logits of a sequence that was fed that path as a plain chunk: the kept keys and values are
    the path's, in its order, in every layer."""
    model = _synth(synth_dir, "Q8_0")
    m = build_local_engine(model, backend=backend, options=_options(backend, ctx=256)).core.model
    n = len(PROMPT)
    path_tokens = tuple(TREE_TOKENS[r] for r in TREE_PATH)
    for sid in (0, 1):
        m.backend.alloc_sequence(sid, 256)
        m.forward(StepBatch([SeqChunk(sid, 0, PROMPT)]))
    m.forward(StepBatch([SeqChunk(0, n, TREE_TOKENS, all_logits=True, parents=TREE_PARENTS)]))
    moved = [(n + r, n + i) for i, r in enumerate(TREE_PATH) if r != i]
    m.backend.kv_keep(0, [s for s, _ in moved], [d for _, d in moved])
    m.forward(StepBatch([SeqChunk(1, n, path_tokens)]))
    next_pos = n + len(TREE_PATH)
    kept = m.forward(StepBatch([SeqChunk(0, next_pos, (33,))]))
    plain = m.forward(StepBatch([SeqChunk(1, next_pos, (33,))]))
    # the same math; only the rows' batching differs (f32 sums in another order, on cuda the
    # f16 rounding of keys and values that differ in their last bits)
    assert _rel(kept, plain) < (1e-4 if backend == "cpu" else 2e-3)


def test_embedding_in_host_memory_gives_the_same_bits(synth_dir):
    """The token embedding left in page-locked host memory and read there in place (the plan's
    ``embed_in_host``, where the budget streams layers and the head is its own tensor): the same
    logits bit for bit, prompt and decode passes (graph-replayed) alike, and the same greedy tokens."""
    import cupy as cp

    from ntx.daemons.compute.backend import make_backend
    from ntx.shared.gguf_index import open_model

    model = _synth(synth_dir, "Q4_K_M")
    index = open_model(model)
    outs = []
    for in_host in (False, True):
        be = make_backend("cuda", index, max_seqs=4, max_ctx=256, embed_in_host=in_host)
        eng = build_local_engine(model, backend=be, options=_options("cuda", ctx=256))
        m = eng.core.model
        attrs = cp.cuda.runtime.pointerGetAttributes(m.backend.embd.data.data.ptr)
        assert (attrs.type == 1) == in_host  # cudaMemoryTypeHost: page-locked host memory
        m.backend.alloc_sequence(0, 256)
        prompt = list(range(3, 40))
        pre = m.forward(StepBatch([SeqChunk(0, 0, tuple(prompt), all_logits=True)]))
        tok, pos, steps = int(pre[-1].argmax()), len(prompt), []
        for _ in range(6):
            lg = m.forward(StepBatch([SeqChunk(0, pos, (tok,))]))
            steps.append(lg[0])
            tok, pos = int(lg[0].argmax()), pos + 1
        outs.append((pre, np.stack(steps)))
    (dev_pre, dev_dec), (host_pre, host_dec) = outs
    assert np.array_equal(dev_pre, host_pre) and np.array_equal(dev_dec, host_dec)
    with pytest.raises(ValueError, match="tied embedding"):
        make_backend("cuda", open_model(_synth(synth_dir, "Q8_0", tied_embeddings=True)), max_seqs=1, max_ctx=256,
                     embed_in_host=True)
