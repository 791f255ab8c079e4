"""The replay drafter (benchmarks' controlled acceptance): it proposes the recorded continuation,
makes each token wrong at the rate asked (a different id, reproducibly), runs the drafter it
wraps, and greedy output through it is the plain output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ntx.ctl.local import LocalEngine
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.replay import ReplayDrafter, load_references, write_references
from ntx.daemons.compute.sampler import SamplingParams
from ntx.daemons.compute.speculation import DraftRequest, ModelDrafter
from ntx.shared.config import EngineOptions
from ntx.shared.errors import ConfigError
from ntx.shared.messages import EngineRequest

try:
    from .pipeline_util import ntxctl, own_instance, running_pipeline
    from .synth_models import write_tiny
except ImportError:  # tests/ is not a package
    from pipeline_util import ntxctl, own_instance, running_pipeline
    from synth_models import write_tiny

REF = (7, 8, 9, 10, 11, 12, 13, 14)
OTHER = (7, 8, 1, 2, 3)


def _req(tokens, n, seq_id=0) -> DraftRequest:
    return DraftRequest(seq_id, list(tokens), depth=n, width=1, capacity=64)


def _tokens(trees) -> list[list[int]]:
    assert all(t.is_chain for t in trees)  # a recording has one continuation: chains
    return [t.tokens for t in trees]


def test_it_proposes_the_recorded_continuation_of_the_matching_sequence():
    d = ReplayDrafter([OTHER, REF], 0.0, n_vocab=100)
    assert d.name == "replay"
    got = _tokens(d.propose([_req(REF[:3], 4), _req(OTHER[:3], 9, 1), _req(REF[:6], 5, 2), _req(REF, 3, 3),
                             _req((5, 6), 2, 4)]))
    # the first recording that extends the tokens; cut at n or at the recording's end; else nothing
    assert got == [list(REF[3:7]), list(OTHER[3:]), list(REF[6:]), [], []]


def test_each_token_is_made_wrong_at_rate_p_independently_and_reproducibly():
    ref = tuple(range(2, 402))
    n_draws = 50  # 50 drafts of 400 tokens: 20,000 tokens
    p = 0.3

    def draws(seed):
        d = ReplayDrafter([ref], p, n_vocab=50_000, seed=seed)
        return np.array([_tokens(d.propose([_req(ref[:1], 400)]))[0] for _ in range(n_draws)])  # [draws, 399]

    got = draws(seed=11)
    wrong = got != np.array(ref[1:])
    n = wrong.size
    assert abs(wrong.sum() - p * n) <= 4.5 * np.sqrt(n * p * (1 - p))
    # independent: the rate of a wrong token right after a wrong one is p too
    pairs = wrong[:, 1:][wrong[:, :-1]]
    assert abs(pairs.mean() - p) <= 4.5 * np.sqrt(p * (1 - p) / pairs.size)
    assert ((got >= 0) & (got < 50_000)).all()
    assert (draws(seed=11) == got).all() and not (draws(seed=12) == got).all()
    bits = (0, 1, 1, 0, 1, 0, 0)
    assert _tokens(ReplayDrafter([bits], 1.0, n_vocab=2).propose([_req(bits[:1], 6)]))[0] == [1 - b for b in bits[1:]]
    assert all(a != b for a, b in zip(_tokens(ReplayDrafter([ref], 1.0, n_vocab=500).propose([_req(ref[:1], 399)]))[0],
                                      ref[1:]))


def test_replay_files_round_trip_and_bad_ones_are_one_clear_line(tmp_path):
    path = tmp_path / "replay.json"
    write_references(path, [list(REF), list(OTHER)])
    assert load_references(path) == [REF, OTHER]
    bad = tmp_path / "bad.json"
    for text in ("{", json.dumps([[1, 2]]), json.dumps({"sequences": [[1, "a"]]}), json.dumps({"sequences": [[-1]]})):
        bad.write_text(text)
        with pytest.raises(ConfigError, match="--draft-replay"):
            load_references(bad)
    with pytest.raises(ConfigError, match="--draft-replay .*missing"):
        load_references(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="--draft-replay-p 1.5"):
        EngineOptions(draft_replay_p=1.5).validate()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("replay"), n_layers=3, type="Q8_0")


def local(model, **kw) -> LocalEngine:
    return LocalEngine(build_engine(model, **kw))


def _generate(engine: LocalEngine, prompt, max_tokens) -> dict:
    engine.submit(EngineRequest("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    done = None
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                done = ev
    return done


def test_greedy_output_through_replay_is_the_plain_output_at_any_p(tiny, tmp_path):
    prompt = [5, 300, 37, 400, 12]
    want = _generate(local(tiny, options=EngineOptions(ctx=128)), prompt, 24)
    path = tmp_path / "replay.json"
    write_references(path, [want["prompt_tokens"] + want["tokens"]])
    n = len(want["tokens"])
    assert n == 24  # no stop token came early
    for p in (0.0, 0.5, 1.0):
        eng = local(tiny, options=EngineOptions(ctx=128, draft_replay=path, draft_replay_p=p, draft_tokens=4, draft_width=1))
        got = _generate(eng, prompt, 24)
        assert got["tokens"] == want["tokens"], p
        spec = got["speculation"]
        if p == 0.0:  # every draft right: 1 token from the prefill, then passes of 4 + 1
            assert spec["accepted"] == spec["drafted"] == n - spec["verify_passes"] - 1
        elif p == 1.0:
            # one token a pass; the tree shape may stop drafting (it only costs: how soon depends on measured times)
            assert spec["accepted"] == 0 and 0 < spec["verify_passes"] <= n - 2
        else:
            assert 0 < spec["accepted"] < spec["drafted"]


def test_a_traced_replay_drafts_and_is_accepted_pass_by_pass_as_the_trace_says(tiny, tmp_path):
    """A real drafter's passes, replayed on another model: each pass drafts and has accepted what
    the trace says, the trace starting over when it runs out; greedy output is unchanged. A
    fixed shape (every pass asks for the whole budget), as the bench replays a trace."""
    from ntx.daemons.compute.replay import load_trace

    prompt = [5, 300, 37, 400, 12]
    want = _generate(local(tiny, options=EngineOptions(ctx=128)), prompt, 24)
    path = tmp_path / "traced.json"
    trace = [(0, 0), (4, 3), (2, 0), (6, 6)]  # 6 drafted: cut to the budget of 4
    write_references(path, [want["prompt_tokens"] + want["tokens"]], trace=trace)
    assert load_trace(path) == trace
    eng = local(tiny, options=EngineOptions(ctx=128, draft_replay=path, draft_tokens=4, draft_width=1,
                                            draft_fixed=True))
    seen = []
    propose = eng.core.drafter.propose

    def spy(requests):
        trees = propose(requests)
        seen.extend(len(t) for t in trees)
        return trees

    eng.core.drafter.propose = spy
    got = _generate(eng, prompt, 24)
    assert got["tokens"] == want["tokens"]
    # the passes: 1 token from the prefill, then per pass the accepted ones and one more:
    # (0,0) -> 1, (4,3) -> 4, (2,0) -> 1, (4,4) -> 5; 11 tokens a round of the trace
    assert seen[:8] == [0, 4, 2, 4, 0, 4, 2, 4]
    spec = got["speculation"]
    assert spec["verify_passes"] == len([n for n in seen if n]) and spec["drafted"] == sum(seen)
    # 23 tokens after the prefill's: 2 rounds (22), then the last token from a pass that has no room
    # to draft (max_tokens), so the drafter is not asked
    rounds, rest = divmod(23, 11)
    assert rest == 1 and spec["accepted"] == rounds * 7 and len(seen) == rounds * 4


def test_a_bad_trace_is_one_clear_line(tmp_path):
    from ntx.daemons.compute.replay import load_trace

    for bad in ('{"sequences": [[1, 2]], "trace": [[1, 2]]}', '{"sequences": [], "trace": []}',
                '{"sequences": [], "trace": [[3]]}', '{"sequences": [], "trace": [[true, 0]]}'):
        path = tmp_path / "bad.json"
        path.write_text(bad)
        with pytest.raises(ConfigError, match=r"--draft-replay .*bad.json: \"trace\" must be a non-empty list"):
            load_trace(path)
    ok = tmp_path / "plain.json"
    write_references(ok, [[1, 2, 3]])
    assert load_trace(ok) is None


def test_replay_runs_the_drafter_it_wraps_and_ignores_its_proposals(tiny, tmp_path):
    """The tiny model as its own draft would accept everything; behind a replay at p = 1 nothing
    is accepted, yet the draft model ran on the sequence (its cache held it)."""
    prompt = [5, 300, 37, 400, 12]
    want = _generate(local(tiny, options=EngineOptions(ctx=128)), prompt, 12)
    path = tmp_path / "replay.json"
    write_references(path, [want["prompt_tokens"] + want["tokens"]])
    eng = local(tiny, options=EngineOptions(ctx=128, draft_model=tiny, draft_replay=path, draft_replay_p=1.0, draft_tokens=3))
    assert isinstance(eng.core.drafter, ReplayDrafter) and isinstance(eng.core.drafter.inner, ModelDrafter)
    inner = eng.core.drafter.inner
    calls = []

    def counted(reqs):
        calls.append(len(reqs))
        return ModelDrafter.propose(inner, reqs)

    inner.propose = counted
    got = _generate(eng, prompt, 12)
    assert got["tokens"] == want["tokens"] and got["speculation"]["accepted"] == 0
    # once before every verify pass and every shadow probe (a token proposed beside a plain pass)
    assert calls == [1] * (got["speculation"]["verify_passes"] + eng.core.probes) and eng.core.probes > 0
    assert not inner.cached  # forgotten with the sequence


def test_ntxctl_start_reads_the_replay_file_first(tmp_path, tiny):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    r = ntxctl("start", "--model", str(tiny), *own_instance("replay"), "--backend", "cpu", "--plan-only",
               "--draft-replay", str(bad))
    assert r.returncode == 1 and r.stderr.strip().startswith("ntxctl: error: --draft-replay") and "Traceback" not in r.stderr
    good = tmp_path / "good.json"
    write_references(good, [list(REF)])
    r = ntxctl("start", "--model", str(tiny), *own_instance("replay"), "--backend", "cpu", "--plan-only",
               "--draft-replay", str(good),
               "--draft-replay-p", "2")
    assert r.returncode == 1 and "--draft-replay-p 2.0: a probability" in r.stderr


def test_a_pipeline_started_with_a_replay_drafts_it_and_says_replay(tiny, tmp_path):
    """Through the daemons (one layer resident, three streamed): the file reaches compute, every
    replayed draft is accepted at p = 0, and status and ``ntxctl status`` name the drafter replay."""
    text = "The history of the transistor begins"
    plain = local(tiny, options=EngineOptions(ctx=128))
    want = _generate(plain, plain.prompt_tokens(prompt=text, raw=True), 9)
    path = tmp_path / "replay.json"
    write_references(path, [want["prompt_tokens"] + want["tokens"]])
    with running_pipeline(str(tiny), tmp_path / "run", "--gpu-layers", "1", "--draft-replay", str(path),
                          "--draft-tokens", "3", "--ctx", "128", name="replay") as p:
        done = p.generate_greedy(text, max_tokens=9)
        assert done["tokens"] == want["tokens"]
        assert done["speculation"]["accepted"] == done["speculation"]["drafted"] == 6  # 1 + (3 + 1) x 2
        st = p.wait_status(lambda s: (s.get("speculation") or {}).get("verify_passes", 0) >= 2, "replay counts in status")
        assert st["speculation"]["drafter"] == "replay"
        shown = ntxctl("status", "--name", "replay")
        assert shown.returncode == 0 and "replay drafter" in shown.stdout, shown.stdout + shown.stderr


def test_the_1b_preset_is_a_draft_model_for_the_70b_preset(tmp_path):
    """Llama-3.2-1B's shape, and the same tokenizer as the 70B preset (the synthetic vocabulary
    depends on its size only), so ``--draft-model`` accepts it: checked on copies cut to one
    narrow layer that keep the full 128,256-token vocabulary."""
    import synth_gguf as sg

    from ntx.daemons.compute.speculation import check_same_vocabulary
    from ntx.shared.gguf_index import open_model

    full = sg.preset_config("llama3-1b", type="Q4_K_M")
    assert (full.n_layers, full.d_model, full.d_ff, full.n_heads, full.n_kv_heads, full.hd) == (16, 2048, 8192, 32, 8, 64)
    assert (full.vocab_size, full.rope_base, full.tied_embeddings) == (128256, 500000.0, True)
    gb = sum(t.nbytes for t in sg.tensor_plan(full)) / 1e9
    assert 0.7 < gb < 0.9, gb  # Llama-3.2-1B Q4_K_M is 0.81 GB
    narrow = dict(n_layers=1, d_model=64, d_ff=64, n_heads=2, n_kv_heads=1, type="Q8_0")
    draft = open_model(sg.write_llama_gguf(tmp_path / "1b.gguf", sg.preset_config("llama3-1b", **narrow)))
    target = open_model(sg.write_llama_gguf(tmp_path / "70b.gguf", sg.preset_config("llama3-70b", **narrow)))
    assert draft.hparams.n_vocab == target.hparams.n_vocab == 128256
    check_same_vocabulary(target, draft)
