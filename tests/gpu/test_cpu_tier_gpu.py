"""The cpu tier beside a GPU: layers resident on the device, layers computed by the host's cores
from RAM and layers streamed, in one pass. In process, with the host's float32 reference kernels,
the greedy tokens are the cpu backend's reference (as tests/gpu/test_backend.py holds the cuda
backend alone); through the daemons, with the default (int8) host kernels, the tokens equal the
same split in process, and dma never copies a cpu-tier layer."""

from __future__ import annotations

import pytest

from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.config import EngineOptions
from ntx.shared.messages import EngineRequest

from ..pipeline_util import ntxctl, running_pipeline
from .test_backend import _greedy, _options, _smollm2
from .test_pipeline_gpu import _model

pytestmark = pytest.mark.gpu

RESIDENT = [0, 1, 2, 10, 11, 20, 29]
HOST = [3, 4, 12, 13, 14, 21, 22, 23, 24, 25]


def _greedy_all(eng, prompts: list[str], n: int) -> dict[str, list[int]]:
    for p in prompts:
        eng.submit(EngineRequest(p, eng.prompt_tokens(prompt=p, raw=True), SamplingParams(temperature=0.0, max_tokens=n)))
    out = {}
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                out[ev["id"]] = ev["tokens"]
    return out


@pytest.mark.parametrize("share", [None, 4], ids=["all-of-the-tier", "part-of-the-tier"])
def test_resident_host_and_streamed_layers_on_gpu_equal_the_cpu_reference(monkeypatch, share):
    """The 5-token prompt is a wide pass (more than WIDE_PASS_ROWS rows): the tier's layers run
    on the GPU, brought by the layer stream; the decode steps run them on the host's cores. With
    a share (``HostTier.streamed_in``, fixed here by NTX_TIER_WIDE_STREAMED), the prompt's pass
    runs that part of the tier on the GPU and the rest on the host's cores, in one pass."""
    if share:
        monkeypatch.setenv("NTX_TIER_WIDE_STREAMED", str(share))
    model = _smollm2()
    ids = [504, 3575, 282, 4649, 314]
    want = _greedy(model, "cpu", ids, 32)
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=512,
                                                                          kernels="cpu-quantized=off"),
                             resident_layers=RESIDENT, host_layers=HOST)
    assert {kind for _, _, kind in eng.core.model.runs} == {"resident", "host", "streamed"}
    eng.submit(EngineRequest("g", ids, SamplingParams(temperature=0.0, max_tokens=32)))
    got = None
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                got = ev["tokens"]
    assert got == want
    assert eng.core.model.host.wide_passes >= 1  # the prompt's pass ran the tier's layers on the GPU
    if share:
        assert eng.core.model.host.report()["streamed_by_rows"]["8"] == share
    assert _options("cpu", 512).kernels == "cpu-quantized=off"  # the reference _greedy ran


def test_pipeline_with_a_cpu_tier_on_gpu_equals_the_same_split_in_process(tmp_path):
    model = _model(tmp_path)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    with running_pipeline(model, tmp_path / "run", "--gpu-layers", "10", "--cpu-layers", "8", "--ram-budget", "60MiB",
                          "--ctx", "512", "--max-batch", "4", name="gpucpu", backend="cuda") as pipe:
        st = pipe.status()
        tiers = st["plan"]["tiers"]
        resident = [i for i, t in enumerate(tiers) if t == "vram"]
        host = [i for i, t in enumerate(tiers) if t == "cpu"]
        streamed = [i for i, t in enumerate(tiers) if t in ("ram", "storage")]
        assert len(host) == 8 and streamed, tiers
        got = {p: pipe.generate_greedy(p, 24)["tokens"] for p in prompts}
        st = pipe.wait_status(lambda s: "cpu_tier" in s["stages"].get("compute", {}), "compute's cpu tier report")
        # the prompts' passes are wide: dma streamed the tier's layers among theirs; the decode
        # passes ran them on the host's cores
        assert set(host) <= {int(k) for k in st["stages"].get("dma", {}).get("layer_moves", {})}
        assert st["stages"]["dma"]["tier_bytes"]["cpu"] > 0
        tier = st["stages"]["compute"]["cpu_tier"]
        assert tier["wide_passes"] >= 1 and tier["bytes"] > 0
        r = ntxctl("status", "--name", "gpucpu")
        assert r.returncode == 0 and "cpu tier" in r.stdout
        print(r.stdout)
    eng = build_local_engine(model, backend="cuda", options=EngineOptions(max_batch=4, ctx=512),
                             resident_layers=resident, host_layers=host)
    for p in prompts:  # one at a time, as the pipeline served them
        assert _greedy_all(eng, [p], 24)[p] == got[p], p
