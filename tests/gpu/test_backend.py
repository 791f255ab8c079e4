"""The cuda backend against the CPU reference: whole-model logits and greedy tokens, on SmolLM2
and on synthetic Llama-shaped models of every listed type; and the daemon pipeline on the GPU
with layers on all three tiers against the fully resident GPU run.

The SmolLM2 file is found through NTX_TEST_MODEL (the device machine has no registry access);
synthetic models are written here by ntx.shared.synth_gguf.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from ntx.ctl.local import build_local_engine  # noqa: E402
from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.daemons.compute.engine import Request  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared import synth_gguf as sg  # noqa: E402

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
        eng = build_local_engine(model, backend=backend, max_batch=4, max_context=256)
        m = eng.model
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


def _greedy(model: str, backend: str, prompt_ids: list[int], n: int, **kw) -> list[int]:
    eng = build_local_engine(model, backend=backend, max_batch=4, max_context=512, **kw)
    eng.submit(Request("g", list(prompt_ids), SamplingParams(temperature=0.0, max_tokens=n)))
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


def test_batched_decode_equals_alone_and_graphs_replay():
    """Two sequences decoding in one pass (graph-captured) equal each run alone, step after step."""
    model = _smollm2()
    eng = build_local_engine(model, backend="cuda", max_batch=4, max_context=256)
    # 4 tokens each, so the shared prefill pass (T = 8) takes the same f32 matvec path as alone
    prompts = [[504, 3575, 282, 4649], [1780, 314, 216, 34]]
    alone = [_greedy(model, "cuda", p, 12) for p in prompts]
    for i, p in enumerate(prompts):
        eng.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12)))
    done = {}
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                done[ev["id"]] = ev["tokens"]
    assert [done["r0"], done["r1"]] == alone
    assert eng.model.backend.graphs, "decode steps should have been captured in a CUDA graph"


def test_streamed_layers_in_process_match_resident():
    """Layers that are not resident (read per pass into a device buffer) give the same tokens."""
    model = _smollm2()
    ids = [504, 3575, 282, 4649, 314]
    assert _greedy(model, "cuda", ids, 16, resident_layers=range(10)) == _greedy(model, "cuda", ids, 16)
