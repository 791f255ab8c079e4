"""The paged KV cache in the engine, on the real SmolLM2 and the cpu backend (the reference):
pages follow what sequences use, a shared prefix is reused instead of prefilled again, a pool
that runs out preempts and resumes without changing a token, a request no pool can hold fails
in one line, and resident layers demoted for pages (and promoted back) keep the output token for
token. docs/ARCHITECTURE.md, "KV memory"."""

from __future__ import annotations

import pytest

from ntx.ctl.local import LocalEngine
from ntx.daemons.compute.backend import make_backend
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.residency import PROMOTE_AFTER_PASSES, Residency
from ntx.shared.config import EngineOptions
from ntx.shared.gguf_index import open_model
from ntx.shared.kv_sizing import PAGE_TOKENS, KvSizing
from ntx.shared.messages import EngineRequest
from ntx.shared.plan import demotion_order
from ntx.shared.sampling_fields import SamplingParams
from ntx.daemons.compute.backend import plan_for
from ntx.shared.config import InstanceConfig

from .pipeline_util import running_pipeline

# a text of about 170 tokens: prompts of several pages
TEXT = ("The history of the transistor begins with the discovery of semiconductors. In 1947, at Bell Labs, "
        "John Bardeen and Walter Brattain built the first point-contact transistor, and William Shockley soon "
        "followed with the junction transistor. Within a decade transistors replaced vacuum tubes in radios, "
        "computers and hearing aids, because they were smaller, cheaper and far more reliable. The integrated "
        "circuit, invented independently by Jack Kilby and Robert Noyce, put many transistors on one chip, and "
        "the number of transistors on a chip has doubled roughly every two years since then, as Gordon Moore "
        "predicted in 1965.")


@pytest.fixture(scope="module")
def index(smollm2_path):
    return open_model(smollm2_path)


def engine_with_pool(index, n_chunks: int, max_chunks: int | None = None, chunk_pages: int = 2, max_batch: int = 4,
                     ctx: int = 1024, **kw) -> LocalEngine:
    """An engine whose pool starts with ``n_chunks`` chunks of ``chunk_pages`` pages."""
    kv = KvSizing(chunk_pages, n_chunks, max_chunks if max_chunks is not None else n_chunks)
    backend = make_backend("cpu", index, max_seqs=max_batch, max_ctx=ctx, kv=kv)
    return LocalEngine(build_engine(index, backend, EngineOptions(max_batch=max_batch, ctx=ctx), **kw))


@pytest.fixture(scope="module")
def roomy(index) -> LocalEngine:
    """Pages for every sequence at full context: what the tokens must be."""
    return LocalEngine(build_engine(index, "cpu", EngineOptions(max_batch=4, ctx=1024)))


def prompt_ids(eng: LocalEngine, n: int, offset: int = 0) -> list[int]:
    ids = eng.tokenizer.encode(TEXT * 12)  # (the front would refuse more than the context)
    assert len(ids) >= offset + n
    return ids[offset:offset + n]


