"""Speculative decoding on the cpu backend: drafts verified by one pass of the target.

Greedy output is token for token the output without speculation, for every drafter; with
temperature > 0 the acceptance rule keeps the target's distribution (checked exactly on the rule,
and statistically on a small model against distributions computed from its logits); max_tokens,
the context limit, stop strings, cancel and continuous batching behave as without it."""

from __future__ import annotations

import numpy as np
import pytest

from ntx.daemons.compute.backend import Picked
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.ctl.local import LocalEngine
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.sampler import Sampler, SamplingParams
from ntx.daemons.compute.speculation import DraftTree, verify_tree
from ntx.shared.config import EngineOptions
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.messages import EngineRequest

try:
    from .pipeline_util import own_instance
    from .synth_models import write_tiny
except ImportError:  # tests/ is not a package
    from pipeline_util import own_instance
    from synth_models import write_tiny

GREEDY = dict(temperature=0.0)


def local(model, **kw) -> LocalEngine:
    """An engine of ``model`` (``build_engine``'s keywords) behind its front, in this process."""
    return LocalEngine(build_engine(model, **kw))


def _run(engine, requests: list[tuple[str, list[int], dict]]) -> dict[str, dict]:
    """Submit (id, prompt tokens, sampling fields) requests at once; their done events by id."""
    for rid, ids, fields in requests:
        speculative = fields.pop("speculative", True)
        engine.submit(EngineRequest(rid, list(ids), SamplingParams(**fields), speculative=speculative))
    done = {}
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                done[ev["id"]] = ev
    return done


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return local(smollm2_path, options=EngineOptions(ctx=256, max_batch=4))


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.prompt_tokens(prompt=p, raw=True) for p in
            ("The history of the transistor begins", "Water boils at a temperature of", "Once upon a time")]


def test_a_model_as_its_own_draft_accepts_every_token_and_changes_nothing(smollm2_path, plain, prompts):
    want = _run(plain, [("a", prompts[0], dict(GREEDY, max_tokens=24))])["a"]
    spec = local(smollm2_path, options=EngineOptions(ctx=256, max_batch=4, draft_model=smollm2_path, draft_tokens=4, draft_width=1))
    got = _run(spec, [("a", prompts[0], dict(GREEDY, max_tokens=24))])["a"]
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    # every drafted token accepted. How deep each pass drafts, or whether it drafts at all, is the
    # tree shape's choice from measured times (a draft as costly as the target pays little): the
    # first pass drafts on the shape's priors, later ones may not, and each verify pass yields its
    # accepted + 1 tokens after the prefill's one
    sp = got["speculation"]
    assert sp["acceptance_rate"] == 1.0 and sp["drafted"] == sp["accepted"] > 0
    assert 1 + sp["verify_passes"] + sp["accepted"] <= 24


@pytest.mark.parametrize("drafter,width", [("self-half", 1), ("self-half", 3), ("model", None)])
def test_greedy_output_is_identical_with_every_drafter_in_a_batch(smollm2_path, plain, prompts, drafter, width):
    reqs = [(f"r{i}", p, dict(GREEDY, max_tokens=20)) for i, p in enumerate(prompts)]
    want = _run(plain, [(r, p, dict(f)) for r, p, f in reqs])
    kw = dict(self_draft=list(range(0, 15))) if drafter == "self-half" else dict(draft_model=smollm2_path)
    spec = local(smollm2_path, options=EngineOptions(ctx=256, max_batch=4, draft_tokens=6, draft_width=width, **kw))
    reqs[2][2]["speculative"] = False  # one request opts out, in the same batch
    got = _run(spec, reqs)
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
    assert "speculation" in got["r0"] and "speculation" not in got["r2"]
    assert spec.core.spec.passes > 0 and spec.core.spec.drafted >= spec.core.spec.accepted
    if drafter == "self-half":  # half the layers guess wrong at times: rejections were exercised
        assert spec.core.spec.accepted < spec.core.spec.drafted


def test_max_tokens_context_and_stop_strings_end_where_they_would(smollm2_path, plain, prompts):
    spec = local(smollm2_path, options=EngineOptions(ctx=256, max_batch=4, draft_model=smollm2_path, draft_tokens=8, draft_width=2))
    for fields in (dict(GREEDY, max_tokens=5), dict(GREEDY, max_tokens=30, stop=[" the"])):
        want = _run(plain, [("x", prompts[0], dict(fields))])["x"]
        got = _run(spec, [("x", prompts[0], dict(fields))])["x"]
        assert (got["tokens"], got["text"], got["finish_reason"]) == (want["tokens"], want["text"], want["finish_reason"])
    short_plain = local(smollm2_path, options=EngineOptions(ctx=len(prompts[1]) + 9))
    short_spec = local(smollm2_path, options=EngineOptions(ctx=len(prompts[1]) + 9, draft_model=smollm2_path, draft_tokens=8))
    want = _run(short_plain, [("c", prompts[1], dict(GREEDY, max_tokens=100))])["c"]
    got = _run(short_spec, [("c", prompts[1], dict(GREEDY, max_tokens=100))])["c"]
    assert got["tokens"] == want["tokens"] and got["finish_reason"] == want["finish_reason"] == "length"


