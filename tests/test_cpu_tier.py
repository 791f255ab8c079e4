"""The cpu tier: layers kept in host RAM and computed by the host's cores beside streamed ones.

The planner's split from given rates (unit); an engine with resident, cpu-tier and streamed
layers together gives the all-CPU engine's greedy tokens on the real SmolLM2, bit for bit on the
cpu backend (the same kernels run every layer), with speculation's KV moves and several
sequences; the real pipeline with the three kinds of layers matches it, dma never moves a
cpu-tier layer, status shows the tier; compute killed in the middle of a pass recovers like
without the tier. (On the GPU: tests/gpu/test_cpu_tier_gpu.py.)
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from ntx.ctl import instance
from ntx.ctl.client import ClientError
from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.backend import memory_costs, plan_for
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.config import EngineOptions, InstanceConfig
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import open_model
from ntx.shared.messages import EngineRequest
from ntx.shared.plan import (CPU, GPU, RAM, STORAGE, STREAMED, TIER, VRAM, WIDE_PASS_ROWS, HostRates, PassRoads, Plan,
                             cpu_split, make_plan, spread_pick, tier_share_pass_s, tier_streamed_in_pass)

from .pipeline_util import ntxctl, running_pipeline

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
N_TOKENS = 12


# -- the planner's split (unit) -----------------------------------------------------------------
@pytest.mark.parametrize("link, cpu, layers, want", [
    (50.0, 50.0, 10, 5),  # equal roads: half each
    (60.0, 20.0, 8, 2),  # the host a third of the link: a quarter on the host
    (20.0, 60.0, 8, 6),
    (50.0, 0.5, 10, 0),  # a host this slow takes nothing
    (0.5, 50.0, 10, 10),  # a link this slow: everything on the host
])
def test_cpu_split_balances_the_two_roads(link, cpu, layers, want):
    assert cpu_split([100] * layers, HostRates(link, cpu)) == want


def test_cpu_split_minimises_the_slower_road_with_unequal_layers():
    sizes = [300, 100, 100, 100, 100, 300]
    rates = HostRates(10.0, 10.0)
    n = cpu_split(sizes, rates)

    def slower(count: int) -> float:
        cpu = sum(sizes[i] for i in spread_pick(list(range(len(sizes))), count))
        return max(cpu / rates.cpu_gbps, (sum(sizes) - cpu) / rates.link_gbps)

    assert slower(n) == min(slower(c) for c in range(len(sizes) + 1))


def test_a_shares_pass_time_runs_each_layer_on_its_road():
    """Two tier layers of 1 GB around a streamed one, cores and link at 50 GB/s (20 ms a layer),
    the GPU's time not counted: both tier layers on the cores (the second 3x slower: 60 ms),
    the link copying the streamed one meanwhile; or the first streamed too."""
    rates = HostRates(50.0, 50.0)
    roads = PassRoads((TIER, STREAMED, TIER), (10**9,) * 3, slots=2)
    assert tier_share_pass_s(roads, rates, 3.0, []) == pytest.approx(0.060 + 0.060)
    # the first tier layer streamed: two copies back to back (40 ms), then the cores' 60 ms
    assert tier_share_pass_s(roads, rates, 3.0, [0]) == pytest.approx(0.040 + 0.060)
    assert tier_share_pass_s(roads, rates, 3.0, [0, 1]) == pytest.approx(0.060)  # three copies


def test_a_pass_of_several_rows_streams_the_share_of_the_tier_its_slower_cores_leave():
    """The planner balanced the roads for one row (here 8 tier layers between 8 streamed ones,
    equal speeds); a pass whose cores take s times as long per byte moves the share that ends it
    soonest: none at s = 1, all of it when the cores are very slow, more as s grows, and never
    slower than keeping the tier whole on the cores or moving it whole."""
    rates = HostRates(50.0, 50.0)
    roads = PassRoads((TIER, STREAMED) * 8, (10**9,) * 16, slots=16)
    everything = list(range(8))
    assert tier_streamed_in_pass(roads, rates, 1.0) == []
    assert tier_streamed_in_pass(roads, rates, 1000.0) == everything
    counts = []
    for slowdown in (1.0, 1.5, 2.0, 3.0, 5.0, 10.0):
        moved = tier_streamed_in_pass(roads, rates, slowdown)
        kept = [j for j in everything if j not in moved]
        assert kept == spread_pick(everything, 8 - len(moved))  # spread among the tier's layers
        none, whole = (tier_share_pass_s(roads, rates, slowdown, m) for m in ([], everything))
        assert tier_share_pass_s(roads, rates, slowdown, moved) <= min(none, whole)
        counts.append(len(moved))
    assert counts == sorted(counts) and 0 < counts[2] < 8, counts
    # a share not min_gain faster than streaming the whole tier: the whole tier (at 5x, one
    # layer of eight kept on the cores saves 20 ms of 320)
    five = tier_streamed_in_pass(roads, rates, 5.0)
    assert len(five) < 8
    assert tier_share_pass_s(roads, rates, 5.0, five) > 0.9 * tier_share_pass_s(roads, rates, 5.0, everything)
    assert tier_streamed_in_pass(roads, rates, 5.0, min_gain=0.1) == everything
    three = tier_streamed_in_pass(roads, rates, 3.0)
    assert 0 < len(three) < 8 and tier_streamed_in_pass(roads, rates, 3.0, min_gain=0.1) == three


def test_the_rings_slots_bound_the_share():
    """The tier's layers ahead of the streamed ones (4 resident, 8 tier, 8 streamed): with a
    slot for every layer the link copies the streamed layers while the cores work, so a pass 3x
    slower on the cores keeps part of the tier there; with the ring's two slots the link fills
    them and waits for the cores, and the whole tier streams (the H200's batch-8 runs:
    docs/PERFORMANCE.md, "Part of the tier in passes of a few rows")."""
    rates = HostRates(50.0, 50.0)
    kinds = (GPU,) * 4 + (TIER,) * 8 + (STREAMED,) * 8
    many, two = (PassRoads(kinds, (10**9,) * 20, slots) for slots in (16, 2))
    assert 0 < len(tier_streamed_in_pass(many, rates, 3.0)) < 8
    assert tier_streamed_in_pass(two, rates, 3.0) == list(range(8))
    # what the bytes alone say (HostRates.pass_s) would keep some on the cores there too: the
    # slots are what makes the difference
    assert cpu_split([10**9] * 8, rates, 0) > 0
    assert tier_streamed_in_pass(PassRoads((STREAMED,) * 4, (10**9,) * 4, 2), rates, 3.0) == []  # no tier


def test_the_two_roads_share_the_host_memory():
    """The pass model the split uses, against the 70B runs on the H200 (PERFORMANCE.md, "The cpu
    tier"): link 55.27 GB/s, cores 44.5 GB/s alone, host memory 79.87 GB/s. With 8 and 17
    cpu-tier layers the passes took 302.5 and 296.7 ms (compute's own ~10 ms on top of the model's
    two roads); the split it picks puts about a third of the bytes on the host, not half."""
    rates = HostRates(55.27, 44.5, 79.87)
    assert rates.pass_s(int(4.10e9), int(15.95e9)) == pytest.approx(0.2925, rel=0.05)
    assert rates.pass_s(int(8.63e9), int(11.41e9)) == pytest.approx(0.2867, rel=0.05)
    layer = int(20.05e9 / 39)
    n = cpu_split([layer] * 39, rates)
    assert 11 <= n <= 15  # C / S about (79.87 - 55.27) / 55.27
    assert rates.pass_s(n * layer, (39 - n) * layer) < rates.pass_s(17 * layer, 22 * layer)
    # without the shared memory the split would be the old one, about half
    assert cpu_split([layer] * 39, HostRates(55.27, 44.5)) >= 17


def test_the_roads_measured_together_size_the_split():
    """With each road's speed measured while the other runs (``probes.roads_together``), both run
    at those speeds until one is done, then the other alone. The 70B on the H200 computed its tier
    at ~32 GB/s in the pipeline against 44.5 alone, whether the link was busy or not: with that,
    the balance lies where the cores' and the link's shares end together."""
    rates = HostRates(55.0, 44.5, 80.0, cpu_beside_link_gbps=32.0, link_beside_cpu_gbps=54.0)
    assert rates.shared_gbps() == (32.0, 54.0)
    # the link ends first: the cores run on alone at 44.5
    assert rates.pass_s(int(6.4e9), int(10.8e9)) == pytest.approx(0.2 + (6.4 - 6.4) / 44.5, rel=1e-6)
    assert rates.pass_s(int(8.0e9), int(5.4e9)) == pytest.approx(0.1 + (8.0 - 3.2) / 44.5, rel=1e-6)
    # the cores end first: the link runs on alone at 55
    assert rates.pass_s(int(3.2e9), int(10.8e9)) == pytest.approx(0.1 + (10.8 - 5.4) / 55.0, rel=1e-6)
    assert rates.pass_s(0, int(11e9)) == pytest.approx(0.2, rel=1e-6)
    layer = int(0.513e9)
    n = cpu_split([layer] * 40, rates)
    assert 13 <= n <= 16  # 40 * 32 / (32 + 54) = 14.9: where both roads take the same time
    assert rates.pass_s(n * layer, (40 - n) * layer) < min(rates.pass_s(10 * layer, 30 * layer),
                                                           rates.pass_s(17 * layer, 23 * layer))
    # measured together, the memory's bandwidth no longer steers the split
    assert cpu_split([layer] * 40, HostRates(55.0, 44.5, 60.0, cpu_beside_link_gbps=32.0)) == n
    assert "32.0 beside the link" in rates.describe() and "54.0 beside them" in rates.describe()


def test_the_gpus_share_of_the_chain_moves_layers_to_the_link():
    """A pass is one chain: the cores wait while the GPU computes the other layers. The 70B run on
    the H200 with 16 tier layers (rates measured at its start: link 55.1 / 51.2 beside the cores,
    cores 42.1 / 34.4 beside the link) took 288 ms, compute busy 99.4%: the cores' 8.21 GB at
    31.9 GB/s (258 ms) and ~29 ms of the GPU's work. Counting the GPU's time, the split moves
    layers back to the link, and a pass is never predicted shorter than its chain."""
    rates = HostRates(55.14, 42.14, 66.58, cpu_beside_link_gbps=34.38, link_beside_cpu_gbps=51.21)
    with_gpu = HostRates(55.14, 42.14, 66.58, cpu_beside_link_gbps=34.38, link_beside_cpu_gbps=51.21, gpu_gbps=1000.0)
    layer, resident = int(0.5132e9), 40 * int(0.5132e9)
    n_plain, n_gpu = cpu_split([layer] * 40, rates), cpu_split([layer] * 40, with_gpu, resident)
    assert n_gpu < n_plain == 16
    for n in (8, 14, 16, 24):
        gpu_bytes = resident + (40 - n) * layer
        chain_s = n * layer / 34.38e9 + gpu_bytes / 1000e9
        assert with_gpu.pass_s(n * layer, (40 - n) * layer, gpu_bytes) >= min(chain_s, n * layer / 42.14e9 + gpu_bytes / 1000e9)
        assert with_gpu.pass_s(n * layer, (40 - n) * layer, gpu_bytes) >= (40 - n) * layer / 55.14e9
    assert with_gpu.pass_s(0, 0, resident) == pytest.approx(resident / 1000e9)


def test_the_roads_probe_says_why_it_could_not_measure(smollm2_path, monkeypatch):
    """Where the link cannot be measured (here: no cupy, or no GPU), the probe raises one line
    naming why, and plan_for then plans without a cpu tier."""
    pytest.importorskip("numba")
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is here: the probe would measure")
    except ImportError:
        pass
    from ntx.daemons.compute.probes import roads_together

    index = open_model(str(smollm2_path))
    with pytest.raises(RuntimeError, match="the link probe: .*cupy"):
        roads_together(index, [0, 1], min_time_s=0.01, timeout_s=60)


def test_the_cores_are_timed_on_every_kind_of_layer_the_tier_may_take(tmp_path):
    """A 70B Q4_K_M's layers come in two kinds, with Q6_K attn_v and ffn_down (40 of 80) and
    without; the cores compute a Q6_K byte at about half a Q4_K byte's speed, so the probe times
    both kinds and weighs them by their bytes among the layers the tier may take. Three layers of
    one kind (14, 41, 67) made the H200 host's cores look 1.6x faster than the tier then ran."""
    import synth_gguf as sg
    from .synth_models import write_header_only_gguf

    from ntx.daemons.compute.probes import layer_kinds, mixed_gbps, probe_layers

    index = open_model(write_header_only_gguf(tmp_path / "l70.gguf", sg.preset_config("llama3-70b", type="Q4_K_M")))
    kinds = list(layer_kinds(index, range(80)).values())
    assert sorted(map(len, kinds)) == [40, 40]
    with_q6k = next(k for k in kinds if 0 in k)
    assert with_q6k[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15]
    for candidates in (list(range(80)), [1, 3, 5, 6, 7, 8, 10, 11, 13, 14]):
        picked = probe_layers(index, candidates, 3)
        assert len(picked) == 3 and set(picked) <= set(candidates)
        assert {i in with_q6k for i in picked} == {True, False}  # both kinds
    assert probe_layers(index, [10, 11, 13, 14], 3) == [10, 13, 14]  # one kind: spread over it
    # half the bytes at 90 GB/s, half at 45: 60 GB/s over the whole, not their mean
    assert mixed_gbps({"a": 90.0, "b": 45.0}, {"a": 100, "b": 100}) == pytest.approx(60.0)


def test_spread_pick_alternates():
    assert spread_pick(list(range(10)), 5) == [1, 3, 5, 7, 9]
    assert spread_pick([4, 5, 6], 0) == [] and spread_pick([4, 5, 6], 9) == [4, 5, 6]


@pytest.fixture(scope="module")
def index(smollm2_path):
    return open_model(str(smollm2_path))


def _cfg(index, backend="cpu", **kw) -> InstanceConfig:
    kw = {"vram_budget": 80 << 20, "ram_budget": 1 << 30, "ctx": 512, "max_batch": 2, **kw}
    return InstanceConfig(model=index.paths[0], backend=backend, **kw).validate()


def _plan(index, cfg: InstanceConfig, rates: HostRates | None = None) -> Plan:
    sizes = dict(max_seqs=cfg.max_batch, max_ctx=cfg.ctx, max_pass_rows=cfg.largest_pass_rows)
    return make_plan(index, cfg, memory_costs(cfg.backend, index, **sizes), rates=rates,
                     host_layer_bytes=memory_costs("cpu", index, **sizes).layer_bytes)


def test_plan_places_the_cpu_tier_among_the_streamed_layers(index):
    plan = _plan(index, _cfg(index, cpu_layers=8))
    cpu, vram = plan.layers_on(CPU), plan.layers_on(VRAM)
    streamed = plan.streamed_layers
    assert len(cpu) == 8 and not set(cpu) & set(vram) and not set(cpu) & set(streamed)
    assert sorted(cpu + vram + streamed) == list(range(30))
    rest = sorted(cpu + streamed)
    assert cpu == spread_pick(rest, 8)  # spread: they alternate with streamed layers
    assert plan.cpu_layer_bytes == sum(index.layers[i].nbytes for i in cpu)
    assert plan.streamed_bytes_per_pass == sum(index.layers[i].nbytes for i in streamed)
    assert plan.cpu_held_bytes == sum(memory_costs("cpu", index, max_seqs=1, max_ctx=32,
                                                   max_pass_rows=1).layer_bytes[i] for i in cpu)
    lines = "\n".join(plan.describe())
    assert "host CPU          8 layers" in lines and "held in host RAM" in lines
    assert Plan.from_dict(plan.to_dict()) == plan
    # without the flag the cpu backend keeps none (its resident layers are host memory already)
    assert not _plan(index, _cfg(index)).layers_on(CPU)


def test_plan_auto_split_from_rates_on_cuda(index):
    cfg = _cfg(index, backend="cuda", vram_budget=373 << 20)
    base = _plan(index, cfg)
    assert not base.layers_on(CPU)  # no rates given, none measured here: no tier
    plan = _plan(index, cfg, HostRates(link_gbps=30.0, cpu_gbps=10.0, how="given"))
    rest = sorted(plan.layers_on(CPU) + plan.streamed_layers)
    assert len(plan.layers_on(CPU)) == cpu_split([index.layers[i].nbytes for i in rest], HostRates(30.0, 10.0)) > 0
    # wide passes stream the tier's layers through the ring's slots (dma keeps their bytes): no
    # staging buffer, so the tier costs no resident layer
    assert plan.device_slot_bytes_total == cfg.ring_slots * plan.slot_bytes
    assert len(rest) == len(base.streamed_layers) and plan.layers_on(VRAM) == base.layers_on(VRAM)
    assert plan.tier_wide_rows == WIDE_PASS_ROWS and plan.wide_streamed_layers == plan.layers_on(CPU)
    assert Plan.from_dict(plan.to_dict()).wide_streamed_layers == plan.layers_on(CPU)  # as dma reads it
    text = "\n".join(plan.describe())
    assert "a one-row pass: about" in text and "given" in text
    # everything on the host: nothing streams, so compute copies the tier's layers in wide passes
    # through its one staging buffer, in the room of the ring's slots
    every = _plan(index, _cfg(index, backend="cuda", vram_budget=373 << 20, cpu_layers=30))
    assert not every.streamed_layers and every.device_slot_bytes_total == every.slot_bytes
    assert not every.wide_streamed_layers and every.layers_on(VRAM) == base.layers_on(VRAM)


def test_the_batch_invariant_mode_keeps_no_cpu_tier(index):
    """On cuda the tier runs a narrow pass's layers on the host's cores and a wide pass's on the
    GPU: two kernels, so a row's bits would depend on its pass's width. The batch-invariant mode
    plans none (auto), says why among the plan's slower notes, reserves no staging buffer, and
    refuses an explicit count with the fix."""
    rates = HostRates(link_gbps=30.0, cpu_gbps=10.0, how="given")
    cfg = _cfg(index, backend="cuda", vram_budget=373 << 20, kernels="batch-invariant=on")
    plan = _plan(index, cfg, rates)
    default = _plan(index, _cfg(index, backend="cuda", vram_budget=373 << 20), rates)
    assert default.layers_on(CPU) and not plan.layers_on(CPU)
    assert plan.device_slot_bytes_total == cfg.ring_slots * plan.slot_bytes and plan.tier_wide_rows is None
    assert any("no cpu tier" in note and "batch-invariant" in note for note in plan.speed_notes)
    with pytest.raises(ConfigError, match="--cpu-layers 4: under --kernels batch-invariant=on .* --cpu-layers 0"):
        _cfg(index, backend="cuda", kernels="batch-invariant=on", cpu_layers=4)
    _cfg(index, backend="cuda", kernels="batch-invariant=on", cpu_layers=0)  # fine


def test_plan_cpu_tier_within_the_ram_budget(index):
    with pytest.raises(ConfigError, match="--cpu-layers 20: .* --ram-budget"):
        _plan(index, _cfg(index, cpu_layers=20, ram_budget=10 << 20))
    # auto holds fewer where the budget is short
    plan = _plan(index, _cfg(index, backend="cuda", vram_budget=373 << 20, ram_budget=10 << 20), HostRates(1.0, 100.0))
    assert 0 < plan.cpu_held_bytes <= 10 << 20
    assert not plan.layers_on(RAM)  # the pinned copies had no room left
    with pytest.raises(ConfigError, match="--cpu-layers -1"):
        _cfg(index, cpu_layers=-1)


# -- the engine: three kinds of layers, the all-CPU tokens --------------------------------------
def _greedy_all(engine, prompts: list[str], n: int, **fields) -> dict[str, list[int]]:
    for p in prompts:
        engine.submit(EngineRequest(p, engine.prompt_tokens(prompt=p, raw=True),
                                    SamplingParams(temperature=0.0, max_tokens=n), **fields))
    out = {}
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                out[ev["id"]] = ev["tokens"]
    return out


@pytest.fixture(scope="module")
def reference(smollm2_path) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS, batched, every layer resident on the cpu backend."""
    return _greedy_all(build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256)),
                       PROMPTS, N_TOKENS)


RESIDENT = [0, 1, 2, 10, 11, 20, 29]
HOST = [3, 4, 12, 13, 14, 21, 22, 23, 24, 25]  # runs of one and of several; the rest streams from the file


def test_engine_with_resident_host_and_streamed_layers_equals_all_resident(smollm2_path, reference):
    eng = build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256),
                             resident_layers=RESIDENT, host_layers=HOST)
    model = eng.core.model
    kinds = {kind for _, _, kind in model.runs}
    assert kinds == {"resident", "host", "streamed"} and model.host_layers == HOST
    assert set(model.resident) == set(RESIDENT) and not set(model.streamed_layers) & set(HOST)
    assert _greedy_all(eng, PROMPTS, N_TOKENS) == reference
    report = model.host.report()
    assert report["layers"] == len(HOST) and report["bytes"] > 0 and report["busy_s"] > 0
    # the tier holds K/V only of its own layers, in pages numbered as the backend's
    host_cpu = model.host.cpu
    assert host_cpu.kv_pool is model.backend.kv_pool and host_cpu.kv_layers == HOST


def test_speculation_moves_the_cpu_tiers_keys_too(smollm2_path, reference):
    """Prompt lookup drafts, and the accepted path's K/V move (``kv_keep``) in every layer, the
    tier's included: the greedy tokens stay the reference's."""
    eng = build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256, draft="ngram",
                                                                       draft_tokens=4),
                             resident_layers=RESIDENT, host_layers=HOST)
    prompt = "one two three four five one two three four five one two three four five one two"
    want = _greedy_all(build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256)),
                       [prompt], 24)
    got = _greedy_all(eng, [prompt], 24)
    assert got == want
    assert eng.core.spec.accepted > 0  # drafts were accepted: K/V moved


def test_a_qwen2_models_tier_layers_keep_their_biases_and_pairs(tmp_path):
    """A Qwen2-shaped model (q, k, v biases in each layer's image; halves rotated) with resident,
    cpu-tier and streamed layers: the tier's layers, read from the file's bytes into the host's
    own backend, add their biases and reorder their heads as a resident layer does, in passes on
    the host's cores and in wide ones (``host_wide_rows`` 2: the prompt's) alike."""
    from .synth_models import write_tiny

    model = str(write_tiny(tmp_path, "qwen2.gguf", n_layers=6, arch="qwen2", type="Q4_K_M", seed=7))
    prompts = ["The history of the transistor begins", "def fibonacci(n):"]
    want = _greedy_all(build_local_engine(model, options=EngineOptions(max_batch=4, ctx=128)), prompts, 10)
    eng = build_local_engine(model, options=EngineOptions(max_batch=4, ctx=128), resident_layers=[0, 5],
                             host_layers=[1, 3], host_wide_rows=2)
    kinds = {kind for _, _, kind in eng.core.model.runs}
    assert kinds == {"resident", "host", "streamed"}
    assert _greedy_all(eng, prompts, 10) == want
    tier = eng.core.model.host
    assert tier.runs > 0 and tier.wide_passes > 0  # both paths ran the tier's layers


@pytest.mark.parametrize("streams", [True, False], ids=["through-the-stream", "staged"])
def test_wide_passes_run_the_tier_on_the_backend_and_keep_both_caches(smollm2_path, reference, streams):
    """Passes wider than ``wide_rows`` (here 2: prompts and the 3-sequence decode) run the tier's
    layers on the backend, narrower ones on the host's cores; each path writes both caches of
    those layers, so the tokens stay the reference's whichever path ran which pass (on a GPU the
    backend is cuda; here the cpu backend stands in for it). Where other layers stream, a wide
    pass's stream brings the tier's layers among them (here from the file; in the pipeline dma,
    from its pinned RAM): the tier keeps no file bytes of its own. Where nothing else streams,
    the tier copies its file bytes itself (``staged``)."""
    resident = RESIDENT if streams else [i for i in range(30) if i not in HOST]
    eng = build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256),
                             resident_layers=resident, host_layers=HOST, host_wide_rows=2)
    model = eng.core.model
    tier = model.host
    assert tier.wide_rows == 2 and tier.staged == (not streams) and bool(tier.raw) == (not streams)
    assert (model.stream is not None and model.stream.wide_layers == HOST) == streams
    if streams:  # a wide pass's runs: the tier's layers stream with the others, in layer order
        model.stream.begin_pass(10**6, tier_layers=HOST)
        assert {kind for _, _, kind in model._runs_for(10**6)} == {"resident", "streamed"}
        model.stream.begin_pass(10**6 + 1)
        assert "host" in {kind for _, _, kind in model._runs_for(10**6 + 1)}
    assert _greedy_all(eng, PROMPTS, N_TOKENS) == reference  # prompts and batched decode: wide
    wide = tier.wide_passes
    assert wide > 0
    runs = tier.runs
    assert _greedy_all(eng, PROMPTS[:1], N_TOKENS) == {PROMPTS[0]: reference[PROMPTS[0]]}  # decode alone: host
    assert tier.runs > runs and tier.wide_passes == wide + 1  # its prompt ran wide, its decode on the host
    assert tier.report()["wide_passes"] == tier.wide_passes


def test_a_pass_of_several_rows_runs_part_of_the_tier_on_the_host_and_streams_the_rest(smollm2_path, reference,
                                                                                         monkeypatch):
    """With the plan's speeds and the cores' times by width, a pass of several rows takes only
    part of the tier from the stream (``HostTier.streamed_in``) and runs the rest on the host's
    cores, in one pass; each path writes both caches, so the tokens stay the reference's, batched
    and alone. Here the share is fixed (``NTX_TIER_WIDE_STREAMED``), as the pipeline test does; the
    choice from speeds is checked on made-up times below."""
    monkeypatch.setenv("NTX_TIER_WIDE_STREAMED", "4")
    eng = build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4, ctx=256),
                             resident_layers=RESIDENT, host_layers=HOST, host_wide_rows=2)
    model = eng.core.model
    tier = model.host
    roads = model._pass_roads()  # what a share is chosen by: every layer's road in order
    assert roads.kinds == tuple(GPU if i in RESIDENT else TIER if i in HOST else STREAMED
                                for i in range(model.index.hparams.n_layers))
    assert roads.layer_bytes == tuple(layer.nbytes for layer in model.index.layers) and roads.slots == 1
    part = tier.streamed_in(3, lambda: None)  # a fixed share asks nothing of the roads
    assert part == tuple(spread_pick(HOST, 4)) and tier.streamed_in(2, lambda: None) == ()
    model.stream.begin_pass(10**6, tier_layers=part)
    runs = model._runs_for(10**6)
    assert [(f, e) for f, e, k in runs if k == "host"] and {i for f, e, k in runs if k == "streamed"
                                                           for i in range(f, e)} >= set(part)
    host_runs = tier.runs
    assert _greedy_all(eng, PROMPTS, N_TOKENS) == reference  # prompts and batched decode: part of the tier each
    assert tier.wide_passes > 0 and tier.runs > host_runs  # the same passes ran the rest on the host
    assert _greedy_all(eng, PROMPTS[:1], N_TOKENS) == {PROMPTS[0]: reference[PROMPTS[0]]}

    # the share from speeds (NTX_TIER_SHARE=on, an experiment): the cores timed by width, the
    # pass's rows rounded up to a timed width
    monkeypatch.delenv("NTX_TIER_WIDE_STREAMED")
    assert tier.streamed_in(8, lambda: None) == tuple(HOST)  # no speeds: all past wide_rows, as before
    tier.rates = HostRates(50.0, 50.0)
    cost = tier.time_widths(widths=(1, 2, 4), min_time_s=0.001)
    assert set(cost) == {1, 2, 4} and cost[1] == 1.0 and all(c > 0 for c in cost.values())
    tier.width_cost = {1: 1.0, 2: 1.0, 4: 3.0, 8: 100.0}
    tier._split.clear()
    # each tier layer followed by a streamed one as large, none resident, a slot for each layer
    pass_roads = PassRoads(tuple(k for _ in HOST for k in (TIER, STREAMED)),
                           tuple(tier.layer_bytes[i] for i in HOST for _ in range(2)), slots=2 * len(HOST))

    def roads() -> PassRoads:
        return pass_roads
    assert tier.streamed_in(3, roads) == tuple(HOST)  # off by default: all past wide_rows
    monkeypatch.setenv("NTX_TIER_SHARE", "on")
    assert tier.streamed_in(1, roads) == ()  # one row: the plan's split
    assert tier.streamed_in(2, roads) == ()  # no slower at 2 rows: all on the host
    three = tier.streamed_in(3, roads)  # 3 rows: as 4, three times slower
    assert 0 < len(three) < len(HOST) and three == tier.streamed_in(4, roads)
    # the tier ahead of the streamed layers and two slots: the link would wait for the cores,
    # so the whole tier streams; the roads a pass is asked with are weighed again when they change
    blocked = PassRoads((TIER,) * len(HOST) + (STREAMED,) * len(HOST), pass_roads.layer_bytes, slots=2)
    assert tier.streamed_in(4, lambda: blocked) == tuple(HOST)
    assert tier.streamed_in(4, roads) == three
    assert tier.streamed_in(7, roads) == tuple(HOST)  # 100 times slower: all of it
    tier.width_cost[32] = 1.0
    assert tier.streamed_in(17, roads) == tuple(HOST)  # past SHARE_ROWS: all of it, whatever
    assert tier.report()["streamed_by_rows"] == {"2": 0, "4": len(three), "8": len(HOST)}
    predicted = tier.report()["share_predicted_ms"]  # the ring model's pass, for status
    assert set(predicted) == {"2", "4", "8"} and predicted["4"]["share"] < predicted["4"]["whole_tier"]
    assert predicted["8"]["share"] == predicted["8"]["whole_tier"]  # the whole tier is the share
    # what the tier's own passes measure replaces the products' times: 4-row passes at 50 GB/s
    # (the plan's one-row speed) keep the whole tier on the host again; a 1% change keeps the share
    tier._s_per_byte.clear()
    tier._learn_width(3, 1.0, 50 * 10**9)
    assert tier.host_slowdown(4) == pytest.approx(1.0) and tier.streamed_in(4, roads) == ()
    tier._learn_width(4, 1.01 * 4, 50 * 10**9)  # 4x slower per byte, a running mean of 0.7 / 0.3
    assert tier.host_slowdown(4) == pytest.approx(0.7 + 0.3 * 4.04)
    assert len(tier.streamed_in(4, roads)) > 0
    assert tier.report()["slowdown_by_rows"] == {"4": pytest.approx(1.912, abs=1e-3)}
    # the engine's own passes choose through the model's roads (every layer in order, the file
    # stream's one slot): three sequences decode in passes of 3 rows (a width of 4), and the
    # tokens stay the reference's
    tier._s_per_byte.clear()
    tier._split.clear()
    tier.width_cost = {1: 1.0, 2: 1.0, 4: 3.0, 8: 100.0, 16: 100.0}
    assert _greedy_all(eng, PROMPTS, N_TOKENS) == reference
    assert "4" in tier.report()["streamed_by_rows"]


# -- the pipeline -------------------------------------------------------------------------------
def _tiers(status: dict) -> tuple[list[str], list[int], list[int]]:
    """A running instance's plan: (every layer's tier, the cpu tier's layers, the streamed ones)."""
    tiers = status["plan"]["tiers"]
    return (tiers, [i for i, t in enumerate(tiers) if t == CPU],
            [i for i, t in enumerate(tiers) if t in (RAM, STORAGE)])


