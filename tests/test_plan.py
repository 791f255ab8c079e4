"""The tier planner: reservations first, then VRAM (spread over the model, or the first layers),
pinned RAM and storage in layer order."""

from __future__ import annotations

import pytest

from ntx.daemons.compute.cpu_kernels import packed_bytes
from ntx.shared.config import InstanceConfig, parse_size
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import open_model
from ntx.daemons.compute.backend import memory_costs, plan_for
from ntx.shared.kv_sizing import CTX_DEFAULT_CAP, FLOOR_TOKENS, PAGE_TOKENS
from ntx.shared.plan import RAM, STORAGE, VRAM, Plan


@pytest.fixture(scope="module")
def index(smollm2_path):
    return open_model(smollm2_path)


def _cfg(**kw) -> InstanceConfig:
    return InstanceConfig(model="m", **kw)


def test_everything_fits_no_slots_reserved(index):
    p = plan_for(index, _cfg(vram_budget=parse_size("8GiB"), ram_budget=0))
    assert p.tiers == (VRAM,) * 30
    assert p.device_slot_bytes_total == 0 and p.host_slot_bytes_total == 0 and p.streamed_bytes_per_pass == 0


def test_all_storage_reserves_both_rings(index):
    p = plan_for(index, _cfg(vram_budget=parse_size("8GiB"), ram_budget=0, gpu_layers=0, ring_slots=3))
    assert p.tiers == (STORAGE,) * 30
    assert p.device_slot_bytes_total == 3 * p.slot_bytes == p.host_slot_bytes_total
    assert p.streamed_bytes_per_pass == index.layer_bytes_total


def test_layers_fill_vram_then_ram_then_storage_in_order(index):
    cost = index.layers[0].nbytes
    reserved = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, ctx=1024))
    fixed = reserved.globals_bytes + reserved.kv_floor_bytes + reserved.workspace_bytes + 2 * reserved.slot_bytes
    budgets = dict(backend="cuda", vram_budget=fixed + 7 * cost + cost // 2, ctx=1024,
                   ram_budget=2 * index.max_layer_image_bytes + 10 * index.layers[0].image_bytes + 100)
    p = plan_for(index, _cfg(placement="first", **budgets))
    assert p.tiers == (VRAM,) * 7 + (RAM,) * 10 + (STORAGE,) * 13
    assert p.vram_layer_bytes == sum(index.layers[i].nbytes for i in range(7))
    # spread (the default): as many resident layers, one in each seventh of the model; the
    # streamed ones fill RAM then storage in layer order
    p = plan_for(index, _cfg(**budgets))
    assert p.layers_on(VRAM) == [2, 6, 10, 15, 19, 23, 27]
    streamed = [i for i in range(30) if i not in p.layers_on(VRAM)]
    assert p.layers_on(RAM) == streamed[:10] and p.layers_on(STORAGE) == streamed[10:]
    assert "7 layers 2,6,10,15,19,23,27" in "\n".join(p.describe())
    with pytest.raises(ConfigError, match="--placement 'middle': choose spread or first"):
        _cfg(placement="middle", **budgets).validate()


def test_each_backend_reports_its_costs(index):
    """cpu keeps its kernels' packed forms (bigger than the GGUF bytes: float32 scales) and float32
    KV pages; cuda its GGUF bytes and f16 KV pages.
    A plan's KV pool is the floor and what the layers leave, in whole chunks, at most
    KV_POOL_CAP_ROWS full contexts per --max-batch row."""
    hp, layer = index.hparams, index.layers[0]
    sizes = dict(max_seqs=8, max_ctx=1024, max_pass_rows=512 + 7)  # a 512-token prompt chunk beside 7 decode rows
    cpu, cuda = memory_costs("cpu", index, **sizes), memory_costs("cuda", index, **sizes)
    assert cuda.layer_bytes[0] == layer.nbytes
    assert cpu.layer_bytes[0] == sum(packed_bytes(t.ggml_type, *t.shape) if len(t.shape) == 2 else t.n_elements * 4
                                     for t in layer.tensors.values()) > layer.nbytes
    assert cuda.kv_bytes_per_token == 2 * hp.n_layers * hp.kv_dim * 2 and cuda.kv_tokens == 8 * 1024
    assert cpu.kv_bytes_per_token == 2 * hp.n_layers * hp.kv_dim * 4 and cpu.kv_tokens == 8 * 1024
    assert cuda.globals_bytes == index.global_bytes_total and cpu.globals_bytes > cuda.globals_bytes
    plan = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, max_batch=8, ctx=1024))
    assert (plan.workspace_bytes, plan.globals_bytes) == (cuda.workspace_bytes, cuda.globals_bytes)
    chunk_tokens = plan.kv_chunk_pages * PAGE_TOKENS
    assert 2 * 8 * 1024 <= plan.kv_tokens < 2 * 8 * 1024 + chunk_tokens  # everything fits: the cap
    assert plan.kv_bytes == plan.kv_tokens * cuda.kv_bytes_per_token and plan.ctx == 1024
    assert plan.memory_name == "VRAM" and "reserved in VRAM" in "\n".join(plan.describe())
    # the workspace holds a prompt chunk beside the 7 other sequences' decode rows, and says so
    assert plan.max_pass_rows == 512 + 7 and "(passes of up to 519 rows)" in "\n".join(plan.describe())
    assert Plan.from_dict(plan.to_dict()) == plan