def test_cancel_between_verify_passes_frees_the_draft_and_the_next_request_is_unaffected(smollm2_path, plain, prompts):
    # a fixed shape: every pass verifies a draft. An adaptive one may judge a draft model as dear
    # as the target not worth its time (timing on a loaded machine) and decode the request to its
    # end on plain passes, before a second verify pass (CI saw it: the draft cache already freed)
    spec = local(smollm2_path, options=EngineOptions(ctx=256, max_batch=4, draft_model=smollm2_path, draft_tokens=4,
                                                     draft_width=1, draft_fixed=True))
    drafter = spec.core.drafter
    spec.submit(EngineRequest("long", prompts[2], SamplingParams(**GREEDY, max_tokens=200)))
    while spec.core.spec.passes < 2:
        spec.step()
    assert drafter.cached  # the draft model holds the sequence
    (done,) = spec.cancel("long")
    assert done["finish_reason"] == "cancelled" and done["speculation"]["verify_passes"] >= 2
    assert not drafter.cached and not spec.has_work
    want = _run(plain, [("after", prompts[0], dict(GREEDY, max_tokens=12))])["after"]
    assert _run(spec, [("after", prompts[0], dict(GREEDY, max_tokens=12))])["after"]["tokens"] == want["tokens"]


def test_bad_drafters_are_one_clear_line(smollm2_path, tmp_path):
    other = write_tiny(tmp_path)  # a 512-token vocabulary
    with pytest.raises(ConfigError, match="vocabulary has 512 tokens.*same tokenizer"):
        build_engine(smollm2_path, options=EngineOptions(draft_model=other))
    with pytest.raises(ConfigError, match="not both"):
        build_engine(smollm2_path, options=EngineOptions(draft_model=smollm2_path, self_draft=True))
    with pytest.raises(ConfigError, match="not resident"):
        build_engine(smollm2_path, options=EngineOptions(self_draft=[0, 12]), resident_layers=range(10))
    with pytest.raises(NtxError, match="--draft-tokens 0"):
        build_engine(smollm2_path, options=EngineOptions(self_draft=True, draft_tokens=0))


# ---------------------------------------------------------------------------------------------
# The acceptance rule keeps the target's distribution


def _row(logits) -> Picked:
    return Picked(row=np.asarray(logits, dtype=np.float32))


def test_verify_tree_on_a_chain_yields_the_target_distribution_exactly_in_law():
    """Rows p0, p1, p2 fixed; draft [x0, x1]. The first token must follow p0, the second (when
    the first is x0) p1. 40,000 draws from fixed seeds, each frequency within 4.5 sigma."""
    rng = np.random.default_rng(3)
    rows = [_row(rng.normal(size=6) * 1.5) for _ in range(3)]
    params = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0, seed=0)
    probe = Sampler(params)
    p = [dict(zip(*(a.tolist() for a in probe.distribution(r)))) for r in rows]
    draft = [max(p[0], key=p[0].get), sorted(p[1], key=p[1].get)[1]]  # a likely and an unlikely guess
    n = 40_000
    first = np.zeros(6)
    second = np.zeros(6)
    for seed in range(n):
        out, _ = verify_tree(DraftTree.chain(draft), rows, Sampler(SamplingParams(**{**params.__dict__, "seed": seed})), [])
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for freq, dist, total in ((first, p[0], n), (second, p[1], first[draft[0]])):
        for tok in range(6):
            want = dist.get(tok, 0.0)
            sigma = np.sqrt(total * want * (1 - want)) + 1e-9
            assert abs(freq[tok] - total * want) <= 4.5 * sigma + 1, (tok, freq[tok], total * want)


SAMPLED = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, max_tokens=3)


