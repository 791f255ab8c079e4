"""``--skip-layers``: skipped layers take no tier, are never run, read nor copied.

The plan places them nowhere and moves the layers after them up; the model passes the hidden
state through them unchanged; on the real pipeline the reader and dma daemons count the layers
they moved, and a skipped one is never among them, while the greedy tokens equal an in-process
run of the same skip set.
"""

from __future__ import annotations

import numpy as np
import pytest

from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.backend import Pick, make_backend, plan_for
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.model import FileLayerStream, LlamaModel
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.config import EngineOptions, InstanceConfig
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import open_model
from ntx.shared.messages import EngineRequest
from ntx.shared.plan import RAM, SKIPPED, STORAGE, VRAM

from .pipeline_util import ntxctl, own_instance, running_pipeline


@pytest.fixture(scope="module")
def index(smollm2_path):
    return open_model(str(smollm2_path))


def _plan(index, **kw):
    return plan_for(index, InstanceConfig(model=index.paths[0], backend="cpu", vram_budget=8 << 30, **kw))


def test_plan_places_skipped_layers_nowhere_and_moves_the_rest_up(index):
    plain = _plan(index, gpu_layers=10, ram_budget=30 << 20, placement="first")
    skip = [3, 15, 27]
    plan = _plan(index, gpu_layers=10, ram_budget=30 << 20, skip_layers=skip, placement="first")
    assert plan.layers_on(SKIPPED) == skip
    # ten layers still run resident: the first ten that are not skipped
    assert plan.layers_on(VRAM) == [i for i in range(30) if i not in skip][:10]
    assert not set(skip) & set(plan.streamed_layers)
    assert plan.skipped_layer_bytes == sum(index.layers[i].nbytes for i in skip)
    # what the plan no longer holds or streams is exactly the skipped layers' bytes
    assert (plain.vram_layer_bytes + plain.streamed_bytes_per_pass) - (plan.vram_layer_bytes + plan.streamed_bytes_per_pass) \
        == plan.skipped_layer_bytes
    text = "\n".join(plan.describe())
    assert "skipped" in text and "3,15,27" in text and "never read, copied nor run" in text
    spread = _plan(index, gpu_layers=10, ram_budget=30 << 20, skip_layers=skip)
    assert len(spread.layers_on(VRAM)) == 10 and not set(skip) & set(spread.layers_on(VRAM))


def test_plan_all_resident_when_the_kept_layers_fit(index):
    plan = _plan(index, skip_layers=[0, 29])
    assert plan.tiers[0] == plan.tiers[29] == SKIPPED
    assert set(plan.tiers[1:29]) == {VRAM} and plan.streamed_layers == []


@pytest.mark.parametrize("skip, says", [([30], "layers 0-29"), (list(range(30)), "keep at least one")])
def test_plan_refuses_bad_skip_sets(index, skip, says):
    with pytest.raises(ConfigError, match=says):
        _plan(index, skip_layers=skip)


class CountingStream(FileLayerStream):
    """The file stream, counting which layers it was asked for."""

    def __init__(self, index) -> None:
        super().__init__(index)
        self.acquired: set[int] = set()

    def acquire(self, layer_idx, pass_id):
        self.acquired.add(layer_idx)
        return super().acquire(layer_idx, pass_id)