def test_budget_too_small_is_one_clear_line(index):
    with pytest.raises(ConfigError, match="--vram-budget .* is too small: the global tensors, the KV cache's floor"):
        plan_for(index, _cfg(vram_budget=parse_size("10MiB"), ram_budget=0))
    with pytest.raises(ConfigError, match="is not a size"):
        parse_size("lots", "--vram-budget")
    assert parse_size("24GiB") == 24 << 30 and parse_size("1.5GB") == 1_500_000_000 and parse_size("0") == 0


def test_describe_names_every_tier(index):
    """Each tier by its name on the backend: the resident one is VRAM on cuda and compute's own
    memory on the cpu backend, which has no VRAM."""
    cfg = dict(vram_budget=parse_size("8GiB"), ram_budget=parse_size("20MiB"), gpu_layers=5, placement="first")
    lines = plan_for(index, _cfg(backend="cpu", **cfg)).describe()
    for line, label in zip(lines, ("compute memory ", "pinned RAM ", "storage ")):
        assert line.startswith(label), line
    text = "\n".join(lines)
    assert "vram" not in text.lower() and "0-4" in text
    rows = plan_for(index, _cfg(backend="cuda", **cfg)).tier_rows()
    assert [(r["tier"], r["label"]) for r in rows] == [(VRAM, "VRAM"), (RAM, "pinned RAM"), (STORAGE, "storage")]
    # a long spread set is shown by its span (status's JSON lists every layer's tier)
    text = "\n".join(plan_for(index, _cfg(vram_budget=parse_size("8GiB"), ram_budget=0, gpu_layers=14)).describe())
    assert "14 layers    within 1-28" in text


def test_demotion_order_keeps_the_resident_layers_spread():
    from ntx.shared.plan import demotion_order

    assert demotion_order([0, 1, 2, 3, 4, 5, 6, 7]) == [1, 3, 5, 7, 2, 6, 4, 0]
    order = demotion_order(list(range(2, 40, 3)))
    assert sorted(order) == list(range(2, 40, 3))  # every resident layer, once
    assert demotion_order([9]) == [9] and demotion_order([]) == []


def test_standby_copies_take_the_ram_left_after_the_ram_tier(index):
    """Where something streams, dma keeps pinned copies of resident layers, in demotion order, as
    far as the RAM budget left after the RAM tier and the host slots reaches; with nothing
    streamed there is no dma and no standby."""
    budgets = dict(backend="cuda", vram_budget=parse_size("8GiB"))
    p = plan_for(index, _cfg(gpu_layers=20, ram_budget=parse_size("1GiB"), **budgets))
    assert len(p.layers_on(RAM)) == 10 and len(p.standby_layers) == 20
    assert set(p.standby_layers) == set(p.layers_on(VRAM))
    assert p.standby_bytes == sum(index.layers[i].image_bytes for i in p.standby_layers)
    ram_tier = sum(index.layers[i].image_bytes for i in p.layers_on(RAM))
    tight = plan_for(index, _cfg(gpu_layers=20, ram_budget=ram_tier + 3 * index.max_layer_image_bytes, **budgets))
    assert len(tight.standby_layers) == 3
    assert list(tight.standby_layers) == list(p.standby_layers[:3])  # the first ones to be demoted
    assert plan_for(index, _cfg(ram_budget=parse_size("1GiB"), **budgets)).standby_layers == ()
    assert "standby" in "\n".join(p.describe())
    again = type(p).from_dict(p.to_dict())
    assert again == p