def run(eng: LocalEngine, prompts: dict[str, list[int]], max_tokens: int = 12) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, all submitted at once, stepping until idle."""
    for rid, p in prompts.items():
        eng.submit(EngineRequest(rid, list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while eng.has_work:
        for ev in eng.step():
            assert ev["type"] != "error", ev
            if ev["type"] == "token":
                out[ev["id"]].append(ev["token"])
    return out


def test_pages_follow_use_and_full_pages_stay_cached(index, roomy):
    eng = engine_with_pool(index, n_chunks=64)
    ids = prompt_ids(eng, 70)
    eng.submit(EngineRequest("a", ids, SamplingParams(temperature=0.0, max_tokens=30)))
    eng.step()  # the prompt's pass: its pages, no more
    st = eng.core.model.backend.kv_stats()
    assert st.pages_in_use == -(-70 // PAGE_TOKENS) and st.sequences == 1
    while eng.has_work:
        eng.step()
    st = eng.core.model.backend.kv_stats()
    assert st.pages_in_use == 0 and st.sequences == 0
    # 70 prompt tokens and 29 written generated ones: three full pages are kept for reuse
    assert st.pages_cached == (70 + 30 - 1) // PAGE_TOKENS


def test_a_shared_prefix_is_reused_and_gives_the_tokens_of_a_cold_run(index, roomy):
    """A second request with the same 100-token prompt prefills only what follows its cached
    pages (the page of its last token is always run), and a prompt that shares 64 tokens reuses
    two pages; every one of them greedy-decodes the tokens of an engine that reused nothing."""
    eng = engine_with_pool(index, n_chunks=64)
    a, b = prompt_ids(eng, 100), prompt_ids(eng, 64) + prompt_ids(eng, 40, offset=200)
    want = run(roomy, {"a": a, "b": b})
    got_first = run(eng, {"a": a})
    assert got_first["a"] == want["a"]
    eng.submit(EngineRequest("a2", a, SamplingParams(temperature=0.0, max_tokens=12)))
    eng.step()
    assert eng.core.last_pass[2] == 100 - 96  # prompt rows of that pass: the last page's 4 tokens
    again = {"a2": [], "b": []}
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "token":
                again[ev["id"]].append(ev["token"])
    assert run(eng, {"b": b})["b"] == want["b"]
    st = eng.core.model.backend.kv_stats()
    assert st.prefix_hit_tokens == 96 + 64 and st.prefix_lookups == 3


def test_turn_n_of_a_chat_does_not_prefill_turns_1_to_n_minus_1(index):
    """Through the front: the second turn's prompt (the first turn, the reply, a new question)
    reuses the first turn's pages."""
    eng = engine_with_pool(index, n_chunks=64)
    turn1 = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Who built the first transistor?"}]
    eng.generate("t1", {"messages": turn1, "temperature": 0, "max_tokens": 16, "stream": False})
    reply = None
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                reply = ev["text"]
    n1 = len(eng.prompt_tokens(messages=turn1))
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And when?"}]
    before = eng.core.model.backend.kv_stats().prefix_hit_tokens
    eng.generate("t2", {"messages": turn2, "temperature": 0, "max_tokens": 4, "stream": False})
    while eng.has_work:
        eng.step()
    hit = eng.core.model.backend.kv_stats().prefix_hit_tokens - before
    assert hit >= (n1 // PAGE_TOKENS) * PAGE_TOKENS > 0


def test_a_pool_that_runs_out_preempts_and_resumes_with_the_same_tokens(index, roomy):
    """Four sequences of 64-token prompts whose pages outgrow a pool of 9 pages: those left
    without a page sit passes out, and when none can go on the newest is sent back to the queue
    and resumed by recomputing its keys and values; every sequence's greedy tokens are those of
    an engine with room for all."""
    prompts = {f"r{i}": prompt_ids(roomy, 64, offset=11 * i) for i in range(4)}
    want = run(roomy, prompts, max_tokens=40)
    eng = engine_with_pool(index, n_chunks=9, chunk_pages=1)  # 9 pages: 288 positions for four of 104
    got = run(eng, prompts, max_tokens=40)
    assert got == want
    assert eng.core.preemptions > 0
    assert eng.core.model.backend.kv_stats().pages_in_use == 0


def test_a_request_no_pool_can_hold_fails_in_one_line(index):
    eng = engine_with_pool(index, n_chunks=2)  # 4 pages: 128 positions
    eng.submit(EngineRequest("big", prompt_ids(eng, 150), SamplingParams(temperature=0.0, max_tokens=4)))
    events = eng.step()
    assert [(e["type"], e["code"]) for e in events] == [("error", "context_overflow")]
    assert "KV page pool exhausted" in events[0]["message"] and "\n" not in events[0]["message"]
    assert not eng.has_work
    # a request that fits its prompt but not its growth: also one error, at the step it runs out
    eng.submit(EngineRequest("grows", prompt_ids(eng, 120), SamplingParams(temperature=0.0, max_tokens=40)))
    errors = []
    while eng.has_work:
        errors += [e for e in eng.step() if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["context_overflow"]


def test_demoted_layers_give_pages_and_come_back_without_changing_a_token(index, roomy):
    """A model with 6 of its 30 layers streamed from the file and a pool of 4 pages: a 200-token
    prompt needs more, so resident layers are demoted (their memory becomes pages), the output is
    the all-resident engine's token for token; once the pool has long had plenty the last one is
    promoted back, and the tokens stay the same."""
    prompts = {"long": prompt_ids(roomy, 200)}
    want = run(roomy, prompts, max_tokens=10)
    resident = [i for i in range(30) if i not in (3, 9, 15, 21, 27, 29)]
    eng = engine_with_pool(index, n_chunks=2, max_chunks=400, resident_layers=resident)
    model = eng.core.model
    costs = model.backend.memory_costs(index, max_seqs=1, max_ctx=1, max_pass_rows=1)
    room = eng.core.kv_room = Residency(model, demotion_order(resident), costs.layer_bytes)
    assert run(eng, prompts, max_tokens=10) == want
    demoted = list(room.demoted)
    assert demoted and all(i not in model.resident for i in demoted)
    assert set(model.streamed_layers) == {3, 9, 15, 21, 27, 29} | set(demoted)
    assert eng.core.kv_report()["demoted_layers"] == demoted
    # short requests afterwards: the pool has plenty, and after PROMOTE_AFTER_PASSES passes the last
    # demoted layer comes back (its chunks given up); the tokens do not change
    short = {"s": prompt_ids(roomy, 20)}
    want_short = run(roomy, short, max_tokens=PROMOTE_AFTER_PASSES + 10)
    got_short = run(eng, short, max_tokens=PROMOTE_AFTER_PASSES + 10)
    assert got_short == want_short
    assert len(room.demoted) == len(demoted) - 1 and demoted[-1] in model.resident
    assert any("resident again" in e for e in room.log.events)


@pytest.mark.slow
def test_pipeline_demotes_layers_for_a_long_prompt_and_keeps_its_tokens(smollm2_path, index, roomy, run_dir):
    """The real pipeline (compute, dma, its standby copies): a budget that holds 24 resident
    layers and the KV floor (1024 positions) but a 1300-token prompt; compute demotes layers whose
    copies dma announced, streams them from pinned RAM, and the greedy tokens are those of the
    all-resident reference. Status and the plan show the pool, the standby layers and the
    demoted ones."""
    probe = plan_for(index, InstanceConfig(model=str(smollm2_path), ctx=2048, gpu_layers=24, vram_budget=1 << 40,
                                           ram_budget=1 << 30))
    costs = make_backend("cpu", index, max_seqs=1, max_ctx=32).memory_costs(index, max_seqs=1, max_ctx=2048,
                                                                          max_pass_rows=512)
    budget = (probe.globals_bytes + probe.workspace_bytes + probe.kv_floor_bytes + probe.device_slot_bytes_total
              + sum(sorted(costs.layer_bytes)[-24:]) + (1 << 20))
    ids = prompt_ids(roomy, 1300)
    want = run(LocalEngine(build_engine(index, "cpu", EngineOptions(max_batch=1, ctx=2048))), {"p": ids}, max_tokens=8)["p"]
    with running_pipeline(str(smollm2_path), run_dir, "--ctx", "2048", "--gpu-layers", "24", "--vram-budget",
                          str(budget), "--ram-budget", "1GiB", name="demote") as p:
        st = p.wait_status(lambda s: (s["stages"].get("dma", {}).get("standby") or {}).get("loaded", 0) >= 24,
                           "dma's standby copies of the 24 resident layers")
        plan = st["plan"]
        assert len(plan["standby_layers"]) == 24 and plan["kv_tokens"] < 1300
        assert any("grows to" in line for line in plan["lines"])
        with p.client() as c:
            got = c.complete(tokens=ids, temperature=0.0, max_tokens=8)
        assert got["tokens"] == want
        st = p.wait_status(lambda s: (s.get("kv") or {}).get("demoted_layers"), "the demoted layers in status")
        assert set(st["kv"]["demoted_layers"]) <= set(plan["standby_layers"])
        assert st["kv"]["pages_total"] * PAGE_TOKENS >= 1300