def _joint_of_two(spec: LocalEngine, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The joint distribution of the first two tokens ``SAMPLED`` generates after ``prompt``,
    computed from the model's logits (top-k 3: nine cells)."""
    m = spec.core.model
    probe = Sampler(SamplingParams(**SAMPLED))
    m.backend.alloc_sequence(10_000, spec.core.max_context)
    last = m.forward(StepBatch([SeqChunk(10_000, 0, tuple(prompt), all_logits=True)]))[-1]
    joint: dict[tuple[int, int], float] = {}
    for t1, p1 in zip(*probe.distribution(_row(last))):
        row = m.forward(StepBatch([SeqChunk(10_000, len(prompt), (int(t1),))]))[0]
        for t2, p2 in zip(*probe.distribution(_row(row))):
            joint[(int(t1), int(t2))] = float(p1 * p2)
    m.backend.free_sequence(10_000)
    return joint


def _chi2_of_seeded_requests(spec: LocalEngine, prompt: list[int], joint: dict, n: int = 1500,
                             max_tokens: int = 3) -> float:
    """1,500 seeded requests with speculation, 8 at a time: the chi-square of their first two
    tokens against ``joint``."""
    counts = dict.fromkeys(joint, 0)
    fields = dict(SAMPLED, max_tokens=max_tokens)
    for start in range(0, n, 8):
        done = _run(spec, [(f"s{i}", prompt, dict(fields, seed=i)) for i in range(start, min(start + 8, n))])
        for ev in done.values():
            counts[tuple(ev["tokens"][:2])] += 1
    return sum((counts[k] - n * q) ** 2 / (n * q) for k, q in joint.items())


def test_sampling_with_a_self_draft_keeps_the_models_distribution(tmp_path):
    """A 2-layer synthetic model drafting with its first layer; top-k 3 at temperature 1. The
    joint distribution of the first two generated tokens, computed from the model's logits,
    against 1,500 seeded requests with speculation: a chi-square test at p = 0.001."""
    model = write_tiny(tmp_path, type="Q8_0")
    spec = local(model, options=EngineOptions(ctx=64, max_batch=8, self_draft=[0], draft_tokens=1))
    prompt = [5, 300, 37, 400]
    chi2 = _chi2_of_seeded_requests(spec, prompt, _joint_of_two(spec, prompt))
    assert spec.core.spec.passes > 0 and 0 < spec.core.spec.accepted < spec.core.spec.drafted
    assert chi2 < 26.12, chi2  # 9 cells: 8 degrees of freedom, p = 0.001


def _lookup_prompt(spec: LocalEngine) -> list[int]:
    """A prompt after which every likely first token t is looked up: it ends with ``L`` and holds
    ``L t u`` and ``L t v`` for each such t (u, v: t's two likeliest followers there), so the
    second token is always drafted, two branches wide. Which tokens are likely depends on the
    prompt, so the set grows until the prompt's own top 3 are all in it (a few rounds)."""
    m = spec.core.model
    probe = Sampler(SamplingParams(**SAMPLED))

    def top3(tokens: list[int]) -> list[int]:
        m.backend.alloc_sequence(10_001, spec.core.max_context)
        last = m.forward(StepBatch([SeqChunk(10_001, 0, tuple(tokens), all_logits=True)]))[-1]
        m.backend.free_sequence(10_001)
        return [int(t) for t in probe.distribution(_row(last))[0]]

    L, covered, prompt = 7, {}, [5, 300, 37, 400, 7]
    for _ in range(20):
        missing = [t for t in top3(prompt) if t not in covered]
        if not missing:
            return prompt
        for t in missing:
            u, v = top3(prompt + [t])[:2]
            covered[t] = (u, v)
        prompt = [5, 300, 37, 400] + [x for t, (u, v) in covered.items() for x in (L, t, u, L, t, v)] + [L]
    raise AssertionError(f"no prompt covers its own top 3 after 20 rounds: {prompt}")


@pytest.mark.parametrize("draft", ["ngram", "suffix", "lookahead"])
def test_sampling_with_a_lookup_draft_keeps_the_models_distribution(tmp_path, draft):
    """The same test for the drafters without a model, on a prompt where every likely first
    token is followed by a drafted tree of two branches (``_lookup_prompt``; the lookahead adds
    its window of guesses beside them); the suffix drafter
    also draws on the earlier requests' sampled text (6 tokens each, so that each has proposed
    after its first two and left them in the recent text). Fixed trees: every pass drafts."""
    model = write_tiny(tmp_path, type="Q8_0")
    # the lookahead: 4 wide and room for 4 deep (max_tokens), so that the lookup's two branches
    # leave nodes for a window, whose first level's guesses are more children of the last token
    tokens, width, max_tokens = (16, 4, 24) if draft == "lookahead" else (4, 2, 6)
    spec = local(model, options=EngineOptions(ctx=128, max_batch=8, draft=draft, draft_tokens=tokens, draft_width=width,
                                               draft_fixed=True))
    prompt = _lookup_prompt(spec)
    chi2 = _chi2_of_seeded_requests(spec, prompt, _joint_of_two(spec, prompt), max_tokens=max_tokens)
    sp = spec.core.spec
    assert sp.passes > 0 and 0 < sp.accepted < sp.drafted, sp.__dict__
    if draft == "lookahead":  # the window's guesses were in the trees
        assert spec.core.drafter.window_passes > 0
    assert chi2 < 26.12, chi2  # 9 cells: 8 degrees of freedom, p = 0.001


# ---------------------------------------------------------------------------------------------
# Through the daemons


def test_pipeline_self_draft_streams_and_reports_acceptance(smollm2_path, plain, prompts, tmp_path):
    """10 resident layers draft; the other 20 stream from pinned RAM every verify pass. Greedy
    tokens equal the plain engine's; `speculative: false` opts one request out; status shows it."""
    try:
        from .pipeline_util import running_pipeline
    except ImportError:
        from pipeline_util import running_pipeline
    want = _run(plain, [("w", prompts[0], dict(GREEDY, max_tokens=10))])["w"]
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "10", "--self-draft", "all",
                          "--draft-tokens", "3", "--ctx", "256", name="spec") as p:
        done = p.generate_greedy("The history of the transistor begins", max_tokens=10)
        assert done["tokens"] == want["tokens"]
        assert done["speculation"]["verify_passes"] > 0
        off = p.generate_greedy("The history of the transistor begins", max_tokens=10, speculative=False)
        assert off["tokens"] == want["tokens"] and "speculation" not in off
        st = p.wait_status(lambda s: (s.get("speculation") or {}).get("verify_passes", 0) >= done["speculation"]["verify_passes"],
                           "speculation counts in status")
        assert st["speculation"]["drafter"] == "self" and st["speculation"]["draft_tokens"] == 3


