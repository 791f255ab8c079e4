"""Lookahead drafting (daemons/compute/lookahead.py): the window of Jacobi guesses as a draft
tree, the n-gram pool it fills from the verify pass's rows, and the engine around it on the real
SmolLM2 (greedy output unchanged, the guesses accepted)."""

from __future__ import annotations

import random

import pytest

from ntx.ctl.local import LocalEngine
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.lookahead import (LEVELS, POOL_PER_KEY, RANK_HIT, RECYCLE_K, LookaheadDrafter, NgramPool,
                                             RecycledTokens, node_paths, recycled_shape, window_shape)
from ntx.daemons.compute.lookup import CombinedDrafter, LookupDrafter, tree_paths
from ntx.daemons.compute.speculation import DraftRequest
from ntx.shared.config import EngineOptions

try:
    from .test_lookup_drafter import _greedy
except ImportError:  # tests/ is not a package
    from test_lookup_drafter import _greedy


def req(tokens, depth=8, width=1, seq_id=0, rows_free=True) -> DraftRequest:
    return DraftRequest(seq_id, list(tokens), depth, width, 10_000, rows_free=rows_free)


def ranked(top1) -> list[list[int]]:
    """Rows that each rank one token (the top-1; none where -1), as ``verified`` takes them."""
    return [[t] if t >= 0 else [] for t in top1]


def depth_of(tree, node: int) -> int:
    d = 0
    while node != -1:
        node, d = tree.parents[node], d + 1
    return d


def test_the_window_takes_half_the_budget_within_the_depth():
    assert window_shape(32, 64) == (LEVELS, 10)  # 64 nodes' half: 3 levels of 10
    assert window_shape(32, 5) == (3, 3)  # its deepest path, 3 + 3 - 1, within depth 5
    assert window_shape(4, 8) == (2, 2)  # too small for 3 levels of 2
    assert window_shape(3, 8) == (0, 0) and window_shape(40, 2) == (0, 0)  # no window at all


def test_the_window_is_jacobi_iteration_as_a_tree_and_fills_the_pool():
    d = LookaheadDrafter()
    text = [10, 11, 12, 13, 14, 15]  # no n-gram repeats: the lookup drafts nothing
    # 8 nodes, 8 deep: a window of 4 nodes, 2 levels of 2 columns; at first only level 0
    t1 = d.propose([req(text)])[0]
    w = d.windows[0]
    a, b = w.levels[0]
    assert len(w.levels) == 1 and all(tok in text for tok in (a, b))
    assert (t1.tokens, t1.parents) == ([a, b], [-1, 0])  # column 1's path goes through column 0
    # the pass: row 0 is the last token, row i + 1 node i; each column's top predicts one position on
    d.verified(0, t1, ranked([15, 20, 21]), [])
    assert w.levels == [[a, b], [20, 21]] and not len(d.pool)
    t2 = d.propose([req(text + [30])])[0]
    # level 1's guess at column j hangs under level 0's column j: paths (a, 20) and (a, b, 21)
    assert sorted(tree_paths(t2)) == sorted([[a, 20], [a, b, 21]])
    rows = {p: i + 1 for i, p in enumerate(node_paths(t2))}
    top1 = [0] * (len(t2) + 1)
    top1[rows[(a, 20)]], top1[rows[(a, b, 21)]] = 40, 41
    d.verified(0, t2, ranked(top1), [])
    # full: each column's guesses and what its top predicted are an n-gram, keyed by its first token
    assert dict(d.pool.by_first) == ({a: [(20, 40)], b: [(21, 41)]} if a != b else {a: [(21, 41), (20, 40)]})
    assert w.levels == [[20, 21], [40, 41]]  # the oldest level gone, the predictions on top
    # at the n-gram's first token, its rest is drafted before the window
    t3 = d.propose([req(text + [30, b])])[0]
    assert tree_paths(t3)[0] == [21, 41]
    assert d.report()["window_passes"] == 2