def test_the_kv_floor_comes_first_and_the_pool_takes_what_the_layers_leave(index):
    """The planner reserves the floor (FLOOR_TOKENS positions) before any layer, places layers
    as before, then gives what is left to the pool in whole chunks; standby layers raise the most
    it can grow to by their bytes."""
    cost = index.layers[0].nbytes
    big = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, ctx=1024))
    fixed = big.globals_bytes + big.kv_floor_bytes + big.workspace_bytes + 2 * big.slot_bytes
    chunk_bytes = big.kv_chunk_pages * big.kv_page_bytes
    spare = 3 * chunk_bytes + chunk_bytes // 2  # 3.5 chunks beyond 7 layers
    p = plan_for(index, _cfg(backend="cuda", vram_budget=fixed + 7 * cost + spare, ram_budget=parse_size("1GiB"),
                             placement="first", gpu_layers=7, ctx=1024))
    assert p.layers_on(VRAM) == list(range(7)) and p.kv_floor_tokens == FLOOR_TOKENS
    assert p.kv_bytes == p.kv_floor_bytes + 3 * chunk_bytes  # the floor and three whole chunks
    assert p.kv_tokens == p.kv_bytes // p.kv_page_bytes * PAGE_TOKENS
    assert len(p.standby_layers) == 7  # RAM holds copies of every resident layer
    standby_chunks = sum(index.layers[i].nbytes for i in p.standby_layers) // chunk_bytes
    assert p.kv_max_chunks == p.kv_chunks + standby_chunks > p.kv_chunks
    text = "\n".join(p.describe())
    assert f"KV cache: {p.kv_tokens} positions" in text and f"grows to {p.kv_max_tokens} positions" in text
    again = type(p).from_dict(p.to_dict())
    assert again == p


def test_ctx_defaults_to_the_trained_context_and_is_refused_beyond_it(index):
    trained = index.hparams.n_ctx_train
    p = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0))
    assert p.ctx == min(trained, CTX_DEFAULT_CAP)
    with pytest.raises(ConfigError, match=f"^--ctx {trained + 1}: the model was trained for {trained} positions; "
                                          f"choose at most {trained}, or leave --ctx out"):
        plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, ctx=trained + 1))


def test_a_ctx_no_pool_can_hold_is_one_clear_line(index):
    """One sequence at --ctx must fit the largest pool the plan can reach; otherwise the start is
    refused, naming the need and the fix."""
    big = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, ctx=8192))
    tight = big.globals_bytes + big.kv_floor_bytes + big.workspace_bytes + 2 * big.slot_bytes  # the floor, no more
    with pytest.raises(ConfigError, match="^--ctx 8192: one sequence of 8192 positions needs .* of KV cache, and this "
                                          r"plan holds at most \d+ positions .* lower --ctx, or raise --vram-budget"):
        plan_for(index, _cfg(backend="cuda", vram_budget=tight, ram_budget=0, ctx=8192, gpu_layers=0))


