"""Greedy decode queued one pass ahead of the host (EngineCore.run_ahead, LlamaModel.launch with
``feed``) on the real SmolLM2, in process on the CPU backend (where it is off by default and
switched on here), behind the front (ctl/local.py): the same tokens and texts as one pass at a
time, through stop tokens, stop strings (ended by the front, cancelled in the engine),
max_tokens, cancels, admissions and sampled requests that rule it out."""

from __future__ import annotations

import pytest

from ntx.ctl.local import LocalEngine, build_local_engine
from ntx.daemons.compute.backend import Pick
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.messages import EngineRequest
from ntx.shared.config import EngineOptions

FRANCE_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LocalEngine:
    return build_local_engine(str(smollm2_path), options=EngineOptions(max_batch=4))


@pytest.fixture(autouse=True)
def left_idle(engine):
    yield
    assert not engine.has_work
    assert engine.core.model.backend.seq_pages == {} and engine.core.model.backend.kv_stats().pages_in_use == 0  # every KV page was freed


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(engine: LocalEngine, reqs: list[EngineRequest], ahead: bool, actions: dict | None = None) -> dict[str, dict]:
    """Submit ``reqs`` (a request whose id is a key of ``actions`` waits for that step), step to
    idle with ``run_ahead`` = ``ahead``; ``actions[step]`` may also be a callable run before that
    step. Returns the done (or error) event of each request by id."""
    engine.core.run_ahead = ahead
    actions = actions or {}
    later = {r.id for r in reqs if r.id in actions}
    for r in reqs:
        if r.id not in later:
            engine.submit(r)
    done: dict[str, dict] = {}
    step = 0
    while engine.has_work or any(k >= step for k in actions if isinstance(k, int)):
        act = actions.get(step)
        if callable(act):
            for ev in act():
                done[ev["id"]] = ev
        for r in reqs:
            if actions.get(r.id) == step:
                engine.submit(r)
        for ev in engine.step():
            if ev["type"] in ("done", "error"):
                done[ev["id"]] = ev
        step += 1
    engine.core.run_ahead = False
    return done


def fresh(reqs: list[EngineRequest]) -> list[EngineRequest]:
    return [EngineRequest(r.id, list(r.prompt_tokens), r.params, r.logprobs, r.prompt_logprobs) for r in reqs]


def same_both_ways(engine: LocalEngine, reqs: list[EngineRequest], actions: dict | None = None) -> tuple[dict, int]:
    """Run ``reqs`` one pass at a time, then run ahead: the done events agree on everything but
    timings; returns them and how many passes ran ahead."""
    serial = run(engine, fresh(reqs), False, actions)
    fed0 = engine.core.passes_fed
    ahead = run(engine, fresh(reqs), True, actions)
    for rid, d in serial.items():
        a = ahead[rid]
        assert a["type"] == d["type"], rid
        if d["type"] == "done":
            for key in ("tokens", "text", "finish_reason"):
                assert a[key] == d[key], (rid, key)
    assert ahead.keys() == serial.keys()
    return ahead, engine.core.passes_fed - fed0