def test_the_pool_keeps_the_newest_n_grams_of_the_tokens_added_last():
    pool = NgramPool(max_keys=2)
    for i in range(POOL_PER_KEY + 2):
        pool.add([1, 10 + i, 20 + i])
    pool.add([1, 10, 20])  # seen again: the newest once more, not twice
    assert pool.after(1) == [(10, 20)] + [(10 + i, 20 + i) for i in range(POOL_PER_KEY + 1, 1, -1)][: POOL_PER_KEY - 1]
    pool.add([2, 5, 6])
    pool.add([3, 7, 8])  # a third first token: the least recently added (1) goes
    assert len(pool) == 2 and pool.after(1) == [] and pool.after(3) == [(7, 8)]


def test_a_second_sequence_drafts_what_the_first_one_guessed():
    d = LookaheadDrafter()
    d.pool.add([50, 51, 52, 53])
    tree = d.propose([req([40, 41, 42, 50], seq_id=7)])[0]
    assert tree_paths(tree)[0] == [51, 52, 53]


def test_a_strong_match_keeps_its_depth_and_the_window_gets_what_is_left():
    d = LookaheadDrafter()
    quote = list(range(100, 130))
    text = quote + [7] + quote[:3]  # a quote restarted: (100, 101, 102) matched
    walk = (quote + [7])[3:] + quote  # round the quote again
    tree = d.propose([req(text, depth=32)])[0]  # the walk fills all 32 nodes: no window
    assert tree_paths(tree) == [walk[:32]] and d.windows.get(0) is None
    tree = d.propose([req(text, depth=16, width=2)])[0]  # 32 nodes, 16 of them the walk's
    assert tree_paths(tree)[0] == walk[:16] and len(tree) <= 32
    assert len(d.windows[0].proposed) == 5  # the 16 left: 3 levels of 5 columns


def test_trees_stay_within_the_budget_and_depth_while_the_pool_grows():
    rng = random.Random(5)
    d = LookaheadDrafter()
    text = [rng.randrange(50) for _ in range(40)]
    for step in range(60):
        depth, width = rng.choice([(4, 1), (8, 1), (16, 1), (32, 1), (8, 2), (16, 4), (64, 1)])
        tree = d.propose([req(text, depth, width)])[0]
        assert len(tree) <= depth * width
        assert all(p < i for i, p in enumerate(tree.parents))
        assert all(depth_of(tree, i) <= depth for i in range(len(tree)))
        assert len({(p, t) for p, t in zip(tree.parents, tree.tokens)}) == len(tree)  # siblings distinct
        rows = [rng.sample(range(50), rng.randrange(1, RECYCLE_K + 1)) for _ in range(len(tree) + 1)]
        d.verified(0, tree, rows, [])
        text += [rows[0][0]] + [rng.randrange(50) for _ in range(rng.randrange(3))]
    assert len(d.pool) and d.window_passes > 20 and len(d.recycled) > 40
    d.forget(0)
    assert 0 not in d.windows and 0 not in d.own and len(d.pool)  # the instance's pool stays


def test_where_rows_cost_it_drafts_what_the_prompt_lookup_does():
    text = [1, 2, 3, 4, 5, 1, 2]
    la, lk = LookaheadDrafter(), LookupDrafter("ngram")
    assert la.propose([req(text, rows_free=False)]) == lk.propose([req(text, rows_free=False)])
    assert la.propose([req([10, 11, 12], rows_free=False)])[0].tokens == []  # no match: a plain pass
    assert not la.windows


def test_a_bad_row_leaves_the_window_as_it_was():
    d = LookaheadDrafter()
    text = [10, 11, 12, 13, 14, 15]
    t1 = d.propose([req(text)])[0]
    levels = [list(lv) for lv in d.windows[0].levels]
    d.verified(0, t1, ranked([15, -1, -1]), [])  # the rows had no finite logits
    assert d.windows[0].levels == levels
    d.verified(0, t1, ranked([15, 1, 2]), [])  # nothing awaits a pass any more: a second call learns nothing
    assert d.windows[0].levels == levels