def _logits(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    model.backend.alloc_sequence(0, 64)
    try:
        return model.forward(StepBatch([SeqChunk(0, 0, tuple(tokens))]))
    finally:
        model.backend.free_sequence(0)


def test_a_skipped_layer_is_never_run_nor_streamed(index):
    """With skipped layers a pass equals the pass through the other layers alone (the
    self-draft's ``draft_forward``, an independent path), whether the kept layers are resident
    or streamed; the stream is never asked for a skipped layer."""
    tokens = [1, 504, 3458, 314, 4119, 282]
    skip = [2, 5, 6, 17]
    kept = [i for i in range(30) if i not in skip]
    full = LlamaModel(index, make_backend("cpu", index, max_seqs=1, max_ctx=64))
    full.backend.alloc_sequence(0, 64)
    batch = StepBatch([SeqChunk(0, 0, tuple(tokens))])
    want = full.draft_forward(batch, kept, [Pick(0)])[0].row
    plain = full.forward(StepBatch([SeqChunk(0, 0, tuple(tokens))]))[0]
    full.backend.free_sequence(0)
    assert not np.allclose(want, plain, atol=1e-3), "skipping these layers must change the logits"

    resident = LlamaModel(index, make_backend("cpu", index, max_seqs=1, max_ctx=64), skip_layers=skip)
    assert set(resident.resident) == set(kept)
    np.testing.assert_allclose(_logits(resident, tokens)[0], want, rtol=1e-5, atol=1e-5)

    stream = CountingStream(index)
    streamed = LlamaModel(index, make_backend("cpu", index, max_seqs=1, max_ctx=64), resident_layers=[0, 1, 3, 4],
                          stream=stream, skip_layers=skip)
    np.testing.assert_allclose(_logits(streamed, tokens)[0], want, rtol=1e-5, atol=1e-5)
    assert stream.acquired == set(kept) - {0, 1, 3, 4}


def _greedy(engine, prompt: str, n: int) -> list[int]:
    ids = engine.prompt_tokens(prompt=prompt, raw=True)
    engine.submit(EngineRequest(id="r", prompt_tokens=ids, params=SamplingParams(temperature=0.0, max_tokens=n)))
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                return ev["tokens"]
    raise AssertionError("no done event")


@pytest.mark.slow
def test_pipeline_never_reads_nor_copies_a_skipped_layer(smollm2_path, tmp_path):
    """Real daemons, mixed tiers, one skipped layer in each: the reader's, dma's and compute's
    own counts of the layers they moved hold every streamed layer and no skipped one (the
    pinned-RAM tier is loaded from the plan's ram layers alone), and the tokens equal
    the in-process engine with the same skip set."""
    skip = [3, 15, 27]
    prompt, n = "The capital of France is", 6
    want = _greedy(build_local_engine(str(smollm2_path), options=EngineOptions(skip_layers=skip)), prompt, n)
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "10", "--ram-budget", "30MiB",
                          "--skip-layers", "3,15,27", name="skip") as p:
        st = p.status()
        tiers = st["plan"]["tiers"]
        assert [i for i, t in enumerate(tiers) if t == SKIPPED] == skip
        storage = [i for i, t in enumerate(tiers) if t == STORAGE]
        streamed = [i for i, t in enumerate(tiers) if t in (RAM, STORAGE)]
        assert storage and len(streamed) > len(storage), tiers
        assert any("never read, copied nor run" in line for line in st["plan"]["lines"])
        assert p.generate_greedy(prompt, n)["tokens"] == want

        def moved(stage: str) -> set[int]:
            return {int(k) for k in p.status()["stages"].get(stage, {}).get("layer_moves", {})}

        st = p.wait_status(lambda s: {int(k) for k in s["stages"].get("dma", {}).get("layer_moves", {})} >= set(streamed)
                           and {int(k) for k in s["stages"].get("reader", {}).get("layer_moves", {})} >= set(storage),
                           "reader and dma to report the layers they moved")
        assert moved("reader") == set(storage)
        assert moved("dma") == set(streamed)
        assert moved("compute") == set(streamed)  # the slots compute ran
    # a healthy run's daemon logs say when each daemon was ready and that it stopped
    for daemon in ("compute", "dma", "reader"):
        log = (tmp_path / "logs" / "skip" / f"{daemon}.log").read_text()
        assert "gen 0: ready after" in log and "gen 0: stopped" in log, (daemon, log)


def test_cli_bad_skip_sets_are_one_line(smollm2_path, tmp_path):
    bad_profile = tmp_path / "p.json"
    bad_profile.write_text("{}")
    for spec, says in (("40", "the model has layers 0 to 29"), (str(bad_profile), "not a skip profile")):
        r = ntxctl("start", "--model", str(smollm2_path), *own_instance("skipbad"), "--backend", "cpu", "--plan-only",
                   "--skip-layers", spec)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = ntxctl("start", "--model", str(smollm2_path), *own_instance("skipplan"), "--backend", "cpu", "--plan-only",
               "--gpu-layers", "4", "--ram-budget", "0", "--skip-layers", "0-1,29")
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stdout and "0-1,29" in r.stdout