# ---------------------------------------------------------------------------------------------
# Trees: the mask, the kept path, the rule with siblings


TREE = DraftTree(tokens=[3575, 282, 4649, 1780, 314, 216], parents=[-1, 0, 1, -1, 3, 0])  # two branches and a leaf


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_a_tree_chunk_row_sees_its_own_branch_as_if_run_alone(plain):
    """Each node's logits in one tree pass equal those of its root-to-node path run as a plain
    chunk in a fresh sequence (float32 rounding of other pass shapes aside: 1e-5)."""
    m = plain.core.model
    prefix = [504, 3575, 282, 4649, 314, 7042]
    m.backend.alloc_sequence(900, 64)
    m.forward(StepBatch([SeqChunk(900, 0, tuple(prefix[:-1]))]))
    root = prefix[-1]
    tree_logits = m.forward(StepBatch([SeqChunk(900, len(prefix) - 1, (root, *TREE.tokens), all_logits=True,
                                                parents=TREE.chunk_parents())]))
    m.backend.free_sequence(900)
    for node in range(len(TREE)):
        path, i = [], node
        while i != -1:
            path.insert(0, TREE.tokens[i])
            i = TREE.parents[i]
        m.backend.alloc_sequence(901, 64)
        alone = m.forward(StepBatch([SeqChunk(901, 0, tuple(prefix + path))]))[-1]
        m.backend.free_sequence(901)
        assert _rel(tree_logits[node + 1], alone) < 1e-5, node
        assert tree_logits[node + 1].argmax() == alone.argmax()


KEEP_PREFIX = [504, 3575, 282, 4649, 314, 7042]  # node i of TREE sits at len(KEEP_PREFIX) + i


def _kept_against_fed(m, seq_id: int, path: list[int], keep) -> tuple[np.ndarray, np.ndarray]:
    """Verify TREE after KEEP_PREFIX in sequence ``seq_id``, keep ``path``'s K/V through
    ``keep(seq_id, src, dst)``, decode one token; and the same token after the prefix and the
    path fed as a plain chunk in another sequence: (kept logits, fed logits)."""
    pos = len(KEEP_PREFIX)  # the root (the last prefix token) at pos - 1
    m.backend.alloc_sequence(seq_id, 64)
    m.forward(StepBatch([SeqChunk(seq_id, 0, tuple(KEEP_PREFIX[:-1]))]))
    m.forward(StepBatch([SeqChunk(seq_id, pos - 1, (KEEP_PREFIX[-1], *TREE.tokens), all_logits=True,
                                  parents=TREE.chunk_parents())]))
    keep(seq_id, [pos + i for i in path], [pos + k for k in range(len(path))])
    kept = m.forward(StepBatch([SeqChunk(seq_id, pos + len(path), (42,))]))[-1]
    m.backend.free_sequence(seq_id)
    m.backend.alloc_sequence(seq_id + 1, 64)
    fed = m.forward(StepBatch([SeqChunk(seq_id + 1, 0, (*KEEP_PREFIX, *(TREE.tokens[i] for i in path), 42))]))[-1]
    m.backend.free_sequence(seq_id + 1)
    return kept, fed


