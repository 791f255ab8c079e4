"""Sampler, logprobs and stop-string tests on hand-made logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ntx.ctl.requests import StopMatcher
from ntx.daemons.compute.sampler import (
    REPETITION_WINDOW,
    Sampler,
    SamplingParams,
    logprobs_topk,
)
from ntx.shared.errors import NtxError


def _logits(seed: int = 0, n_vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, n_vocab).astype(np.float32)  # [V]


def _draws(params: SamplingParams, n: int = 50, logits_seed: int = 0) -> list[int]:
    s = Sampler(params)
    return [s.sample(_logits(logits_seed + i), history=[]) for i in range(n)]


# --- determinism ---------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_differs():
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = _draws(SamplingParams(seed=1234, **p))
    b = _draws(SamplingParams(seed=1234, **p))
    c = _draws(SamplingParams(seed=4321, **p))
    assert a == b
    assert a != c


def test_seed_none_is_recorded_and_replayable():
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    s = Sampler(SamplingParams(seed=None, **p))
    assert isinstance(s.seed, int) and s.seed >= 0
    first = [s.sample(_logits(i), []) for i in range(20)]
    assert first == _draws(SamplingParams(seed=s.seed, **p), n=20)


def test_logits_not_modified():
    x = _logits()
    before = x.copy()
    Sampler(SamplingParams(seed=0, repetition_penalty=1.5)).sample(x, history=[int(np.argmax(x))])
    assert np.array_equal(x, before)


# --- greedy and truncation -----------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties():
    x = np.zeros(10, dtype=np.float32)
    x[[3, 7]] = 5.0
    assert Sampler(SamplingParams(temperature=0.0)).sample(x, []) == 3
    for i in range(20):
        lg = _logits(i)
        assert Sampler(SamplingParams(temperature=0.0)).sample(lg, []) == int(np.argmax(lg))


def test_top_k_1_and_tiny_top_p_equal_greedy():
    for i in range(30):
        lg = _logits(i)
        want = int(np.argmax(lg))
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=i)).sample(lg, []) == want
        assert Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1e-6, min_p=0.0, seed=i)).sample(lg, []) == want


def test_top_k_only_draws_from_k_best():
    lg = _logits(3)
    best5 = set(np.argsort(-lg)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, top_p=1.0, min_p=0.0, seed=7))
    seen = {s.sample(lg, []) for _ in range(500)}
    assert seen <= best5 and len(seen) == 5


def test_min_p_filtering():
    # probabilities 0.5, 0.25, 0.15, 0.06, 0.04; min_p=0.1 keeps p >= 0.05 -> first four
    probs = np.array([0.5, 0.25, 0.15, 0.06, 0.04])
    lg = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=3))
    seen = {s.sample(lg, []) for _ in range(3000)}
    assert seen == {0, 1, 2, 3}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.4, seed=3))
    assert {s.sample(lg, []) for _ in range(1000)} == {0, 1}  # p >= 0.2


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    lg = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=5))
    assert {s.sample(lg, []) for _ in range(2000)} == {0, 1}  # 0.5 + 0.3 >= 0.8
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0, seed=5))
    assert {s.sample(lg, []) for _ in range(2000)} == {0, 1, 2}


def test_repetition_penalty():
    lg = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler(SamplingParams(temperature=0.0)).sample(lg, [0]) == 0
    assert Sampler(greedy).sample(lg, [0]) == 1  # 2.0 / 1.5 < 1.9
    assert Sampler(greedy).sample(lg, [0, 0, 0]) == 1  # counted once, not per occurrence
    # negative logits are multiplied (pushed further down)
    lg2 = np.array([-1.0, -1.2, -5.0], dtype=np.float32)
    assert Sampler(greedy).sample(lg2, [0]) == 1  # -1.5 < -1.2
    # only the last REPETITION_WINDOW tokens count
    old = [0] + [3] * REPETITION_WINDOW
    assert Sampler(greedy).sample(lg, old) == 0
    # penalty < 1 encourages repeats
    assert Sampler(SamplingParams(temperature=0.0, repetition_penalty=0.5)).sample(lg, [1]) == 1


def test_temperature_1_matches_softmax():
    lg = np.array([1.0, 0.5, 0.0, -0.5, -1.0, -2.0], dtype=np.float32)
    want = np.exp(lg) / np.exp(lg).sum()
    n = 20000
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2024))
    counts = np.bincount([s.sample(lg, []) for _ in range(n)], minlength=len(lg))
    expected = want * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 dof: p ~ 0.001
    # temperature 0.5 sharpens like softmax(2 * logits)
    s = Sampler(SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=2025))
    counts = np.bincount([s.sample(lg, []) for _ in range(n)], minlength=len(lg))
    want2 = np.exp(2 * lg) / np.exp(2 * lg).sum()
    chi2 = float(((counts - want2 * n) ** 2 / (want2 * n)).sum())
    assert chi2 < 20.5


def test_large_vocab_sampling_is_fast():
    import time

    lg = _logits(0, 128_256)
    s = Sampler(SamplingParams(seed=0))
    t0 = time.perf_counter()
    for _ in range(20):
        s.sample(lg, list(range(64)))
    assert (time.perf_counter() - t0) / 20 < 0.05


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_topk():
    lg = np.array([0.0, 2.0, 2.0, 1.0, -3.0], dtype=np.float32)
    top = logprobs_topk(lg, 3)
    assert [i for i, _ in top] == [1, 2, 3]  # tie 1/2 -> lower id first
    log_z = math.log(np.exp(lg.astype(np.float64)).sum())
    for i, lp in top:
        assert lp == pytest.approx(float(lg[i]) - log_z, abs=1e-9)
    assert len(logprobs_topk(lg, 100)) == 5
    assert logprobs_topk(lg, 0) == []
    big = _logits(1, 50_000)
    ids = [i for i, _ in logprobs_topk(big, 10)]
    assert ids == np.argsort(-big, kind="stable")[:10].tolist()


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 10.0),
        ("seed", -1),
        ("seed", "42"),
        ("stop", "END"),
        ("stop", ["ok", ""]),
        ("stop", [1]),
    ],
)
def test_validation_names_the_field(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(NtxError) as err:
        p.validate()
    msg = str(err.value)
    assert field in msg and "\n" not in msg
    with pytest.raises(NtxError):
        Sampler(p)


def test_defaults_are_valid():
    assert SamplingParams().validate().temperature == 0.8
    SamplingParams(temperature=0, top_k=0, top_p=1, min_p=0, seed=2**64 - 1, stop=["a"]).validate()


# --- stop strings --------------------------------------------------------------------------------


def _stream(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out, stopped = [], False
    for c in chunks:
        emit, stopped = matcher.push(c)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def test_stop_matcher_across_chunks():
    m = StopMatcher(["</answer>"])
    assert m.push("The result is 4<") == ("The result is 4", False)  # "<" held back
    assert m.push("/ans") == ("", False)
    assert m.push("wer> trailing") == ("", True)
    assert m.matched == "</answer>"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_false_start_is_released():
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ART ok") == ("START ok", False)
    assert m.flush() == ""
    m = StopMatcher(["STOP"])
    assert m.push("abc S") == ("abc ", False)
    assert m.flush() == "S"  # end of generation: the held tail is real text


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7])
def test_stop_matcher_any_chunking(split):
    text = "alpha beta\n\nUser: gamma"
    chunks = [text[i : i + split] for i in range(0, len(text), split)]
    assert _stream(StopMatcher(["\n\nUser:", "zzz"]), chunks) == ("alpha beta", True)
    assert _stream(StopMatcher(["nope"]), chunks) == (text, False)
    assert _stream(StopMatcher([]), chunks) == (text, False)


def test_stop_matcher_earliest_match_wins():
    m = StopMatcher(["cde", "b"])
    assert m.push("abcdef") == ("a", True)
    assert m.matched == "b"
    m = StopMatcher(["abc", "bc"])
    assert m.push("xab") == ("x", False)
    assert m.push("c") == ("", True) and m.matched == "abc"


# --- truncation fast paths agree with the plain full-sort chain ---------------------------------


def _reference_truncate(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """llama.cpp's chain the slow way: full sort, top-k, softmax + top-p, min-p."""
    order = np.lexsort((np.arange(len(x)), -x))
    if 0 < top_k < len(x):
        order = order[:top_k]
    vals = x[order].astype(np.float64)
    probs = np.exp(vals - vals.max())
    probs /= probs.sum()
    if top_p < 1.0:
        cum, keep = 0.0, len(order)
        for i, pr in enumerate(probs):
            cum += pr
            if cum >= top_p:
                keep = i + 1
                break
        order, probs = order[:keep], probs[:keep]
    if min_p > 0.0:
        order = order[probs >= min_p * probs[0]]
    return set(order.tolist())


