"""Drafting without a draft model (daemons/compute/lookup.py): prompt lookup over a sequence's
own tokens, the instance's recent sequences, trees of several continuations, merged with a model
drafter's tree; on the real SmolLM2 the greedy output is the plain engine's token for token and
drafts quoted from the prompt are accepted."""

from __future__ import annotations

import pytest

from ntx.ctl.local import LocalEngine
from ntx.daemons.compute.factory import build_engine
from ntx.daemons.compute.lookup import (CombinedDrafter, LookupDrafter, RecentText, tree_of_paths,
                                        tree_paths)
from ntx.daemons.compute.sampler import SamplingParams
from ntx.daemons.compute.speculation import DraftRequest, Drafter, DraftTree
from ntx.shared.config import EngineOptions
from ntx.shared.errors import ConfigError
from ntx.shared.messages import EngineRequest


def req(tokens, depth=4, width=1, seq_id=0) -> DraftRequest:
    return DraftRequest(seq_id, list(tokens), depth, width, 1000)


def test_prompt_lookup_proposes_what_followed_the_suffix_last_time():
    d = LookupDrafter("ngram")
    #            the suffix (7, 8, 9) occurred at 2..4, followed by 1, 2, 3, 4
    tokens = [5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 7, 8, 9]
    assert d.propose([req(tokens)])[0] == DraftTree.chain([1, 2, 3, 4])
    assert d.depth_s == 0.0
    # the longest suffix wins: (3, 7, 8, 9) is new, (7, 8, 9) is not; a deeper request gets more
    assert d.propose([req(tokens + [1, 2], depth=6)])[0].tokens == [3, 4, 0, 0, 7, 8]
    # nothing seen before: no draft; a lone token is not looked up
    assert len(d.propose([req([1, 2, 3, 4, 5, 6], seq_id=1)])[0]) == 0
    assert len(d.propose([req([1, 9, 1], seq_id=2)])[0]) == 0


def test_the_query_itself_is_never_its_own_match():
    d = LookupDrafter("ngram")
    assert len(d.propose([req([4, 5, 6, 7])])[0]) == 0
    # the sequence grows one token: (6, 7) seen ending at 3 is the query's own; (7, 6) is new
    assert len(d.propose([req([4, 5, 6, 7, 6])])[0]) == 0
    # (6, 7) ended at 3, followed by 6; then (7, 6) by 7, and so on: the walk looks again after each token
    assert d.propose([req([4, 5, 6, 7, 6, 7])])[0].tokens == [6, 7, 6, 7]


def test_the_most_frequent_continuation_wins_then_the_earliest():
    d = LookupDrafter("ngram")
    # (1, 2) was followed by 5 once, first, then by 7 twice: 7; then (1, 2, 7) by 4 and 6 once each: 4
    assert d.propose([req([1, 2, 5, 3, 1, 2, 7, 4, 1, 2, 7, 6, 1, 2], depth=2)])[0].tokens == [7, 4]
    # as often: the earliest (the source, not the copy made of it since)
    tokens = [1, 2, 5, 3, 1, 2, 7, 4, 1, 2]
    assert d.propose([req(tokens, depth=2, seq_id=1)])[0].tokens == [5, 3]
    # a wider tree holds the others, in the same order
    assert tree_paths(d.propose([req(tokens, depth=2, width=2, seq_id=2)])[0]) == [[5, 3], [7, 4]]


def test_each_drafted_token_is_chosen_again():
    """The walk does not copy one occurrence: after each drafted token it asks again what most
    often followed the longest n-gram ending the draft (here (3, 4, 5, 6, 7): 11 twice, 10 once)."""
    d = LookupDrafter("ngram")
    tokens = [1, 2, 3, 4, 5, 6, 7, 10, 0, 3, 4, 5, 6, 7, 11, 0, 3, 4, 5, 6, 7, 11, 0, 1, 2]
    assert d.propose([req(tokens, depth=7)])[0].tokens == [3, 4, 5, 6, 7, 11, 0]