def test_keeping_a_sibling_path_leaves_the_cache_as_if_it_had_been_fed(plain):
    """Verify the tree, keep the path 3 -> 4 (a branch off the root, not the chain), then decode:
    the same logits as a sequence that was fed that path as a plain chunk."""
    kept, fed = _kept_against_fed(plain.core.model, 902, [3, 4], plain.core.model.backend.kv_keep)
    assert _rel(kept, fed) < 1e-5 and kept.argmax() == fed.argmax()


def test_a_kept_path_that_starts_on_the_chain_then_takes_a_sibling(plain):
    """The path 0 -> 5 (the chain's first node, then its second child): node 0's K/V stay where
    they are and node 5's move down one. A move onto itself is refused (by the cuda move, and
    by the cpu backend so that CI sees it), so the engine moves only node 5
    (``EngineCore._verify``); the cache is then as if the path had been fed."""
    m = plain.core.model
    assert TREE.parents[5] == 0
    pos = len(KEEP_PREFIX)
    with pytest.raises(ValueError, match="destination below its source"):
        m.backend.kv_keep(0, [pos, pos + 5], [pos, pos + 1])  # checked before the sequence is looked up
    moved_only = lambda seq_id, src, dst: m.kv_keep(seq_id, src[1:], dst[1:])  # noqa: E731  (node 5's)
    kept, fed = _kept_against_fed(m, 904, [0, 5], moved_only)
    assert _rel(kept, fed) < 1e-5 and kept.argmax() == fed.argmax()


def test_verify_tree_with_siblings_keeps_the_distribution():
    """A node with three children (best first): the token taken there follows p, whichever of
    them (or none) the draws accept; 40,000 seeded draws, each frequency within 4.5 sigma."""
    rng = np.random.default_rng(5)
    rows = [_row(rng.normal(size=6) * 1.5) for _ in range(4)]
    params = SamplingParams(temperature=1.1, top_k=6, top_p=1.0, min_p=0.0, seed=0)
    p = dict(zip(*(a.tolist() for a in Sampler(params).distribution(rows[0]))))
    order = sorted(p, key=p.get, reverse=True)
    tree = DraftTree(tokens=[order[0], order[2], order[4]], parents=[-1, -1, -1])
    n = 40_000
    first = np.zeros(6)
    for seed in range(n):
        out, path = verify_tree(tree, rows, Sampler(SamplingParams(**{**params.__dict__, "seed": seed})), [])
        first[out[0]] += 1
        assert len(out) == len(path) + 1 and all(tree.tokens[i] == t for i, t in zip(path, out))
    for tok in range(6):
        want = p.get(tok, 0.0)
        assert abs(first[tok] - n * want) <= 4.5 * np.sqrt(n * want * (1 - want)) + 1, (tok, first[tok], n * want)


def test_the_tree_shape_follows_measured_acceptance():
    """High chain acceptance and a costly verify pass: deep chains. A chain token that is always
    rejected while its sibling is taken: wide, shallow trees. Cheap verify passes: shallow."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    deep = TreeShape(budget=32)
    chain = DraftTree.chain([1] * 8)
    for _ in range(60):
        deep.observe(chain, list(range(8)))
        deep.observe_times(verify_s=0.36, depth_s=0.004)
    d, w = deep.best()
    assert w == 1 and d >= 16
    wide = TreeShape(budget=32)
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, -1, -1])
    for _ in range(60):
        wide.observe(tree, [1])  # the rank-2 sibling wins every time
        wide.observe_times(verify_s=0.36, depth_s=0.004)
    assert wide.best()[1] >= 2
    cheap = TreeShape(budget=32)
    for _ in range(60):
        cheap.observe(chain, [0, 1])
        cheap.observe_times(verify_s=0.005, depth_s=0.004)
    assert cheap.best()[0] <= 4
    given = TreeShape(budget=12, width=3)  # a width given: its depth is chosen, up to budget / width
    assert [given.best(Acceptance(chain_rate=a)) for a in (0.3, 0.5, 0.99)] == [(2, 3), (3, 3), (4, 3)]


def test_a_tree_wider_than_the_shape_s_own_widths_is_learnt_from():
    """``--draft-width`` goes up to the budget, past the widths the shape chooses among (1-4): a
    tree of 8 siblings, the rank-6 one taken, is learnt from (it raised KeyError in the compute
    daemon), and a given width of 8 is weighed from the prior until measured."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    shape = TreeShape(budget=64, width=8)
    assert shape.expected_accepted(2, 8) > shape.expected_accepted(2, 4)  # ranks 5-8 from the prior
    siblings = DraftTree(tokens=list(range(8)), parents=[-1] * 8)
    seq = Acceptance()
    for _ in range(10):
        shape.observe(siblings, [5], seq)
    assert seq.rescue(6) > Acceptance.RESCUE_PRIOR and seq.rescue(5) < Acceptance.RESCUE_PRIOR
    assert seq.rescue(7) == Acceptance.RESCUE_PRIOR  # never tried: rank 6 was taken first
    assert shape.best(seq)[1] == 8 and TreeShape(budget=64, width=8, fixed=True).choose() == (8, 8)