@pytest.mark.slow
def test_pipeline_with_a_cpu_tier_equals_reference_and_recovers(smollm2_path, run_dir, reference):
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "6", "--cpu-layers", "8", "--ram-budget",
                          "40MiB", "--ctx", "256", "--max-batch", "4", name="cputier") as p:
        st = p.status()
        tiers, cpu, streamed = _tiers(st)
        assert len(cpu) == 8 and streamed and tiers.count(VRAM) == 6, tiers
        assert any(line.startswith("host CPU") for line in st["plan"]["lines"]), st["plan"]["lines"]
        for prompt in PROMPTS:
            assert p.generate_greedy(prompt, N_TOKENS)["tokens"] == reference[prompt], prompt
        st = p.wait_status(lambda s: "cpu_tier" in s["stages"].get("compute", {})
                           and {int(k) for k in s["stages"].get("dma", {}).get("layer_moves", {})} >= set(streamed),
                           "compute to report its cpu tier and dma the layers it moved")
        tier = st["stages"]["compute"]["cpu_tier"]
        assert tier["layers"] == 8 and tier["bytes"] > 0 and tier["busy_gbps"] > 0
        assert not {int(k) for k in st["stages"]["dma"]["layer_moves"]} & set(cpu)  # never copied
        r = ntxctl("status", "--name", "cputier")
        assert r.returncode == 0 and "host CPU" in r.stdout and "cpu tier" in r.stdout, r.stdout

        # compute killed while a request runs (its passes go through the tier): one clear
        # error to that client, the pipeline restarts and serves the same tokens
        gen = st["gen"]
        pid = st["daemons"]["compute"]["pid"]
        with p.client() as c:
            rid = c.submit("Once upon a time", raw=True, temperature=0.0, max_tokens=200)
            assert c.next_event(rid, 120)["type"] == "token"
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ClientError) as err:
                for _ in c.events(rid):
                    pass
            assert err.value.code == "pipeline_failure" and "compute" in str(err.value)
        st = p.wait_state("ready", min_gen=gen + 1)
        assert st["daemons"]["compute"]["pid"] != pid
        assert p.generate_greedy(PROMPTS[0], N_TOKENS)["tokens"] == reference[PROMPTS[0]]
        left = [x for x in instance.leftovers("cputier") if x.startswith("shm:")]
        assert all(f"-g{st['gen']}-" in x for x in left), left