def test_recycled_tokens_keep_the_newest_ranking_of_the_tokens_learnt_last():
    rec = RecycledTokens(max_keys=2)
    rec.learn(1, list(range(10, 10 + RECYCLE_K + 3)))
    assert rec.after(1) == tuple(range(10, 10 + RECYCLE_K))  # RECYCLE_K of them kept
    rec.learn(2, [5])
    rec.learn(1, [7, 8])  # ranked again: the newest ranking replaces the old one
    assert rec.after(1) == (7, 8) and rec.after(9) == ()
    rec.learn(3, [6])  # a third token: the least recently learnt (2) goes
    assert len(rec) == 2 and rec.after(2) == () and rec.after(3) == (6,)


def test_the_recycled_shape_takes_the_likeliest_rank_paths_parents_first():
    assert recycled_shape(4, 8) == ((0,), (0, 0), (1,), (0, 0, 0))  # 0.489, 0.239, 0.228, 0.117
    assert recycled_shape(3, 1) == ((0,), (1,), (2,))  # one deep: the ranks side by side
    shape = recycled_shape(200, 6)
    assert len(shape) == len(set(shape)) == 200 and max(map(len, shape)) <= 6
    seen = set()
    for ranks in shape:
        assert len(ranks) == 1 or ranks[:-1] in seen  # its parent came before it
        seen.add(ranks)
    p = [1.0] * len(shape)
    for i, ranks in enumerate(shape):
        for r in ranks:
            p[i] *= RANK_HIT[r]
    assert p == sorted(p, reverse=True)


def test_a_verify_pass_recycles_every_rows_ranking_the_accepted_paths_last():
    d = LookaheadDrafter()
    text = [10, 11, 12, 13, 14, 15]  # nothing to look up
    t1 = d.propose([req(text)])[0]  # the window alone: two columns (a, b), a chain
    a, b = t1.tokens
    # row 0 (15) ranks 16, 17; node a's row 60, 61; node b's row 70; a was accepted
    d.verified(0, t1, [[16, 17], [60, 61], [70]], [0])
    if a != b:
        assert d.recycled.after(a) == (60, 61) and d.recycled.after(b) == (70,)
    assert d.recycled.after(15) == (16, 17) and d.report()["recycled_tokens"] == len({15, a, b})
    # a rejected row and an accepted one of the same token: the accepted path's ranking stays
    t2 = d.propose([req(text + [a])])[0]
    rows = [[1]] * (len(t2) + 1)
    rows[0] = [99]
    for i, tok in enumerate(t2.tokens):
        if tok == a:
            rows[i + 1] = [98]
    d.verified(0, t2, rows, [])
    assert d.recycled.after(a) == (99,)
    # the next tree grows from the last token through what was ranked after it
    d.recycled.learn(40, [41, 42])
    d.recycled.learn(41, [43])
    tree = d.propose([req([20, 21, 22, 40], seq_id=1)])[0]
    paths = tree_paths(tree)
    assert [41, 43] in paths and [42] in paths, paths


def test_recycled_nodes_take_only_what_the_rest_of_the_tree_leaves():
    d = LookaheadDrafter()
    quote = list(range(100, 130))
    text = quote + [7] + quote[:3]
    for t in range(90, 140):
        d.recycled.learn(t, [t + 1, t + 2, t + 3])
    tree = d.propose([req(text, depth=32)])[0]  # the quote's walk fills all 32 nodes
    assert tree_paths(tree) == [((quote + [7])[3:] + quote)[:32]]
    tree = d.propose([req([1, 2, 90], depth=8, width=2)])[0]  # no match: the window, then recycled nodes
    assert len(tree) == 16 and [91, 92] in [p[:2] for p in tree_paths(tree)]
    assert d.propose([req([1, 2, 90], rows_free=False)])[0].tokens == []  # rows cost: none of it


# ---------------------------------------------------------------------------------------------
# In the engine, on the real SmolLM2


SUMMARY_PROMPT = ("The old harbour was built in 1820 to shelter fishing boats from the winter storms. "
                  "Over the following decades it grew into a busy port, with warehouses along the quay "
                  "and a lighthouse on the northern pier. Today the warehouses hold a museum, cafes and "
                  "a market, and the lighthouse still guides the few boats that fish from the town.\n"
                  "Summarise the text above in two sentences.")