def test_batch_decodes_the_same_tokens_ahead(engine):
    prompts = [FRANCE_IDS, engine.prompt_tokens(prompt="Once upon a time", raw=True),
               engine.prompt_tokens(prompt="def fibonacci(n):", raw=True)]
    reqs = [EngineRequest(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    passes0 = engine.core.model.next_pass_id
    done, fed = same_both_ways(engine, reqs)
    # 1 prefill + 11 decode passes each way: a pass is queued only when its token is needed
    assert engine.core.model.next_pass_id - passes0 == 2 * 12
    assert fed == 10  # every decode pass but the first
    assert all(d["finish_reason"] == "length" and len(d["tokens"]) == 12 for d in done.values())


def test_stop_token_and_stop_string_while_a_pass_is_queued(engine):
    eos_prompt = engine.prompt_tokens(prompt="Reply with one word: yes or no. Is water wet?")
    reqs = [EngineRequest("eos", eos_prompt, greedy(16)),  # ends on the EOS token before 16
            EngineRequest("dot", FRANCE_IDS, greedy(8, stop=["."])),  # " Paris" then "."
            EngineRequest("long", FRANCE_IDS, greedy(10))]
    done, fed = same_both_ways(engine, reqs)
    assert done["eos"]["finish_reason"] == "stop" and len(done["eos"]["tokens"]) < 16
    assert done["dot"]["finish_reason"] == "stop" and done["dot"]["text"] == " Paris"
    assert done["long"]["finish_reason"] == "length" and len(done["long"]["tokens"]) == 10
    assert fed > 0


def test_cancel_and_admission_while_a_pass_is_queued(engine):
    reqs = [EngineRequest("a", FRANCE_IDS, greedy(10)), EngineRequest("b", FRANCE_IDS, greedy(10)),
            EngineRequest("late", engine.prompt_tokens(prompt="Once upon a time", raw=True), greedy(6))]
    def cancel_b() -> list[dict]:
        assert engine.core._ahead is not None or not engine.core.run_ahead  # a queued pass holds b's row
        return engine.cancel("b")

    # b is cancelled before step 4, late joins at step 6
    done, fed = same_both_ways(engine, reqs, {4: cancel_b, "late": 6})
    assert done["b"]["finish_reason"] == "cancelled" and len(done["b"]["tokens"]) == 4
    assert done["a"]["finish_reason"] == "length" and len(done["a"]["tokens"]) == 10
    assert done["late"]["finish_reason"] == "length" and len(done["late"]["tokens"]) == 6
    assert fed > 0


def test_a_sampled_request_or_a_repetition_penalty_runs_one_pass_at_a_time(engine):
    reqs = [EngineRequest("g", FRANCE_IDS, greedy(6)),
            EngineRequest("s", FRANCE_IDS, SamplingParams(temperature=0.7, seed=7, max_tokens=6))]
    _, fed = same_both_ways(engine, reqs)
    assert fed == 0
    _, fed = same_both_ways(engine, [EngineRequest("p", FRANCE_IDS, greedy(6, repetition_penalty=1.3))])
    assert fed == 0
    _, fed = same_both_ways(engine, [EngineRequest("lp", FRANCE_IDS, greedy(6), logprobs=3)])
    assert fed == 4  # logprobs ride along: top-k rows whose first entry is the greedy token


def test_logprobs_agree_ahead(engine):
    req = [EngineRequest("lp", FRANCE_IDS, greedy(6), logprobs=3)]
    events = {}
    for ahead in (False, True):
        engine.core.run_ahead = ahead
        engine.submit(fresh(req)[0])
        evs = []
        while engine.has_work:
            evs.extend(e for e in engine.step() if e["type"] == "token")
        events[ahead] = [(e["token"], e["logprobs"], e["logprob"]) for e in evs]
    engine.core.run_ahead = False
    assert events[True] == events[False] and len(events[True]) == 6


def test_launch_feed_takes_the_pending_top1(engine):
    """LlamaModel.launch with feed: the fed pass equals a pass given the tokens by hand."""
    m, be = engine.core.model, engine.core.model.backend
    be.alloc_sequence(900, 16)
    be.alloc_sequence(901, 16)
    try:
        first = m.launch(StepBatch([SeqChunk(900, 0, tuple(FRANCE_IDS))]), [Pick(1)])
        fed = m.launch(StepBatch([SeqChunk(900, 5, (0,))]), [Pick(3)], feed=first)
        top1 = int(first.result()[0].ids[0])
        m.forward(StepBatch([SeqChunk(901, 0, tuple(FRANCE_IDS))]), [Pick(1)])
        by_hand = m.forward(StepBatch([SeqChunk(901, 5, (top1,))]), [Pick(3)])
        assert list(fed.result()[0].ids) == list(by_hand[0].ids)
        with pytest.raises(ValueError, match="single-token chunk"):
            m.launch(StepBatch([SeqChunk(900, 6, (0, 0))]), [Pick(1)], feed=fed)
    finally:
        be.free_sequence(900)
        be.free_sequence(901)
