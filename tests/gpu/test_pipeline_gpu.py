"""The daemon pipeline on the GPU: compute on cuda, dma copying pinned shared memory into device
slots opened through CUDA IPC, with layers on all three tiers — same greedy tokens as the fully
resident GPU run in one process."""

from __future__ import annotations

import os

import pytest

from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.messages import EngineRequest
from ntx.shared.config import EngineOptions

from ..pipeline_util import ntxctl, running_pipeline

pytestmark = pytest.mark.gpu


def _model(tmp_path) -> str:
    """The real SmolLM2 when NTX_TEST_MODEL names it, else a synthetic model of its shape."""
    model = os.environ.get("NTX_TEST_MODEL")
    if model and os.path.exists(model):
        return model
    import synth_gguf as sg

    path = tmp_path / "smollm2-shape.gguf"
    sg.write_llama_gguf(path, sg.preset_config("smollm2-135m", type="Q4_1"))
    return str(path)


def test_three_tier_pipeline_on_gpu_equals_resident(tmp_path):
    model = _model(tmp_path)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=512))
    ref = {}
    for p in prompts:
        eng.submit(EngineRequest(p, eng.prompt_tokens(prompt=p, raw=True), SamplingParams(temperature=0.0, max_tokens=24)))
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                ref[ev["id"]] = ev["tokens"]
    del eng
    with running_pipeline(model, tmp_path / "run", "--gpu-layers", "10", "--ram-budget", "30MiB", "--ctx", "512",
                          "--max-batch", "4", "--cpu-layers", "0", name="gpu", backend="cuda") as pipe:
        st = pipe.status()
        assert {"vram", "ram", "storage"} <= set(st["plan"]["tiers"])
        for p in prompts:
            assert pipe.generate_greedy(p, 24)["tokens"] == ref[p], p
        pipe.wait_stages_moved_bytes()
        r = ntxctl("status", "--name", "gpu")
        assert r.returncode == 0
        print(r.stdout)