@pytest.fixture(scope="module")
def engines(smollm2_path):
    plain = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(ctx=512, max_batch=2)))
    prompts = [plain.prompt_tokens(messages=[{"role": "user", "content": SUMMARY_PROMPT}]),
               plain.prompt_tokens(prompt="Once upon a time, in a small village, there lived", raw=True)]
    return plain, prompts


def test_greedy_output_is_the_plain_engines_and_the_guesses_are_accepted(smollm2_path, engines):
    """Two requests in one batch, every pass drafting 32 nodes (as where a verify pass is free):
    the same tokens as plain, and tokens accepted that only the pool or the window drafted."""
    plain, prompts = engines
    want = _greedy(plain, prompts, 48)
    eng = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(
        ctx=512, max_batch=2, draft="lookahead", draft_tokens=32, draft_width=1, draft_fixed=True)))
    got = _greedy(eng, prompts, 48)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
    d = eng.core.drafter
    assert isinstance(d, LookaheadDrafter) and d.window_passes > 10
    assert d.guessed_accepted > 0, d.report()
    assert not d.windows and len(d.pool)  # both requests ended: their windows went, the pool stays
    # greedy rows ranked RECYCLE_K tokens each for the recycled tokens (their picks widened)
    assert len(d.recycled) > 50 and max(map(len, d.recycled.by_token.values())) == RECYCLE_K
    assert not d.roots


def test_auto_shapes_time_one_window_then_keep_it_where_its_rows_cost(smollm2_path, engines):
    """On the CPU a pass of 17 rows costs more than a plain one: the first tree carries the
    window (nothing was timed yet), its pass measures what the rows cost, and from then on the
    lookahead drafts as the prompt lookup does. A text the lookup finds nothing in still finds out."""
    plain, prompts = engines
    eng = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(
        ctx=512, max_batch=2, draft="lookahead", draft_tokens=16, draft_width=1)))
    got = _greedy(eng, prompts[1:], 32)  # the story: nothing to quote
    assert got["r0"]["tokens"] == _greedy(plain, prompts[1:], 32)["r0"]["tokens"]
    d, shape = eng.core.drafter, eng.core.shape
    assert d.window_passes >= 1 and shape.verify_by_rows
    rows = max(shape.verify_by_rows)
    assert not shape.weak_pays(rows), (shape.verify_by_rows, shape.plain_s)  # the rows cost here
    assert d.window_passes <= 2, d.report()


def test_with_a_self_draft_the_window_rides_in_the_merged_tree(smollm2_path, engines):
    plain, prompts = engines
    want = _greedy(plain, prompts[:1], 24)
    eng = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(
        ctx=512, max_batch=2, draft="lookahead", self_draft=list(range(0, 20)), draft_tokens=16, draft_fixed=True)))
    d = eng.core.drafter
    assert isinstance(d, CombinedDrafter) and d.learns_from_rows
    got = _greedy(eng, prompts[:1], 24)
    assert got["r0"]["tokens"] == want["r0"]["tokens"]
    assert d.lookup.window_passes > 3  # the window's rows were found in the merged tree


def test_a_pipeline_drafts_with_lookahead_and_reports_it(smollm2_path, engines, tmp_path):
    """``ntxctl start --draft lookahead``: 20 of the 30 layers stream; greedy tokens equal the
    plain engine's; status names the drafter and counts what its guesses gave."""
    try:
        from .pipeline_util import running_pipeline
    except ImportError:
        from pipeline_util import running_pipeline
    plain, _ = engines
    prompt = "The history of the transistor begins"
    want = _greedy(plain, [plain.prompt_tokens(prompt=prompt, raw=True)], 16)["r0"]
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "10", "--draft", "lookahead",
                          "--draft-tokens", "16", "--ctx", "256", name="lookahead") as p:
        done = p.generate_greedy(prompt, max_tokens=16)
        assert done["tokens"] == want["tokens"]
        st = p.wait_status(lambda s: "window_passes" in (s.get("speculation") or {}), "the lookahead's counts in status")
        spec = st["speculation"]
        assert spec["drafter"] == "lookahead" and spec["draft_tokens"] == 16
        assert spec["guessed_accepted"] <= spec["accepted"]