def test_a_tree_holds_distinct_continuations_merged_where_they_share_a_prefix():
    d = LookupDrafter("ngram")
    # (2, 3) last followed by 9 9; (1, 2, 3) by 4 4; the longest match first, then the shorter one's
    tokens = [1, 2, 3, 4, 4, 0, 2, 3, 9, 9, 0, 1, 2, 3]
    tree = d.propose([req(tokens, depth=2, width=2)])[0]
    assert tree_paths(tree) == [[4, 4], [9, 9]] and tree.parents == [-1, 0, -1, 2]
    merged = tree_of_paths([[1, 2, 3], [1, 2, 5], [7]], max_nodes=10)
    assert merged.tokens == [1, 2, 3, 5, 7] and merged.parents == [-1, 0, 1, 1, -1]
    cut = tree_of_paths([[1, 2, 3], [4, 5]], max_nodes=4)
    assert cut.tokens == [1, 2, 3, 4] and cut.parents == [-1, 0, 1, -1]


def test_suffix_drafting_finds_text_of_earlier_requests_within_its_bound():
    recent = RecentText(max_tokens=12)
    d = LookupDrafter("suffix", recent)
    d.propose([req([10, 11, 12, 13, 14, 15, 16], seq_id=1)])
    d.forget(1)  # the ended sequence joins the recent text
    assert d.propose([req([0, 12, 13], seq_id=2)])[0].tokens == [14, 15, 16]
    # a sequence that ended without a recent-text index (ngram) looks only at itself
    assert len(LookupDrafter("ngram").propose([req([0, 12, 13], seq_id=2)])[0]) == 0
    # older sequences leave the recent text once it holds more than its bound
    d.forget(2)
    recent.add(list(range(100, 110)))
    assert recent.n_tokens <= 12 and len(d.propose([req([0, 12, 13], seq_id=3)])[0]) == 0


def test_suffix_drafting_walks_only_the_best_of_many_recent_matches():
    recent = RecentText()
    for last in (3, 4, 5, 6):  # four earlier requests say 1 2, then each another token
        recent.add([1, 2, last, 0])
    d = LookupDrafter("suffix", recent)
    # the newest two, as many as the width: nothing of the older ones is walked
    assert tree_paths(d.propose([req([9, 1, 2], depth=2, width=2)])[0]) == [[6, 0], [5, 0]]
    # a longer match in an older request comes before the newer ones' shorter matches
    recent.add([7, 8, 9, 1, 2, 3, 7])
    recent.add([1, 2, 4, 4])
    assert tree_paths(d.propose([req([8, 9, 1, 2], depth=2, width=1, seq_id=1)])[0]) == [[3, 7]]


def test_a_weak_request_also_follows_a_match_of_the_last_token_alone():
    """Where a verify pass is free (``DraftRequest.weak``) the last token alone is looked up in
    the sequence's own text; elsewhere it is not. A longer match still comes first, and a walk
    goes on by one-token matches only in a weak request."""
    d = LookupDrafter("ngram")
    tokens = [5, 6, 7, 1, 2, 3, 9, 7]  # (9, 7) is new; 7 alone was followed by 1, 2, 3
    assert len(d.propose([req(tokens)])[0]) == 0
    weak = DraftRequest(0, tokens, 4, 1, 1000, weak=True)
    assert d.propose([weak])[0] == DraftTree.chain([1, 2, 3, 9])
    # a two-token match wins over the one-token one: (6, 7) was followed by 1; (3, 9) was not seen
    # again, so the strong walk stops where the weak one goes on by 9 -> 7 -> 1
    tokens2 = [5, 6, 7, 1, 8, 3, 9, 4, 6, 7]
    assert d.propose([req(tokens2, seq_id=1)])[0] == DraftTree.chain([1, 8, 3, 9])
    assert d.propose([DraftRequest(1, tokens2, 6, 1, 1000, weak=True)])[0] == DraftTree.chain([1, 8, 3, 9, 4, 6])
    # a model drafter's tree goes before a one-token guess: combined, the lookup drafts strong only
    class NoGuess(Drafter):  # a model drafter with nothing to propose, to see the lookup's part alone
        def propose(self, requests):
            return [DraftTree() for _ in requests]

        def forget(self, seq_id):
            pass

    combined = CombinedDrafter(NoGuess(), LookupDrafter("ngram"))
    assert len(combined.propose([DraftRequest(2, tokens, 4, 1, 1000, weak=True)])[0]) == 0