def _shape_run(shape, passes: int, taken: bool, depth_s: float, acc=None) -> tuple[list[int], list[int]]:
    """``passes`` passes as the engine runs them: a drafted pass verifies (every node taken, or
    the first rejected), an undrafted one is timed plain and may carry a shadow probe. Returns
    each pass's depth and the passes that carried a probe."""
    shapes, probes = [], []
    for i in range(passes):
        d, _ = shape.choose(acc)
        shapes.append(d)
        if d:
            shape.observe(DraftTree.chain([1] * d), list(range(d)) if taken else [], acc)
            shape.observe_times(verify_s=0.36, depth_s=depth_s)
        else:
            shape.observe_times(plain_s=0.3)
            if shape.shadow_probe(acc):
                probes.append(i)
                shape.observe(DraftTree.chain([1]), [0] if taken else [], acc)
    return shapes, probes


@pytest.mark.parametrize("depth_s", [0.03, 0.001])
def test_the_tree_shape_stops_drafting_when_no_draft_is_accepted_and_keeps_probing(depth_s):
    """Every draft wrong: drafting only costs, so the shape turns it off (depth 0), and shadow
    probes (a token proposed beside an undrafted pass, no verify rows) keep measuring: with a
    drafter whose depth costs a tenth of a pass, PROBE_EVERY passes after drafting stopped, then
    twice as many passes after each rejected probe, up to PROBE_MAX; with a nearly free one
    (lookup, replay), every undrafted pass. When the proposed tokens start being the passes'
    own, the shape drafts deep again."""
    from ntx.daemons.compute.speculation import TreeShape

    shape = TreeShape(budget=8, width=1)
    shapes, probes = _shape_run(shape, 300, False, depth_s)
    # the priors' drafts, then (a plain pass timed) fewer, then none
    assert shapes[0] > 1, shapes[:12]
    off = max(i for i, d in enumerate(shapes) if d) + 1
    assert off <= 8 and not any(shapes[off:]), shapes[:12]
    later = [i for i in probes if i >= off]
    if depth_s > TreeShape.SHADOW_FREE * 0.3:
        gaps = [b - a for a, b in zip(later, later[1:])]  # after the sequence's exploring probes
        assert gaps == [min(TreeShape.PROBE_MAX, TreeShape.PROBE_EVERY << j) for j in range(len(gaps))], later
        assert gaps[-1] == TreeShape.PROBE_MAX
    else:
        assert later == list(range(off, 300))
    assert shape.best() == (0, 1)
    shapes, _ = _shape_run(shape, TreeShape.PROBE_MAX + 60, True, depth_s)  # the drafts come right again
    assert shapes[-1] == 8 and shape.best()[0] == 8


