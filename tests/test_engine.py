"""The engine core (daemons/compute/engine.py) behind its front (ctl/local.py) on the real
SmolLM2, in process: greedy text, max_tokens, stop strings, EOS, seeds, prompt and token
logprobs, request errors, cancellation and continuous batching, and the core alone: token ids
in, typed outputs out. One engine serves the whole module; every test leaves it idle."""

from __future__ import annotations

import numpy as np
import pytest

from ntx.ctl.local import LocalEngine, build_local_engine
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.messages import EngineOutput, EngineRequest, RequestError

try:
    from .synth_models import log_softmax64
except ImportError:  # tests/ is not a package
    from synth_models import log_softmax64

FRANCE = "The capital of France is"
FRANCE_IDS = [504, 3575, 282, 4649, 314]
PARIS = 7042


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LocalEngine:
    return build_local_engine(str(smollm2_path))


@pytest.fixture(autouse=True)
def engine_left_idle(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert not eng.has_work
        assert eng.core.model.backend.seq_pages == {} and eng.core.model.backend.kv_stats().pages_in_use == 0  # every page freed


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(engine: LocalEngine, *reqs: EngineRequest) -> tuple[dict, dict]:
    """Submit ``reqs`` and step until the engine is idle: (done event by id, all events by id)."""
    for r in reqs:
        engine.submit(r)
    events: dict[str, list] = {r.id: [] for r in reqs}
    done: dict[str, dict] = {}
    while engine.has_work:
        for ev in engine.step():
            events[ev["id"]].append(ev)
            if ev["type"] in ("done", "error"):
                done[ev["id"]] = ev
    return done, events


def reference_logits(engine: LocalEngine, tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of ``tokens`` from a fresh pass of the engine's model (the float32 CPU
    backend, itself held to the float64 reference in test_model_reference.py)."""
    be = engine.core.model.backend
    sid = 10**9
    be.alloc_sequence(sid, len(tokens))
    try:
        return engine.core.model.forward(StepBatch([SeqChunk(sid, 0, tuple(tokens), all_logits=True)]))
    finally:
        be.free_sequence(sid)


def test_greedy_continues_with_paris_and_respects_max_tokens(engine):
    ids = engine.prompt_tokens(prompt=FRANCE, raw=True)
    assert ids == FRANCE_IDS
    done, events = run(engine, EngineRequest(id="paris", prompt_tokens=ids, params=greedy(3)))
    d = done["paris"]
    assert d["type"] == "done"
    assert d["text"].startswith(" Paris"), d["text"]
    assert d["tokens"][0] == PARIS
    assert d["finish_reason"] == "length"
    assert len(d["tokens"]) == 3
    assert d["prompt_tokens"] == FRANCE_IDS
    assert d["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}
    toks = [e for e in events["paris"] if e["type"] == "token"]
    assert [e["token"] for e in toks] == d["tokens"]
    assert "".join(e["text"] for e in toks) + d.get("tail", "") == d["text"]
    assert set(d["timings"]) >= {"queued_s", "prefill_s", "decode_s"}


def test_stop_strings_cut_the_text_before_the_stop(engine):
    # greedy continuation: " Paris.\n\nThe answer is:"
    done, _ = run(
        engine,
        EngineRequest(id="dot", prompt_tokens=FRANCE_IDS, params=greedy(8, stop=["."])),
        EngineRequest(id="span", prompt_tokens=FRANCE_IDS, params=greedy(8, stop=["s.", "never"])),
        EngineRequest(id="late", prompt_tokens=FRANCE_IDS, params=greedy(8, stop=["\n\nThe"])),
    )
    assert done["dot"]["finish_reason"] == "stop" and done["dot"]["text"] == " Paris"
    # a stop string that starts inside one token and ends in the next
    assert done["span"]["finish_reason"] == "stop" and done["span"]["text"] == " Pari"
    assert done["late"]["finish_reason"] == "stop" and done["late"]["text"] == " Paris."
    for d in done.values():
        assert len(d["tokens"]) < 8


def test_eos_ends_with_stop(engine):
    ids = engine.prompt_tokens(prompt="Reply with one word: yes or no. Is water wet?")
    assert ids[0] != ids[1]  # the chat template's start, no doubled BOS
    done, events = run(engine, EngineRequest(id="eos", prompt_tokens=ids, params=greedy(16)))
    d = done["eos"]
    assert d["finish_reason"] == "stop"
    assert 0 < len(d["tokens"]) < 16
    assert not set(d["tokens"]) & engine.tokenizer.stop_ids  # the EOS token is not output
    assert "<|im_end|>" not in d["text"] and d["text"].strip()


def test_seed_determinism(engine):
    ids = engine.prompt_tokens(prompt="Once upon a time", raw=True)

    def sampled(rid: str, seed: int) -> EngineRequest:
        return EngineRequest(id=rid, prompt_tokens=ids, params=SamplingParams(temperature=0.8, seed=seed, max_tokens=4))

    a, _ = run(engine, sampled("a", 1234))
    b, _ = run(engine, sampled("b", 1234))
    assert a["a"]["tokens"] == b["b"]["tokens"]
    assert a["a"]["text"] == b["b"]["text"]
    assert a["a"]["seed"] == 1234
    others, _ = run(engine, sampled("s1", 1), sampled("s2", 2), sampled("s3", 3))
    # three other seeds all giving the same 4 tokens as seed 1234 would be a broken sampler
    assert any(d["tokens"] != a["a"]["tokens"] for d in others.values())


def test_prompt_logprobs_and_token_logprobs(engine):
    k = 5
    req = EngineRequest(id="lp", prompt_tokens=FRANCE_IDS, params=greedy(2), logprobs=3, prompt_logprobs=k)
    done, events = run(engine, req)
    d = done["lp"]
    assert d["tokens"][0] == PARIS
    ref = log_softmax64(reference_logits(engine, FRANCE_IDS + d["tokens"][:1]))  # [6, V]

    plp = d["prompt_logprobs"]
    assert len(plp) == len(FRANCE_IDS)  # one entry per prompt position
    assert plp[0] is None  # nothing predicts the first token
    for pos in range(1, len(FRANCE_IDS)):
        entry = plp[pos]
        assert all(isinstance(p, list) and len(p) == 2 for p in entry)
        lps = [lp for _, lp in entry]
        assert lps == sorted(lps, reverse=True)  # best first
        row = ref[pos - 1]  # the row after token pos-1 predicts token pos
        want_ids = [int(i) for i in np.argsort(-row, kind="stable")[:k]]
        actual = FRANCE_IDS[pos]
        if actual not in want_ids:  # the actual prompt token's pair comes last
            want_ids.append(actual)
        assert [i for i, _ in entry] == want_ids
        np.testing.assert_allclose(lps, row[want_ids], atol=1e-4)
    assert any(len(e) == k + 1 for e in plp[1:])  # (some prompt token is outside its top-5)

    toks = [e for e in events["lp"] if e["type"] == "token"]
    assert len(toks) == 2
    for j, e in enumerate(toks):
        row = ref[len(FRANCE_IDS) - 1 + j]
        assert len(e["logprobs"]) == 3
        assert e["logprobs"][0][0] == e["token"] == int(row.argmax())  # greedy takes the best
        assert e["logprob"] == pytest.approx(row[e["token"]], abs=1e-4)
        np.testing.assert_allclose([lp for _, lp in e["logprobs"]], np.sort(row)[::-1][:3], atol=1e-4)


def test_duplicate_request_id(engine):
    engine.submit(EngineRequest(id="dup", prompt_tokens=FRANCE_IDS, params=greedy(2)))
    with pytest.raises(RequestError) as ei:
        engine.submit(EngineRequest(id="dup", prompt_tokens=[1, 2, 3], params=greedy(2)))
    assert ei.value.code == "duplicate_id"
    assert engine.queued_ids == ["dup"]  # the second one was not queued
    (ev,) = engine.cancel("dup")
    assert ev["finish_reason"] == "cancelled"
    # once finished, the id is free again
    done, _ = run(engine, EngineRequest(id="dup", prompt_tokens=FRANCE_IDS, params=greedy(1)))
    assert done["dup"]["tokens"] == [PARIS]


def test_prompt_longer_than_the_context(engine):
    small = EngineCore(engine.core.model, max_context=16)  # the engine's own guard, without the front
    assert small.max_context == 16
    with pytest.raises(RequestError) as ei:
        small.submit(EngineRequest(id="long", prompt_tokens=list(range(100, 120)), params=greedy(4)))
    assert ei.value.code == "context_overflow"
    assert not small.has_work
    with pytest.raises(RequestError) as ei:
        engine.submit(EngineRequest(id="huge", prompt_tokens=[504] * 9000, params=greedy(4)))
    assert ei.value.code == "context_overflow"
    assert not engine.has_work


def test_prompt_token_outside_the_vocabulary(engine):
    """Refused at submit, naming the id and the range: on the GPU its embedding row would be NaN."""
    n_vocab = engine.core.model.hp.n_vocab
    for bad in (n_vocab, -1):
        with pytest.raises(RequestError, match=f"token id {bad} is outside the vocabulary") as ei:
            engine.submit(EngineRequest(id="oov", prompt_tokens=[504, bad], params=greedy(2)))
        assert ei.value.code == "bad_request"
    assert not engine.has_work


def test_cancel_frees_the_sequence(engine):
    be = engine.core.model.backend
    engine.submit(EngineRequest(id="run", prompt_tokens=FRANCE_IDS, params=greedy(50)))
    engine.step()  # prefill: the sequence holds a KV cache now
    engine.step()
    assert engine.active_ids == ["run"] and len(be.seq_pages) == 1
    engine.submit(EngineRequest(id="queued", prompt_tokens=FRANCE_IDS, params=greedy(50)))
    (ev,) = engine.cancel("run")
    assert ev["type"] == "done" and ev["id"] == "run"
    assert ev["finish_reason"] == "cancelled"
    assert ev["tokens"][:2] == [PARIS, 30]
    assert be.seq_pages == {}
    assert engine.active_ids == []
    (ev,) = engine.cancel("queued")  # never admitted
    assert ev["finish_reason"] == "cancelled" and ev["tokens"] == []
    assert engine.cancel("no-such-request") == []
    assert not engine.has_work


def test_continuous_batching_matches_each_alone(engine):
    prompts = {
        "r1": FRANCE_IDS,
        "r2": engine.prompt_tokens(prompt="Once upon a time", raw=True),
        "r3": engine.prompt_tokens(prompt="def fibonacci(n):", raw=True),
    }
    n = 4
    alone = {}
    for rid, ids in prompts.items():
        d, _ = run(engine, EngineRequest(id=rid, prompt_tokens=ids, params=greedy(n)))
        alone[rid] = d[rid]["tokens"]

    done: dict[str, dict] = {}
    most_running = 0
    submit_at = {0: "r1", 2: "r2", 3: "r3"}  # joining at different passes
    step = 0
    while step in submit_at or engine.has_work:
        if step in submit_at:
            rid = submit_at[step]
            engine.submit(EngineRequest(id=rid, prompt_tokens=prompts[rid], params=greedy(n)))
        finished = 0
        for ev in engine.step():
            if ev["type"] in ("done", "error"):
                done[ev["id"]] = ev
                finished += 1
        most_running = max(most_running, len(engine.active_ids) + finished)  # sequences in this pass
        step += 1
    assert most_running == 3  # all three were in one pass at some point
    for rid in prompts:
        assert done[rid]["finish_reason"] == "length"
        assert done[rid]["tokens"] == alone[rid], rid


def test_the_core_alone_speaks_token_ids(engine):
    """No text crosses the core: a request in token ids gives ``EngineOutput`` records (new ids,
    their log-probabilities, a finish with timings); prompt log-probabilities come once, first."""
    core = engine.core
    core.submit(EngineRequest("ids", FRANCE_IDS, greedy(3, seed=5), logprobs=2, prompt_logprobs=1))
    outs: list[EngineOutput] = []
    while core.has_work:
        outs.extend(core.step())
    assert all(isinstance(o, EngineOutput) and o.id == "ids" for o in outs)
    assert [t for o in outs for t in o.tokens][:1] == [PARIS] and sum(len(o.tokens) for o in outs) == 3
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(FRANCE_IDS)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert all(len(o.logprobs) == len(o.tokens) == len(o.token_logprobs) for o in outs)
    assert outs[-1].decode_s > outs[0].decode_s >= 0.0 and outs[0].prefill_s > 0


def test_a_stop_string_ends_the_request_at_the_front_and_in_the_engine(engine):
    """The front matches stop strings on text; when one matches it answers ``done`` at once and
    cancels the request in the core, whose KV cache is freed then."""
    engine.submit(EngineRequest("dot", FRANCE_IDS, greedy(40, stop=["."])))
    replies = []
    while engine.has_work:
        replies.extend(engine.step())
    done = replies[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop" and done["text"] == " Paris"
    assert done["tokens"] == [PARIS, 30]  # the token that completed the stop string is counted
    assert [r["type"] for r in replies] == ["token", "token", "done"]
    assert not engine.core.has_work and engine.core.model.backend.seq_pages == {}
