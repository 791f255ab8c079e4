"""The page bookkeeping of the paged KV cache (daemons/compute/kv_pages.py): allocation order,
exhaustion, reuse, fragmentation, chunks, shared prefixes, prefix matching, LRU eviction, the
counters, and a seeded random walk that checks the books and the pages' contents after every
operation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ntx.daemons.compute.kv_pages import (PAGE_TOKENS, KvPool, KvPoolExhausted, SeqPages, page_keys,
                                          pages_for_positions)

P = PAGE_TOKENS


def toks(n: int, start: int = 1000) -> list[int]:
    """n distinct token ids from ``start`` on."""
    return list(range(start, start + n))


def prefilled(pool: KvPool, prompt: list[int]) -> tuple[SeqPages, int]:
    """A sequence for ``prompt`` whose prompt K/V are written and committed."""
    seq, reused = pool.new_sequence(prompt)
    pool.commit(seq, prompt)
    return seq, reused


# ------------------------------------------------------------------------------ allocation
def test_allocation_takes_the_lowest_free_page_ids():
    pool = KvPool(chunk_pages=4, n_chunks=2)
    a, _ = pool.new_sequence(toks(3 * P))
    b, _ = pool.new_sequence(toks(2 * P, 5000))
    assert a.page_ids == (0, 1, 2) and b.page_ids == (3, 4)
    pool.release(a)
    c, _ = pool.new_sequence(toks(P, 9000), n_positions=2 * P + 1)
    assert c.page_ids == (0, 1, 2)  # the lowest ids again, in ascending order
    assert pool.grow(c, 4 * P)
    assert c.page_ids == (0, 1, 2, 5)
    pool.check()


def test_pages_for_positions_and_the_growth_arithmetic():
    assert [pages_for_positions(n) for n in (0, 1, P - 1, P, P + 1, 3 * P)] == [0, 1, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="n_positions"):
        pages_for_positions(-1)
    pool = KvPool(chunk_pages=8)
    seq, _ = pool.new_sequence([], n_positions=0)
    assert seq.n_pages == 0 and seq.pages_for(P + 1) == 2
    assert pool.grow(seq, P + 1) and seq.n_pages == 2 and seq.capacity_positions == 2 * P
    assert seq.pages_for(2 * P) == 0 and pool.grow(seq, 2 * P) and seq.n_pages == 2  # nothing new
    assert seq.pages_for(2 * P + 1) == 1


def test_exhaustion_is_all_or_nothing():
    pool = KvPool(chunk_pages=4)
    a, _ = pool.new_sequence(toks(2 * P))
    before = pool.stats()
    assert pool.can_fit(2 * P) and not pool.can_fit(2 * P + 1)
    assert not pool.grow(a, 5 * P)  # needs 3 more, 2 are free
    assert a.page_ids == (0, 1) and pool.stats() == before
    with pytest.raises(KvPoolExhausted) as err:
        pool.new_sequence(toks(3 * P, 7000))
    assert (err.value.needed_pages, err.value.available_pages, err.value.total_pages) == (3, 2, 4)
    assert "3 more pages (96 positions) needed, 2 free or evictable of 4" in str(err.value)
    assert "\n" not in str(err.value)
    assert pool.stats() == before  # no page taken, no lookup counted, no sequence left behind
    assert pool.grow(a, 4 * P) and a.page_ids == (0, 1, 2, 3)  # what was there is still there
    assert pool.stats().pages_free == 0
    pool.check()


def test_free_returns_every_page_and_they_are_reused():
    pool = KvPool(chunk_pages=4)
    a, _ = pool.new_sequence(toks(4 * P))
    assert pool.stats().pages_free == 0
    assert pool.release(a) is True
    assert a.released and a.n_pages == 0 and pool.stats().pages_free == 4 and pool.stats().sequences == 0
    assert pool.release(a) is False  # a second release (cancel after error) is harmless
    with pytest.raises(ValueError, match="was released"):
        a.ensure(P)
    b, _ = pool.new_sequence(toks(4 * P, 3000))
    assert sorted(b.page_ids) == [0, 1, 2, 3]
    pool.check()


def test_fragmentation_a_large_allocation_takes_free_pages_from_anywhere():
    pool = KvPool(chunk_pages=16, n_chunks=4)  # 64 pages
    rng = random.Random(7)
    seqs = []
    for i in range(32):  # 32 sequences of 1 or 2 pages, interleaved with growth
        s, _ = pool.new_sequence(toks(rng.randint(1, P), 10_000 * (i + 1)))
        seqs.append(s)
        if i % 3 == 0 and seqs[i // 2].n_pages < 2:
            assert pool.grow(seqs[i // 2], 2 * P)
    used = sum(s.n_pages for s in seqs)
    freed = sum(s.n_pages for s in seqs[::2])
    for s in seqs[::2]:  # every other sequence ends: free pages scattered over every chunk
        pool.release(s)
    free_ids = {p for p in range(pool.page_id_limit) if pool.page_state(p) == "free"}
    assert len({p // 16 for p in free_ids}) > 1
    n_free = pool.stats().pages_free
    assert n_free == 64 - used + freed == len(free_ids)
    big, _ = pool.new_sequence(toks(n_free * P - 5, 900_000))
    assert set(big.page_ids) == free_ids and list(big.page_ids) == sorted(free_ids)
    assert pool.stats().pages_free == 0 and not pool.can_fit(1)
    pool.check()


# ------------------------------------------------------------------------------ chunks
def test_chunks_grow_and_release():
    pool = KvPool(chunk_pages=4, n_chunks=1)
    assert (pool.n_chunks, pool.pages_total, pool.page_id_limit) == (1, 4, 4)
    assert pool.add_chunk() == 1 and pool.add_chunk() == 2
    assert (pool.n_chunks, pool.pages_total, pool.page_id_limit, pool.chunk_ids()) == (3, 12, 12, [0, 1, 2])
    a, _ = pool.new_sequence(toks(5 * P))  # pages 0..4: chunk 0 and one page of chunk 1
    assert pool.releasable_chunks() == [2]
    with pytest.raises(ValueError, match="chunk 1 still has 1 pages in use"):
        pool.release_chunk(1)
    with pytest.raises(ValueError, match="no chunk 7"):
        pool.release_chunk(7)
    assert pool.release_chunk(2) == 0
    assert (pool.n_chunks, pool.pages_total, pool.chunk_ids(), pool.page_id_limit) == (2, 8, [0, 1], 12)
    assert pool.page_state(9) == "absent"
    with pytest.raises(ValueError, match="no chunk 2"):
        pool.release_chunk(2)
    assert pool.grow(a, 8 * P)  # the rest of chunk 1; nothing of the released chunk 2
    assert a.page_ids == tuple(range(8))
    assert not pool.grow(a, 9 * P)
    pool.release(a)
    assert pool.releasable_chunks() == [1, 0]
    assert pool.add_chunk() == 2  # the released id is reused; its pages are free once, not twice
    b, _ = pool.new_sequence(toks(12 * P))
    assert sorted(b.page_ids) == list(range(12))
    pool.check()


def test_release_chunk_evicts_its_cached_pages():
    pool = KvPool(chunk_pages=2, n_chunks=3)
    filler, _ = pool.new_sequence(toks(2 * P, 1))  # chunk 0
    prompt = toks(2 * P + 1)
    seq, _ = prefilled(pool, prompt)  # pages 2, 3 (chunk 1) full and registered, page 4 (chunk 2) not
    assert seq.page_ids == (2, 3, 4)
    pool.release(filler)
    assert pool.releasable_chunks() == [0]
    pool.release(seq)
    assert pool.stats().pages_cached == 2 and pool.prefix_match(prompt) == [2, 3]
    assert pool.releasable_chunks() == [2, 1, 0]
    assert pool.release_chunk(1) == 2
    s = pool.stats()
    assert (s.pages_cached, s.evictions, s.pages_total, s.pages_free) == (0, 2, 4, 4)
    assert pool.prefix_match(prompt) == []
    pool.check()


# ------------------------------------------------------------------------------ prefix cache
def test_two_sequences_share_prefix_pages_and_freeing_one_keeps_them():
    pool = KvPool(chunk_pages=8)
    system = toks(3 * P)
    a, reused_a = prefilled(pool, system + toks(10, 50_000))
    assert reused_a == 0 and a.page_ids == (0, 1, 2, 3)
    b, reused_b = pool.new_sequence(system + toks(20, 60_000))
    assert reused_b == 3 * P
    assert b.page_ids[:3] == (0, 1, 2) and b.page_ids[3:] == (4,)
    assert [pool.refcount(p) for p in range(5)] == [2, 2, 2, 1, 1]
    assert pool.stats().pages_in_use == 5
    pool.release(a)
    assert [pool.refcount(p) for p in range(5)] == [1, 1, 1, 0, 1]
    assert [pool.page_state(p) for p in range(5)] == ["in_use"] * 3 + ["free", "in_use"]  # a's page 3 was never full
    pool.release(b)
    assert [pool.page_state(p) for p in range(5)] == ["cached"] * 3 + ["free"] * 2
    pool.check()


def test_matching_uses_full_pages_only_and_never_the_last_tokens_page():
    pool = KvPool(chunk_pages=8)
    doc = toks(4 * P)
    seq, _ = prefilled(pool, doc)
    assert seq.n_committed_pages == 4
    pool.release(seq)
    assert pool.prefix_match(doc) == [0, 1, 2]  # the 4th page holds the last token: run it again
    assert pool.prefix_match(doc[:2 * P]) == [0]  # 64 tokens: position 63 lies in page 1
    assert pool.prefix_match(doc[:2 * P + 1]) == [0, 1]
    assert pool.prefix_match(doc[:P]) == [] and pool.prefix_match(doc[:1]) == [] and pool.prefix_match([]) == []
    assert pool.prefix_match(doc + toks(5, 70_000)) == [0, 1, 2, 3]
    s2, reused = pool.new_sequence(doc[:2 * P + 7], n_positions=2 * P + 8)
    assert reused == 2 * P and s2.page_ids == (0, 1, 4)
    st = pool.stats()
    assert (st.prefix_lookups, st.prefix_hit_pages, st.prefix_hit_tokens) == (2, 2, 2 * P)
    assert st.prefix_miss_tokens == 4 * P + (2 * P + 7 - 2 * P)


def test_cached_pages_a_prompt_reuses_do_not_count_as_evictable_for_it():
    pool = KvPool(chunk_pages=4)
    doc = toks(3 * P + 1)
    pool.release(prefilled(pool, doc)[0])  # pages 0..2 cached, page 3 free
    assert pool.available_pages == 4
    assert pool.can_fit(4 * P, doc) and not pool.can_fit(5 * P, doc)  # the 3 reused pages plus 1 or 2 more
    with pytest.raises(KvPoolExhausted, match="2 more pages .* needed, 1 free or evictable of 4"):
        pool.new_sequence(doc, n_positions=5 * P)
    assert pool.stats().pages_cached == 3 and pool.stats().prefix_lookups == 1
    seq, reused = pool.new_sequence(doc, n_positions=4 * P)
    assert reused == 3 * P and seq.page_ids == (0, 1, 2, 3)
    pool.check()


def test_only_full_written_pages_are_registered():
    pool = KvPool(chunk_pages=8)
    prompt = toks(2 * P + 5)
    seq, _ = pool.new_sequence(prompt)
    assert pool.commit(seq, prompt[:P - 1]) == 0 and seq.n_committed_pages == 0
    assert pool.commit(seq, prompt) == 2 and seq.n_committed_pages == 2
    assert pool.commit(seq, prompt) == 0  # nothing new
    gen = prompt + toks(P - 5, 80_000)  # decoding filled page 2
    assert pool.commit(seq, gen) == 1
    with pytest.raises(ValueError, match="commit of 97 tokens to sequence 0, which has pages for 96"):
        pool.commit(seq, gen + [1])
    pool.release(seq)
    assert pool.prefix_match(gen + [1]) == [0, 1, 2]


def test_a_chain_broken_in_the_middle_matches_only_the_part_before():
    pool = KvPool(chunk_pages=8)
    doc = toks(5 * P)
    prefilled(pool, doc)
    changed = list(doc)
    changed[2 * P + 3] = 7  # a token of page 2 differs
    assert pool.prefix_match(changed) == [0, 1]
    changed_head = list(doc)
    changed_head[0] = 7  # page 0 differs: pages 1.. hold the same tokens but follow another prefix
    assert pool.prefix_match(changed_head) == []
    shifted = [5] + doc  # the same tokens one position later share no page
    assert pool.prefix_match(shifted) == []


def test_namespaces_never_share_keys():
    tokens = toks(3 * P)
    model_a, model_b = page_keys(tokens, b"model-a"), page_keys(tokens, b"model-b")
    assert len(model_a) == len(model_b) == 3 and not set(model_a) & set(model_b)
    assert page_keys(tokens, b"model-a") == model_a  # deterministic
    assert page_keys(tokens[:2 * P] + [0] * P, b"model-a")[:2] == model_a[:2]  # a chain: page i names pages 0..i
    pool = KvPool(chunk_pages=8, namespace=b"model-a")
    prefilled(pool, tokens)
    assert set(pool._page_of_key) == set(model_a)  # the pool keys its pages in its namespace
    with pytest.raises(TypeError, match="namespace must be bytes"):
        KvPool(chunk_pages=8, namespace="model-a")  # type: ignore[arg-type]


def test_duplicate_prefill_keeps_the_first_page_and_frees_the_second():
    pool = KvPool(chunk_pages=8)
    prompt = toks(2 * P + 1)
    a, _ = pool.new_sequence(prompt)  # two requests with one prompt admitted in one pass:
    b, reused = pool.new_sequence(prompt)  # neither finds the other's pages yet
    assert reused == 0
    assert pool.commit(a, prompt) == 2 and pool.commit(b, prompt) == 0
    assert a.page_ids == (0, 1, 2) and b.page_ids == (3, 4, 5)
    pool.release(b)
    assert [pool.page_state(p) for p in (3, 4, 5)] == ["free"] * 3  # not cached: page 0 and 1 hold the keys
    assert pool.stats().pages_cached == 0 and pool.stats().pages_free == 8 - 3
    pool.release(a)
    assert pool.prefix_match(prompt) == [0, 1] and pool.stats().pages_cached == 2
    pool.check()


def test_bad_tokens_are_refused_with_one_line():
    pool = KvPool(chunk_pages=8)
    with pytest.raises(TypeError, match="token ids must be integers, not float64"):
        pool.new_sequence([0.5] * P + [1])
    seq, _ = pool.new_sequence([1], n_positions=P)
    with pytest.raises(TypeError, match="token ids must be integers"):
        pool.commit(seq, [0.5] * P)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*31\)"):
        pool.prefix_match([-1] * P + [1])
    with pytest.raises(ValueError, match=r"not 2147483648$"):
        pool.prefix_match([2**31] * P + [1])
    assert pool.stats().prefix_lookups == 1
    pool.check()


# ------------------------------------------------------------------------------ eviction
def test_eviction_takes_free_pages_first_then_the_least_recently_cached_tail_first():
    pool = KvPool(chunk_pages=8)
    doc_a, doc_b = toks(3 * P + 1, 1000), toks(3 * P + 1, 2000)
    a, _ = prefilled(pool, doc_a)  # pages 0..3; 0..2 registered
    b, _ = prefilled(pool, doc_b)  # pages 4..7; 4..6 registered
    pool.release(a)  # a is cached before b: a is the older
    pool.release(b)
    assert pool.stats().pages_free == 2 and pool.stats().pages_cached == 6
    c, _ = pool.new_sequence(toks(2 * P, 3000))
    assert c.page_ids == (3, 7) and pool.stats().evictions == 0  # the free pages first
    assert pool.grow(c, 3 * P)
    assert c.page_ids[-1] == 2  # then a's tail, the least recently cached
    assert pool.prefix_match(doc_a) == [0, 1] and pool.prefix_match(doc_b) == [4, 5, 6]
    assert pool.grow(c, 5 * P)
    assert c.page_ids[-2:] == (1, 0) and pool.prefix_match(doc_a) == []
    # b's pages are reused (taken out of the LRU) and cached again: now they are the newest
    d, reused = pool.new_sequence(doc_b, n_positions=3 * P)  # the first prefill chunk needs no new page
    assert reused == 3 * P and d.page_ids == (4, 5, 6) and pool.stats().pages_cached == 0
    pool.release(d)
    e, _ = pool.new_sequence(toks(P, 4000))
    assert e.page_ids == (6,) and pool.stats().evictions == 4
    pool.check()


def test_counters():
    pool = KvPool(chunk_pages=4, n_chunks=2)
    s0 = pool.stats()
    assert (s0.page_tokens, s0.chunk_pages, s0.chunks, s0.pages_total, s0.pages_free, s0.pages_in_use,
            s0.pages_cached, s0.sequences, s0.prefix_lookups, s0.evictions) == (P, 4, 2, 8, 8, 0, 0, 0, 0, 0)
    prompt = toks(2 * P + 3)
    a, _ = prefilled(pool, prompt)
    b, _ = pool.new_sequence(prompt + toks(P, 9000))
    s = pool.stats()
    assert (s.pages_in_use, s.pages_cached, s.pages_free, s.sequences) == (5, 0, 3, 2)
    assert (s.prefix_lookups, s.prefix_hit_pages, s.prefix_hit_tokens) == (2, 2, 2 * P)
    assert s.prefix_miss_tokens == (2 * P + 3) + (3 * P + 3 - 2 * P)  # a's whole prompt, b's past the 2 pages
    pool.release(a)
    pool.release(b)
    s = pool.stats()
    assert (s.pages_in_use, s.pages_cached, s.pages_free, s.sequences) == (0, 2, 6, 0)
    assert s.pages_in_use + s.pages_cached + s.pages_free == s.pages_total


# ------------------------------------------------------------------------------ positions
def test_positions_slots_trim_and_the_page_table_array():
    pool = KvPool(chunk_pages=4, n_chunks=2)
    filler, _ = pool.new_sequence(toks(P))  # page 0
    seq, _ = pool.new_sequence(toks(P + 1, 5000))  # pages 1, 2
    assert seq.locate(0) == (1, 0) and seq.locate(P + 1) == (2, 1) and seq.locate(2 * P - 1) == (2, P - 1)
    with pytest.raises(IndexError, match="position 64 outside the 64 positions"):
        seq.locate(2 * P)
    assert seq.slots([0, 5, P, P + 1]).tolist() == [P, P + 5, 2 * P, 2 * P + 1]
    with pytest.raises(IndexError):
        seq.slots([2 * P])
    table = pool.page_table_array([seq, filler])
    assert table.dtype == np.int32 and table.tolist() == [[1, 2], [0, -1]]
    assert pool.page_table_array([filler, seq], max_pages=4).tolist() == [[0, -1, -1, -1], [1, 2, -1, -1]]
    with pytest.raises(ValueError, match="has 2 pages, more than the table's 1"):
        pool.page_table_array([seq], max_pages=1)
    assert pool.page_table_array([]).shape == (0, 0)
    # a speculative tree took two more pages; the rows past the accepted path give them back
    assert pool.grow(seq, 4 * P) and seq.page_ids == (1, 2, 3, 4)
    assert seq.trim(2 * P + 1) == 1 and seq.page_ids == (1, 2, 3)
    assert seq.trim(2 * P + 1) == 0
    assert pool.stats().pages_free == 4
    other = KvPool(chunk_pages=4)
    with pytest.raises(ValueError, match="belongs to another KV pool"):
        other.page_table_array([seq])
    pool.release(seq)
    with pytest.raises(ValueError, match="was released"):
        pool.page_table_array([seq])
    pool.check()


def test_trim_into_committed_pages_sends_them_to_the_cache():
    pool = KvPool(chunk_pages=8)
    prompt = toks(3 * P)
    seq, _ = prefilled(pool, prompt)
    with pytest.raises(ValueError, match="cuts committed page 1, which may be shared: trim to 32 or 64"):
        seq.trim(P + 3)
    assert seq.trim(2 * P) == 1  # the third page (committed) is handed back; its K/V stay valid
    assert seq.n_committed_pages == 2 and pool.page_state(2) == "cached"
    assert pool.commit(seq, prompt[:2 * P]) == 0
    assert pool.grow(seq, 3 * P) and seq.page_ids[2] == 3  # a fresh page: the cached one keeps its contents
    assert pool.commit(seq, prompt) == 0  # page 2 already holds the key; seq's page 3 stays unregistered
    pool.check()


# ------------------------------------------------------------------------------ random walk
def test_random_operations_keep_the_books_and_the_contents():
    """Thousands of seeded operations. Besides the pool's own ``check``, the test keeps what it
    wrote into each page (token, position per slot), so a reused page that does not hold the
    prompt's K/V, or a shared page written again, fails here."""
    rng = random.Random(20250)
    pool = KvPool(chunk_pages=4, n_chunks=3, namespace=b"walk")
    memory: dict[int, list[tuple[int, int] | None]] = {}  # page -> what each slot holds
    live: list[tuple[SeqPages, list[int], int]] = []  # (table, tokens, positions written)
    stems = [[rng.randrange(50) for _ in range(rng.randint(P, 4 * P))] for _ in range(4)]
    n_ops = {"new": 0, "hit": 0, "exhausted": 0, "grow_refused": 0, "release_chunk": 0, "trim_refused": 0}

    def write(seq: SeqPages, tokens: list[int], start: int, end: int) -> None:
        for pos in range(start, end):
            page, off = seq.locate(pos)
            assert pool.refcount(page) == 1, "a shared page is written"
            memory.setdefault(page, [None] * P)[off] = (tokens[pos], pos)

    for _ in range(3000):
        op = rng.random()
        if op < 0.25 or not live:
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, len(stem))] + [rng.randrange(50) for _ in range(rng.randint(0, 40))]
            n_positions = len(prompt) + rng.randint(0, 8)
            fits = pool.can_fit(n_positions, prompt)
            try:
                seq, reused = pool.new_sequence(prompt, n_positions=n_positions)
            except KvPoolExhausted:
                n_ops["exhausted"] += 1
                assert not fits
            else:
                n_ops["new"] += 1
                assert fits
                n_ops["hit"] += reused > 0
                assert reused % P == 0 and reused < len(prompt) and reused == len(pool.prefix_match(prompt)) * P
                for pos in range(reused):  # the reused pages hold the prompt's K/V, position by position
                    page, off = seq.locate(pos)
                    assert memory[page][off] == (prompt[pos], pos)
                write(seq, prompt, reused, len(prompt))
                pool.commit(seq, prompt)
                live.append((seq, prompt, len(prompt)))
        elif op < 0.65:  # decode a few tokens
            i = rng.randrange(len(live))
            seq, tokens, written = live[i]
            n_new = rng.randint(1, 40)
            if pool.grow(seq, written + n_new):
                tokens = tokens + [rng.randrange(50) for _ in range(n_new)]
                write(seq, tokens, written, written + n_new)
                pool.commit(seq, tokens)
                live[i] = (seq, tokens, written + n_new)
            else:
                n_ops["grow_refused"] += 1
                assert seq.capacity_positions < written + n_new
        elif op < 0.72:  # roll back a tail (rejected speculation)
            i = rng.randrange(len(live))
            seq, tokens, written = live[i]
            keep = rng.randint(0, written)
            if keep % P and keep < seq.n_committed_pages * P:
                with pytest.raises(ValueError, match="cuts committed page"):
                    seq.trim(keep)
                n_ops["trim_refused"] += 1
            else:
                seq.trim(keep)
                live[i] = (seq, tokens[:keep], keep)
        elif op < 0.92:
            seq, _, _ = live.pop(rng.randrange(len(live)))
            assert pool.release(seq)
        elif op < 0.96:
            if pool.n_chunks < 5:
                pool.add_chunk()
        else:
            chunks = pool.releasable_chunks()
            if chunks and pool.n_chunks > 1:
                pool.release_chunk(chunks[0])
                n_ops["release_chunk"] += 1
            busy = [c for c in pool.chunk_ids() if c not in chunks]
            if busy:
                with pytest.raises(ValueError, match="in use"):
                    pool.release_chunk(busy[0])

        pool.check()
        refs = {}
        for seq, _, written in live:
            assert seq.capacity_positions >= written
            for page in seq.page_ids:
                refs[page] = refs.get(page, 0) + 1
        for page in range(pool.page_id_limit):
            state = pool.page_state(page)
            assert pool.refcount(page) == refs.get(page, 0)
            assert (state == "in_use") == (page in refs)
        st = pool.stats()
        assert st.pages_free + st.pages_cached + st.pages_in_use == st.pages_total
        assert st.sequences == len(live)

    # the walk went everywhere it should
    assert n_ops["new"] > 300 and n_ops["hit"] > 50 and n_ops["exhausted"] > 10
    assert n_ops["grow_refused"] > 10 and n_ops["release_chunk"] > 10 and n_ops["trim_refused"] > 10
    assert pool.stats().evictions > 50