def test_drafts_are_sized_to_what_the_verify_pass_of_their_rows_costs():
    """Where a verify pass's cost grows with its rows (the cpu tier's layers cross the link in a
    pass of more than 4 rows: 1.41x a plain pass at 9 rows, 1.12x at 2), the shape drafts as
    deep as pays at each width's measured cost: shallow at middling acceptance, deep when nearly
    every token is taken; with one cost for every width it drafts the whole budget. A width not
    measured costs what is linear between the measured ones around it (a plain pass standing
    for one row), beyond the widest the widest's."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    steep, flat = TreeShape(budget=8, width=1), TreeShape(budget=8, width=1)
    for rows, cost in ((2, 0.304), (4, 0.33), (5, 0.38), (9, 0.383)):  # the step: past 4 rows
        steep.observe_times(verify_s=cost, depth_s=0.0, plain_s=0.271, rows=rows)
        flat.observe_times(verify_s=0.304, depth_s=0.0, plain_s=0.271, rows=rows)
    assert steep.verify_cost(3) == pytest.approx(0.317) and steep.verify_cost(30) == 0.383
    assert steep.verify_cost(1) == 0.271 and TreeShape(budget=8).verify_cost(5) == 1.0  # the prior
    middling = Acceptance(chain_rate=0.6, observed=TreeShape.EXPLORE_PASSES)
    assert 1 <= steep.best(middling)[0] <= 3 and flat.best(middling)[0] == 8
    assert steep.best(Acceptance(chain_rate=0.95, observed=TreeShape.EXPLORE_PASSES))[0] == 8
    # other sequences' rows count: beside 8 of them the pass is wide undrafted, and a deep chain
    # costs no more; beside 2 (a 3-row pass costs what 4 rows do), a token more is free too
    assert steep.best(middling, other_rows=8)[0] == 8 and steep.best(middling, other_rows=2)[0] >= 1


def test_every_draft_wrong_costs_a_new_sequence_no_verify_pass():
    """Once the instance has measured that drafts are rejected, a new sequence measures its own
    acceptance by shadow probes (its first passes, then every undrafted pass for a free drafter):
    over 32 passes not one verify pass, which on the 70B at 24 GiB costs 1.43x a plain pass at 2
    rows; and a sequence whose proposals are the passes' own tokens drafts within its first passes."""
    from ntx.daemons.compute.speculation import TreeShape

    shape = TreeShape(budget=8, width=1)
    for rows, cost in ((2, 0.31), (9, 0.383)):
        shape.observe_times(verify_s=cost, depth_s=0.0, plain_s=0.217, rows=rows)
    _shape_run(shape, 40, False, 0.0)  # earlier requests: every draft rejected
    shapes, probes = _shape_run(shape, 32, False, 0.0, shape.acc.copy())
    assert shapes == [0] * 32 and probes == list(range(32))
    quoting = shape.acc.copy()
    shapes, probes = _shape_run(shape, 6, True, 0.0, quoting)
    assert probes[0] == 0 and shapes[1] > 0 and shapes[-1] == 8, shapes  # one accepted probe, then deeper drafts