def test_weak_drafts_are_tried_only_where_a_verify_pass_costs_what_a_plain_one_does():
    from ntx.daemons.compute.speculation import TreeShape

    shape = TreeShape(budget=8, width=1)
    assert not shape.weak_pays(9)  # nothing measured: not yet
    shape.observe_times(plain_s=0.341)
    shape.observe_times(verify_s=0.3404, rows=9)  # the 70B at 24 GiB, every streamed layer on the link
    assert shape.weak_pays(9) and shape.weak_pays(5)
    cpu = TreeShape(budget=8, width=1)
    cpu.observe_times(plain_s=0.010)
    cpu.observe_times(verify_s=0.013, rows=9)  # rows cost arithmetic: 1.3x
    assert not cpu.weak_pays(9)
    assert TreeShape(budget=8, width=1, fixed=True).weak_pays(9)  # fixed: as where verification is free


def test_the_tally_keeps_one_token_matches_apart():
    from ntx.shared.messages import SpecCounts

    counts = SpecCounts()
    counts.add(4, 3)
    assert "weak_verify_passes" not in counts.report()  # none yet: the reply is as it was
    counts.add(4, 1, weak=True)
    assert counts.report() == {"verify_passes": 2, "drafted": 8, "accepted": 4, "accepted_per_pass": 2.0,
                               "acceptance_rate": 0.5, "weak_verify_passes": 1, "weak_drafted": 4, "weak_accepted": 1}
    d = LookupDrafter("ngram")
    tokens = [5, 6, 7, 1, 2, 3, 9, 7]
    assert d.propose([DraftRequest(0, tokens, 4, 1, 1000, weak=True)])[0].weak
    assert not d.propose([req([5, 6, 7, 1, 5, 6], seq_id=1)])[0].weak  # (5, 6) matched


def test_the_acceptance_script_has_nine_texts_of_three_kinds_and_pools_them():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "draft_acceptance.py"
    spec = importlib.util.spec_from_file_location("draft_acceptance", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    kinds = [kind for kind, _ in script.tasks().values()]
    assert [kinds.count(k) for k in ("summarise", "edit", "chat")] == [6, 2, 1]
    row = dict(verify_passes=4, accepted=6, decode_passes=10, plain_decode_passes=20, generated=21, identical=True)
    pool = script.pooled([row, dict(row, verify_passes=0, accepted=0, decode_passes=20, generated=21)])
    # 6 accepted over 4 verify passes; 40 tokens after the first over 30 decode passes
    assert pool["acceptance_length"] == 1.5 and pool["tokens_per_decode_pass"] == 1.333 and pool["texts"] == 2
    # one-token matches' passes apart: 1 of the 4 verify passes, 0 accepted -> 6 over the other 3
    pool = script.pooled([dict(row, weak_verify_passes=1, weak_accepted=0)])
    assert pool["acceptance_length"] == 1.5 and pool["strong_verify_passes"] == 3 and pool["strong_acceptance_length"] == 2.0
    # --trace-out: each proposal against the greedy tokens, as (drafted, accepted)
    d = LookupDrafter("ngram")
    tracer = script.PassTrace(d)
    full = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2]
    d.propose([req(full[:6], depth=3)])  # (1, 2) -> 3 4 1: the text goes on 3 9: 1 accepted
    d.propose([req(full[:7], depth=3)])  # (1, 2, 3) -> 4 1 2: none
    d.propose([req([5, 6], depth=3, seq_id=1)])  # nothing seen: nothing drafted
    assert tracer.trace(full) == [[3, 1], [3, 0], [0, 0]] and tracer.calls == []
    # a tree: its nodes, and the longest of its paths that the tokens follow
    d = LookupDrafter("ngram")
    tracer = script.PassTrace(d)
    d.propose([req([1, 2, 7, 1, 2, 3, 1, 2], depth=2, width=2)])  # (1, 2) -> 7 1 | 3 1: 4 nodes
    assert tracer.trace([1, 2, 7, 1, 2, 3, 1, 2, 3, 1]) == [[4, 2]]
    # a request that ended on an end-of-generation token (not among its tokens): a drafted one
    # right after its last token was accepted too, as the engine counts it
    d = LookupDrafter("ngram")
    tracer = script.PassTrace(d)
    d.propose([req([1, 2, 0, 5, 1, 2], depth=3)])  # (1, 2) -> 0 5 1: the text ends 0, then token 5 ends it
    assert tracer.trace([1, 2, 0, 5, 1, 2, 0], frozenset({5})) == [[3, 2]]
    d.propose([req([1, 2, 0, 5, 1, 2], depth=3)])
    assert tracer.trace([1, 2, 0, 5, 1, 2, 0]) == [[3, 1]]  # not ended on 5: only the 0