@pytest.mark.slow
@pytest.mark.parametrize("share", [None, 3], ids=["all-of-the-tier", "part-of-the-tier"])
def test_pipeline_streams_the_cpu_tiers_layers_through_dma_in_wide_passes(smollm2_path, run_dir, reference,
                                                                          monkeypatch, share):
    """A tier that leaves the host in wide passes (on cuda, passes of more than WIDE_PASS_ROWS
    rows; here NTX_TIER_WIDE_ROWS=2 makes a cpu pipeline's tier do so): dma keeps the tier's
    layer bytes with its RAM tier and streams them among a wide pass's layers (prompts, the
    3-sequence decode), while a decode alone runs them on the host's cores. All of them, or (as
    the plan's speeds choose on a GPU, ``HostTier.streamed_in``; here NTX_TIER_WIDE_STREAMED
    fixes it) part of them, the rest computed by the cores in the same pass. Across the changes
    of width (the pass asked ahead given up and asked anew) the greedy tokens stay the
    reference's, batched and alone."""
    monkeypatch.setenv("NTX_TIER_WIDE_ROWS", "2")
    if share:
        monkeypatch.setenv("NTX_TIER_WIDE_STREAMED", str(share))
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "6", "--cpu-layers", "8", "--ram-budget",
                          "60MiB", "--ctx", "256", "--max-batch", "4", name=f"cputierwide{share or ''}") as p:
        tiers, cpu, streamed = _tiers(p.status())
        assert len(cpu) == 8 and streamed, tiers
        moved = spread_pick(cpu, share) if share else cpu
        with p.client() as c:  # together: every pass wide
            rids = {c.submit(prompt, raw=True, temperature=0.0, max_tokens=N_TOKENS): prompt for prompt in PROMPTS}
            got = {}
            for rid, prompt in rids.items():
                for ev in c.events(rid):
                    if ev["type"] == "done":
                        got[prompt] = ev["tokens"]
        assert got == reference
        st = p.wait_status(lambda s: {int(k) for k in s["stages"].get("dma", {}).get("layer_moves", {})} >= set(moved),
                           "dma to report the cpu tier's layers it moved")
        assert st["stages"]["dma"]["tier_bytes"]["cpu"] > 0
        # the tier's layers it did not move ran on the host's cores in the same passes
        assert not {int(k) for k in st["stages"]["dma"]["layer_moves"]} & (set(cpu) - set(moved))
        if share:
            assert st["stages"]["compute"]["cpu_tier"]["bytes"] > 0
            assert st["stages"]["compute"]["cpu_tier"]["streamed_by_rows"]["4"] == share
            r = ntxctl("status", "--name", p.name)
            # the line lists every width recorded ("passes stream 0 at up to 2 rows, 3 at up to 4
            # rows, ..."); which narrower passes ran (sequences ending apart) is timing's
            line = " ".join(r.stdout.split())
            assert r.returncode == 0 and re.search(rf"passes stream (\d+ at up to \d+ rows, )*{share} at up to 4 rows",
                                                   line), r.stdout
        wide = st["stages"]["compute"]["cpu_tier"]["wide_passes"]
        assert wide > 0
        assert p.generate_greedy(PROMPTS[0], N_TOKENS)["tokens"] == reference[PROMPTS[0]]  # its decode: on the host
        st = p.wait_status(lambda s: s["stages"]["compute"]["cpu_tier"]["bytes"] > 0,
                           "compute to report the tier's narrow passes")
        assert st["stages"]["compute"]["cpu_tier"]["wide_passes"] > wide  # its prompt was wide