def test_a_verify_cost_measured_once_too_high_is_measured_again():
    """The first wide verify pass of an instance pays one-time costs (on the H200 the cpu tier's
    staging buffer): judged by that pass, drafting stops though nearly every token would be
    accepted. Since drafting is off for the cost alone, the shape that would pay is drafted again
    PROBE_EVERY passes later; the pass costs what it should, the least of the recent ones counts,
    and drafting goes on. Where the acceptance is not there (every draft wrong), no verify pass
    is spent on measuring costs."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    shape = TreeShape(budget=8, width=1)
    shape.observe_times(verify_s=2.0, depth_s=0.0, plain_s=0.22, rows=9)  # the first 9-row pass: one-time costs
    high = Acceptance(chain_rate=0.9, observed=TreeShape.EXPLORE_PASSES)
    shapes = []
    for _ in range(2 * TreeShape.PROBE_EVERY):
        d, _ = shape.choose(high)
        shapes.append(d)
        if d:
            shape.observe_times(verify_s=0.37, rows=d + 1)
    assert shapes[:TreeShape.PROBE_EVERY - 1] == [0] * (TreeShape.PROBE_EVERY - 1), shapes
    assert shapes[TreeShape.PROBE_EVERY - 1] == 8 and all(d == 8 for d in shapes[TreeShape.PROBE_EVERY - 1:]), shapes
    assert shape.verify_cost(9) == 0.37
    wrong = Acceptance(chain_rate=0.02, observed=TreeShape.EXPLORE_PASSES)
    costly = TreeShape(budget=8, width=1)
    costly.observe_times(verify_s=2.0, depth_s=0.0, plain_s=0.22, rows=9)
    assert [costly.choose(wrong)[0] for _ in range(100)] == [0] * 100


def test_a_self_draft_without_the_most_similar_layers(smollm2_path, plain, prompts):
    """--self-draft-skip: every resident layer but the given ones drafts; output unchanged."""
    want = _run(plain, [("k", prompts[1], dict(GREEDY, max_tokens=12))])["k"]
    spec = local(smollm2_path, options=EngineOptions(ctx=256, self_draft=True, self_draft_skip=[13, 14], draft_tokens=4))
    assert spec.core.drafter.layers == [i for i in range(30) if i not in (13, 14)]
    got = _run(spec, [("k", prompts[1], dict(GREEDY, max_tokens=12))])["k"]
    assert got["tokens"] == want["tokens"] and got["speculation"]["verify_passes"] > 0


def test_self_draft_skip_on_the_command_line(smollm2_path):
    """The option reads --skip-layers' grammar and names itself when the value is bad."""
    from subprocess import run
    import sys

    ok = run([sys.executable, "-m", "ntx.ctl.cli", "start", "--model", str(smollm2_path), "--backend", "cpu",
              *own_instance("selfdraft"), "--plan-only", "--self-draft-skip", "13-14"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = run([sys.executable, "-m", "ntx.ctl.cli", "start", "--model", str(smollm2_path), "--backend", "cpu",
               *own_instance("selfdraft"), "--plan-only", "--self-draft-skip", "0-40"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("ntxctl: error: --self-draft-skip 0-40") and "Traceback" not in bad.stderr


def test_a_model_drafters_depth_time_leaves_out_its_catch_up(tmp_path):
    """The tree shape weighs a draft depth's time against a verify pass's. A model drafter's
    first pass for a new request feeds the whole prompt into its own cache: that pass is catch-up,
    and counted as a depth it made drafting look as dear as a prefill (a loss that switched
    drafting off, then only probes). Only passes that fed one token per sequence are timed."""
    from ntx.daemons.compute.speculation import DraftRequest, ModelDrafter
    model = write_tiny(tmp_path, n_layers=2)
    engine = build_engine(str(model), options=EngineOptions(ctx=128, draft_model=str(model), draft_tokens=4))
    drafter = engine.drafter
    assert isinstance(drafter, ModelDrafter)
    prompt = list(range(1, 41))
    drafter.propose([DraftRequest(7, prompt, 1, 1, 128)])
    assert drafter.depth_s is None  # its one pass fed 40 tokens: nothing to learn about a depth
    tree = drafter.propose([DraftRequest(7, prompt + [5], 3, 1, 128)])[0]
    assert len(tree.tokens) == 3 and drafter.depth_s is not None and drafter.depth_s > 0
    drafter.forget(7)


def test_each_sequence_drafts_by_its_own_acceptance():
    """Two sequences under one tree shape: one whose drafts are always rejected stops drafting
    (shadow probes, ever fewer, measure it) while the other, whose drafts are all accepted, keeps
    drafting deep; a new sequence starts from what the instance measured."""
    from ntx.daemons.compute.speculation import TreeShape

    shape = TreeShape(budget=8, width=1)
    shape.observe_times(verify_s=0.36, depth_s=0.03, plain_s=0.3)
    good, bad = shape.acc.copy(), shape.acc.copy()
    for _ in range(40):
        _shape_run(shape, 1, True, 0.03, good)
        _shape_run(shape, 1, False, 0.03, bad)
    assert shape.best(good) == (8, 1) and shape.best(bad) == (0, 1)
    shapes, probes = _shape_run(shape, 128, False, 0.03, bad)
    assert not any(shapes) and 1 <= len(probes) <= 4  # shadow probes, ever fewer (a dear drafter)
    assert shape.choose(good)[0] == 8
    assert 0.0 < shape.acc.chain_rate < 1.0 and shape.acc.copy().undrafted_passes == 0


def test_drafting_stops_where_the_verify_pass_costs_more_than_its_tokens_bring():
    """A verify pass dearer than a plain one (resident decode, the CPU: its extra rows cost)
    needs more accepted tokens to pay: at half acceptance, a verify pass of 3x a plain pass does
    not, while one of the same cost as a plain pass (a streamed pass) does. A new sequence's
    first passes carry shadow probes, so its own acceptance is measured first."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    half = Acceptance(chain_rate=0.5, observed=TreeShape.EXPLORE_PASSES)  # past its first passes
    streamed = TreeShape(budget=8, width=1)
    streamed.observe_times(verify_s=0.36, depth_s=0.0, plain_s=0.36)
    assert streamed.best(half)[0] > 0
    resident = TreeShape(budget=8, width=1)
    resident.observe_times(verify_s=0.03, depth_s=0.0, plain_s=0.01)
    assert resident.best(half) == (0, 1)
    new = Acceptance(chain_rate=0.5)
    assert resident.choose(new) == (0, 1) and resident.shadow_probe(new)  # a new sequence measures its own first


def test_a_fixed_tree_shape_drafts_its_whole_budget_whatever_was_measured():
    """Benchmarks that time one shape (``ntxctl bench --scenarios spec``'s chains) fix it: from
    the priors (which hold chains over 14 tokens back), with every draft rejected, and with a
    verify pass far dearer than a plain one, a fixed shape still drafts the whole budget."""
    from ntx.daemons.compute.speculation import Acceptance, TreeShape

    assert TreeShape(budget=64, width=1).best()[0] < 8  # the priors: a short chain, not the budget
    fixed = TreeShape(budget=64, fixed=True)  # auto width: a chain
    assert fixed.choose() == (64, 1) and fixed.best() == (64, 1)
    fixed.observe_times(verify_s=0.5, depth_s=0.001, plain_s=0.001)
    rejected = Acceptance(chain_rate=0.0, observed=TreeShape.EXPLORE_PASSES)
    for _ in range(20):
        assert fixed.choose(rejected) == (64, 1)
        fixed.observe(DraftTree.chain([1] * 64), [], rejected)
    assert TreeShape(budget=12, width=3, fixed=True).choose() == (4, 3)