@pytest.mark.parametrize("top_k", [0, 1, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.999999])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_truncation_matches_reference(top_k, top_p, min_p):
    from ntx.daemons.compute.sampler import _truncate

    for seed in range(3):
        x = np.random.default_rng(seed).normal(0.0, 1.5 + seed, 5000)  # flat enough to need >1024 ids
        got = set(_truncate(x, top_k, top_p, min_p).tolist())
        assert got == _reference_truncate(x, top_k, top_p, min_p)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.5, top_k=256, top_p=0.5, min_p=0.2),
    dict(temperature=0.8, top_k=0, top_p=0.9),  # no top-k bound: the whole row travels
    dict(temperature=0.8, top_k=40, repetition_penalty=1.3),  # penalty first: the whole row
])
@pytest.mark.parametrize("logprobs", [0, 7])
@pytest.mark.parametrize("rank", [1, 8])
def test_sampling_from_picked_candidates_equals_sampling_from_the_whole_row(params, logprobs, rank):
    """What a GPU backend sends back (``Sampler.pick``: the top-k ids and values, or the whole row
    when needed) must give the same tokens as the full logits, draw for draw, seed for seed; a
    drafter's ``rank`` widens greedy's pick only, and changes no draw."""
    from ntx.daemons.compute.backend import pick_on_host

    n_vocab = 5000
    full = Sampler(SamplingParams(seed=11, **params))
    picked = Sampler(SamplingParams(seed=11, **params))
    pick = picked.pick(n_vocab, logprobs, rank)
    assert (pick.k == 0) == (params.get("top_k") == 0 or params.get("repetition_penalty", 1.0) != 1.0)
    if params["temperature"] == 0:
        assert pick.k == max(rank, logprobs, 1)
    elif pick.k:
        assert pick.k == max(params["top_k"], logprobs)  # sampling's candidates are its own
    history = [3, 17, 17, 400]
    for i in range(60):
        lg = _logits(100 + i, n_vocab)
        lg[[5, 9]] = lg.max()  # a tie at the top: the lower id wins everywhere
        (pk,) = pick_on_host(lg[None, :], [pick])
        assert full.sample(lg, history) == picked.sample_picked(pk, history)
        if pick.k and logprobs:
            ref = logprobs_topk(lg, logprobs)
            got = [(int(i), float(v - pk.lse)) for i, v in zip(pk.ids[:logprobs], pk.vals[:logprobs])]
            assert [i for i, _ in got] == [i for i, _ in ref]
            np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=0, atol=1e-9)