def test_a_bad_draft_name_is_one_clear_line():
    with pytest.raises(ConfigError, match="--draft ngrams: choose ngram, suffix or lookahead"):
        EngineOptions(draft="ngrams").validate()


@pytest.fixture(scope="module")
def quoting(smollm2_path):
    """Prompts that quote: a passage, then the start of the same passage again."""
    plain = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(ctx=512, max_batch=2)))
    text = ("The quick brown fox jumps over the lazy dog near the river bank, while the farmer "
            "watches from the old wooden fence and the sun sets behind the hills.")
    ids = plain.tokenizer.encode(f"Repeat the text.\nText: {text}\nRepeat: {text[:40]}")
    other = plain.tokenizer.encode("Once upon a time, in a small village, there lived")
    return plain, [ids, other]


def _greedy(eng: LocalEngine, prompts: list[list[int]], n: int) -> dict[str, dict]:
    for i, p in enumerate(prompts):
        eng.submit(EngineRequest(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n)))
    done = {}
    while eng.has_work:
        for ev in eng.step():
            assert ev["type"] != "error", ev
            if ev["type"] == "done":
                done[ev["id"]] = ev
    return done


@pytest.mark.parametrize("options", [dict(draft="ngram", draft_tokens=8, draft_width=1),
                                     # fixed, as where a verify pass is free: one-token matches drafted too
                                     dict(draft="ngram", draft_tokens=8, draft_width=1, draft_fixed=True),
                                     dict(draft="suffix", draft_tokens=8),
                                     # a self-draft depth costs about a plain pass on the CPU and a 10-row
                                     # verify pass 2.7x one, so the tree shape rightly stops drafting after
                                     # its first rejections: the combined tree's acceptance is tested fixed
                                     dict(draft="ngram", self_draft=list(range(0, 20)), draft_tokens=6, draft_fixed=True)])
def test_greedy_output_is_the_plain_engines_and_quoted_text_is_accepted(smollm2_path, quoting, options):
    plain, prompts = quoting
    want = _greedy(plain, prompts, 24)
    eng = LocalEngine(build_engine(smollm2_path, "cpu", EngineOptions(ctx=512, max_batch=2, **options)))
    if "self_draft" in options:
        assert isinstance(eng.core.drafter, CombinedDrafter)
    got = _greedy(eng, prompts, 24)
    assert [got[k]["tokens"] for k in sorted(got)] == [want[k]["tokens"] for k in sorted(want)]
    spec = got["r0"]["speculation"]
    assert spec["accepted"] >= 5, (spec, eng.core.shape.__dict__)  # the quoted passage: several tokens in a pass
    if options.get("draft_fixed") and "self_draft" not in options:  # fixed: one-token matches drafted too
        assert eng.core.spec.weak_passes > 0 and eng.core.spec.report()["weak_verify_passes"] > 0