def test_the_plan_names_what_streams_layers_and_its_cost(index):
    """Each note is checked against the planner itself: without the cap the capped layers are
    resident; the budget named as enough for every layer is (a byte less is not); a budget larger
    by the KV floor's bytes holds as many more layers as the floor's note says it streams."""
    from ntx.shared.config import format_bytes

    ram = parse_size("1GiB")
    assert plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=ram)).speed_notes == ()
    capped = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=ram, gpu_layers=10))
    assert capped.speed_notes == (f"--gpu-layers 10 streams 20 layers that fit the budget: "
                                  f"{format_bytes(capped.streamed_bytes_per_pass)} more to move every pass",)
    assert f"slower: {capped.speed_notes[0]}" in capped.describe()
    assert type(capped).from_dict(capped.to_dict()) == capped

    cost = index.layers[0].nbytes
    big = plan_for(index, _cfg(backend="cuda", vram_budget=parse_size("8GiB"), ram_budget=0, ctx=1024))
    budget = big.globals_bytes + big.kv_floor_bytes + big.workspace_bytes + 2 * big.slot_bytes + 7 * cost + cost // 2
    p = plan_for(index, _cfg(backend="cuda", vram_budget=budget, ram_budget=ram, ctx=1024))
    held, floor = p.speed_notes
    assert held.startswith(f"--vram-budget {format_bytes(budget)} holds 7 of 30 layers: 23 stream, "
                           f"{format_bytes(p.streamed_bytes_per_pass)} every pass; every layer resident needs ")
    lo, hi = budget, parse_size("8GiB")  # the least budget that holds every layer, as the planner places them
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = not plan_for(index, _cfg(backend="cuda", vram_budget=mid, ram_budget=ram, ctx=1024)).streamed_layers
        lo, hi = (lo, mid) if fits else (mid, hi)
    assert held.endswith(f"every layer resident needs {format_bytes(hi)}"), (held, hi)
    wider = plan_for(index, _cfg(backend="cuda", vram_budget=budget + p.kv_floor_bytes, ram_budget=ram, ctx=1024))
    more = len(wider.layers_on(VRAM)) - 7
    assert more > 0 and floor.startswith(f"the KV cache's floor (1024 positions, {format_bytes(p.kv_floor_bytes)}, "
                                         f"reserved before any layer) streams {more} layers: ")


def test_the_embedding_stays_in_host_memory_where_that_holds_more_layers(tmp_path, index):
    """On cuda, where the budget streams layers and the head is a tensor of its own, the token
    embedding stays in host memory (a pass reads its tokens' rows in place) when that leaves room
    for more resident layers; its bytes leave the VRAM reservation and come out of the RAM
    budget. Not where every layer fits, nor where --gpu-layers (not the budget) streams them,
    nor for a tied embedding (SmolLM2's is its head, read whole every pass)."""
    from tests.synth_models import write_tiny

    untied = open_model(write_tiny(tmp_path, n_layers=8, vocab_size=4096))
    embd, cost = untied.globals["token_embd"].nbytes, untied.layers[0].nbytes
    assert embd > cost and "output" in untied.globals
    assert memory_costs("cuda", untied, max_seqs=1, max_ctx=512, max_pass_rows=512).host_globals_bytes == embd
    assert memory_costs("cuda", index, max_seqs=1, max_ctx=512, max_pass_rows=512).host_globals_bytes == 0
    assert memory_costs("cpu", untied, max_seqs=1, max_ctx=512, max_pass_rows=512).host_globals_bytes == 0

    def plan(vram: int, **kw):
        return plan_for(untied, _cfg(backend="cuda", vram_budget=vram, ram_budget=parse_size("1GiB"), ctx=512,
                                     max_batch=1, cpu_layers=0, **kw))

    big = plan(parse_size("8GiB"))
    assert not big.streamed_layers and not big.embed_in_host and big.globals_bytes == untied.global_bytes_total
    fixed = big.globals_bytes + big.kv_floor_bytes + big.workspace_bytes + 2 * big.slot_bytes
    p = plan(fixed + 3 * cost + cost // 2)
    assert p.embed_in_host and p.embed_host_bytes == embd
    assert len(p.layers_on(VRAM)) == 3 + (cost // 2 + embd) // cost  # the embedding's bytes hold more layers
    assert p.globals_bytes == untied.global_bytes_total - embd
    assert "token embedding in host memory" in "\n".join(p.describe())
    assert type(p).from_dict(p.to_dict()) == p
    capped = plan(parse_size("8GiB"), gpu_layers=3)  # the cap streams layers, not the budget
    assert not capped.embed_in_host and len(capped.layers_on(VRAM)) == 3
    # the RAM budget pays for the embedding's pages: what is left holds fewer streamed layers
    ram_all = sum(untied.layers[i].image_bytes for i in range(8) if i not in p.layers_on(VRAM))
    tight = plan_for(untied, _cfg(backend="cuda", vram_budget=fixed + 3 * cost + cost // 2, ctx=512, max_batch=1,
                                  cpu_layers=0, ram_budget=ram_all + embd))
    assert tight.embed_in_host and not tight.layers_on(STORAGE)
    tighter = plan_for(untied, _cfg(backend="cuda", vram_budget=fixed + 3 * cost + cost // 2, ctx=512, max_batch=1,
                                    cpu_layers=0, ram_budget=ram_all + embd - 1))
    assert tighter.layers_on(STORAGE)
