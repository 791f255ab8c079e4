"""The page bookkeeping of the paged KV cache: which pages hold which positions of which
sequence, which pages are free, shared or kept for reuse, and which prompt prefixes they hold.

The backends own the memory (a page is a place for ``PAGE_TOKENS`` positions of K and V in
every layer); this module owns only the accounting, in plain Python, so the engine (admission,
growth, prefix reuse) and both backends (which upload page tables for attention) agree on it.

Pages and chunks
    A page holds ``PAGE_TOKENS`` (32) consecutive positions of one sequence, for every layer:
    exactly one tile of the GPU attention kernel. Page ids are small ints; page
    ``chunk * chunk_pages + i`` is page ``i`` of chunk ``chunk``, and a backend allocates its
    memory chunk by chunk. The pool grows by whole chunks (``add_chunk``) when memory frees up
    elsewhere (a resident layer demoted to streamed) and shrinks by releasing a chunk none of
    whose pages is in use (``releasable_chunks``, ``release_chunk``). Allocation always takes the
    lowest free page id, so the highest chunks empty first and can be given back.

The three states of a page (of a chunk the pool has)
    *free*: nothing in it; *in use*: held by one or more sequences' page tables (its refcount);
    *cached*: held by no sequence but registered in the prefix cache, so its K/V are kept and a
    later prompt with the same leading tokens reuses them. Allocation takes a free page first,
    else evicts the least recently cached page. A released sequence hands its pages back tail
    first, so a sequence's tail is evicted before its head: a shared prefix outlives what
    follows it (vLLM's rule).

The prefix cache
    A *full* page is keyed by a chain hash, ``key_i = blake2b(key_{i-1} || tokens of page i)``
    over the tokens' little-endian int32 bytes, from a seed that folds in the pool's
    ``namespace``. A key thus names every token from position 0 to the page's end, which is what
    the page's K/V depend on. The namespace must name everything else they depend on: the model
    file, and any setting that changes what a layer writes (skipped layers, the KV type); two
    pools of different namespaces never share a key. ``new_sequence`` reuses the longest chain
    of registered pages that matches the prompt's leading full pages, never the page that holds
    the prompt's last token (the engine must run that token to get its logits), and
    ``commit`` registers a sequence's pages as they fill with tokens whose K/V are written. When
    a key is already registered to another page (two sequences prefilled the same prompt side by
    side) the first page keeps it and the second stays unregistered: it returns to the free
    pages, not the cache, when its sequence ends.

Rules for the engine and the backends
    - A page in the prefix cache is never written again: the engine writes only positions at or
      past the reused tokens, and registers only full pages of written, committed tokens (never
      a speculative tree's rows, never the position a queued pass is about to write), and
      ``SeqPages.trim`` refuses a cut inside a committed page (cut at a page boundary instead).
    - Release a sequence only when no queued pass will still write its pages (run-ahead): a
      released page may be handed to another sequence at once.
    - Attention reads a sequence's positions through ``page_table_array`` (page ids, ``-1``
      padded) and writes position ``p`` to slot ``seq.slots(p)`` = ``page * PAGE_TOKENS + p %
      PAGE_TOKENS`` of the page memory.

Every call costs O(pages it touches) (``check`` alone, for tests, looks at the whole pool);
nothing is global, nothing depends on timing, and nothing is thread-safe: the engine's thread
owns its pool.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ntx.shared.errors import NtxError
from ntx.shared.kv_sizing import PAGE_TOKENS, pages_for_positions

__all__ = ["PAGE_TOKENS", "KvPoolExhausted", "KvPool", "KvPoolStats", "SeqPages", "page_keys",
           "pages_for_positions"]

_KEY_BYTES = 32  # blake2b digest size of a page key
_KEY_DOMAIN = b"ntx.kv_pages.chain.v1"

Tokens = Sequence[int] | np.ndarray  # token ids: [n] int


class KvPoolExhausted(NtxError):
    """The pool cannot provide the pages a new sequence needs, even by evicting every cached
    page; nothing was taken. The engine queues the request (or fails it, if it can never fit)."""

    def __init__(self, needed_pages: int, available_pages: int, total_pages: int) -> None:
        self.needed_pages = needed_pages
        self.available_pages = available_pages
        self.total_pages = total_pages
        super().__init__(
            f"KV page pool exhausted: {needed_pages} more pages ({needed_pages * PAGE_TOKENS} positions) needed, "
            f"{available_pages} free or evictable of {total_pages}: wait for sequences to end, or start with "
            f"a larger --vram-budget or a smaller --ctx")


def _chain_seed(namespace: bytes) -> bytes:
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be bytes (e.g. the model file's identity), not {type(namespace).__name__}")
    return hashlib.blake2b(_KEY_DOMAIN + PAGE_TOKENS.to_bytes(4, "little") + namespace,
                           digest_size=_KEY_BYTES).digest()


def _chain_keys(prev_key: bytes, tokens: Tokens, first: int, end: int) -> Iterator[bytes]:
    """The chain keys of full pages [first, end) of ``tokens``, given the key of page first - 1
    (the seed for page 0). Lazy: a caller that stops early hashes no further."""
    part = np.asarray(tokens[first * PAGE_TOKENS:end * PAGE_TOKENS])  # [(end - first) * PAGE_TOKENS]
    if not part.size:
        return
    if part.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, not {part.dtype}")
    lo, hi = int(part.min()), int(part.max())
    if lo < 0 or hi >= 2**31:
        raise ValueError(f"token ids must lie in [0, 2**31), not {lo if lo < 0 else hi}")
    data = part.astype("<i4").tobytes()
    page_bytes = PAGE_TOKENS * 4
    key = prev_key
    for at in range(0, len(data), page_bytes):
        key = hashlib.blake2b(key + data[at:at + page_bytes], digest_size=_KEY_BYTES).digest()
        yield key


def page_keys(tokens: Tokens, namespace: bytes = b"") -> list[bytes]:
    """The chain keys of the full pages of ``tokens`` (``len(tokens) // PAGE_TOKENS`` of them)."""
    return list(_chain_keys(_chain_seed(namespace), tokens, 0, len(tokens) // PAGE_TOKENS))


class SeqPages:
    """One sequence's page table: the ids of the pages that hold its positions, in order
    (position ``p`` lies in ``page_ids[p // PAGE_TOKENS]`` at offset ``p % PAGE_TOKENS``).

    It also remembers the chain keys of its leading full pages that ``KvPool.commit`` has seen,
    so committing after each pass hashes only the pages that filled since. Made by
    ``KvPool.new_sequence``; ``free`` (or ``KvPool.release``) hands the pages back."""

    __slots__ = ("seq_id", "_pool", "_pages", "_keys", "_released")

    def __init__(self, pool: KvPool, seq_id: int) -> None:
        self.seq_id = seq_id  # the pool's own number for the sequence (status, messages)
        self._pool = pool
        self._pages: list[int] = []
        self._keys: list[bytes] = []  # chain keys of pages [0, len(_keys)): committed full pages
        self._released = False

    def __repr__(self) -> str:
        state = "released" if self._released else f"{len(self._pages)} pages"
        return f"SeqPages(seq_id={self.seq_id}, {state})"

    @property
    def page_ids(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def n_pages(self) -> int:
        return len(self._pages)

    @property
    def capacity_positions(self) -> int:
        """Positions [0, capacity_positions) have a page."""
        return len(self._pages) * PAGE_TOKENS

    @property
    def n_committed_pages(self) -> int:
        """Leading pages whose tokens ``commit`` has seen (reused pages included)."""
        return len(self._keys)

    @property
    def released(self) -> bool:
        return self._released

    def pages_for(self, n_positions: int) -> int:
        """How many more pages positions [0, n_positions) need."""
        return max(0, pages_for_positions(n_positions) - len(self._pages))

    def ensure(self, n_positions: int) -> bool:
        """Give positions [0, n_positions) their pages. All or nothing: False (and no page
        taken) when the pool cannot provide them even by evicting cached pages."""
        self._check_live()
        need = self.pages_for(n_positions)
        if need == 0:
            return True
        if need > self._pool.available_pages:
            return False
        self._pages.extend(self._pool._take(need))
        return True

    def locate(self, position: int) -> tuple[int, int]:
        """(page id, offset in the page) of ``position``."""
        if not 0 <= position < self.capacity_positions:
            raise IndexError(f"position {position} outside the {self.capacity_positions} positions "
                             f"sequence {self.seq_id} has pages for")
        return self._pages[position // PAGE_TOKENS], position % PAGE_TOKENS

    def slots(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Where each position's K/V lie in the page memory: page * PAGE_TOKENS + offset.
        positions: [n] int -> [n] int64."""
        pos = np.asarray(positions, dtype=np.int64)  # [n]
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.capacity_positions):
            raise IndexError(f"positions {int(pos.min())}..{int(pos.max())} outside the {self.capacity_positions} "
                             f"positions sequence {self.seq_id} has pages for")
        table = np.asarray(self._pages, dtype=np.int64)  # [n_pages]
        return table[pos // PAGE_TOKENS] * PAGE_TOKENS + pos % PAGE_TOKENS

    def trim(self, n_positions: int) -> int:
        """Hand back the pages past those positions [0, n_positions) need, tail first (a
        speculative tree's rejected rows, a rolled-back tail); returns how many. Pages of
        committed tokens go back to the prefix cache, the rest to the free pages.

        A committed page is never written again (other sequences may read it), so a cut inside
        one is refused: cut at its end, or at a page boundary below it."""
        self._check_live()
        keep = pages_for_positions(n_positions)
        if n_positions % PAGE_TOKENS and keep <= len(self._keys):
            raise ValueError(f"trim of sequence {self.seq_id} to {n_positions} positions cuts committed page "
                             f"{keep - 1}, which may be shared: trim to {(keep - 1) * PAGE_TOKENS} or "
                             f"{keep * PAGE_TOKENS} positions and write the rest again")
        n_gone = max(0, len(self._pages) - keep)
        if n_gone:
            self._pool._unref_tail_first(self._pages[keep:])
            del self._pages[keep:]
            del self._keys[keep:]
        return n_gone

    def free(self) -> bool:
        """Hand back every page, tail first. False when the sequence was already released (so
        a cancel and an error path may both call it)."""
        if self._released:
            return False
        self._pool._unref_tail_first(self._pages)
        self._pages.clear()
        self._keys.clear()
        self._released = True
        del self._pool._live[self.seq_id]
        return True

    def _check_live(self) -> None:
        if self._released:
            raise ValueError(f"sequence {self.seq_id} was released; it has no pages to use")


@dataclass(frozen=True)
class KvPoolStats:
    """A snapshot of the pool's counters for ``ntxctl status`` and ``/metrics``."""

    page_tokens: int
    chunk_pages: int
    chunks: int
    pages_total: int
    pages_in_use: int  # held by at least one sequence
    pages_cached: int  # held by none, kept for prefix reuse (evictable)
    pages_free: int
    sequences: int
    prefix_lookups: int  # sequences admitted
    prefix_hit_pages: int  # pages they reused
    prefix_hit_tokens: int  # prompt tokens they did not prefill
    prefix_miss_tokens: int  # prompt tokens they had to prefill
    evictions: int  # cached pages dropped (to allocate, or with a released chunk)


class KvPool:
    """The pages of a paged KV cache: their states, the sequences' page tables and the prefix
    cache (see the module's docstring for the rules).

    ``chunk_pages`` pages per chunk, ``n_chunks`` chunks to start with; ``namespace`` names the
    model and every setting its K/V depend on (folded into the prefix keys). The engine uses
    ``new_sequence``, ``grow``, ``commit``, ``release``, ``can_fit``, ``SeqPages.trim`` and the
    chunk calls; the backends use ``page_table_array``, ``SeqPages.slots`` and ``page_id_limit``."""

    def __init__(self, chunk_pages: int, n_chunks: int = 1, *, namespace: bytes = b"") -> None:
        if chunk_pages < 1 or n_chunks < 0:
            raise ValueError(f"a KV pool needs chunk_pages >= 1 and n_chunks >= 0, not {chunk_pages} and {n_chunks}")
        self.chunk_pages = chunk_pages
        self.namespace = namespace
        self._seed = _chain_seed(namespace)
        # per page id (of every chunk id ever made, present or not)
        self._refs: list[int] = []  # sequences holding the page
        self._in_heap: list[bool] = []  # the page has an entry in _free_heap (maybe stale: a released chunk's)
        # per chunk id
        self._present: list[bool] = []
        self._chunk_in_use: list[int] = []  # pages of the chunk in use
        self._gone_chunks: list[int] = []  # min-heap of released chunk ids, reused first by add_chunk
        self._free_heap: list[int] = []  # min-heap of free page ids (entries of released chunks are skipped)
        self._n_free = 0
        self._n_in_use = 0
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently cached first
        self._page_of_key: dict[bytes, int] = {}
        self._key_of_page: dict[int, bytes] = {}
        self._live: dict[int, SeqPages] = {}
        self._next_seq_id = 0
        self._lookups = self._hit_pages = self._hit_tokens = self._miss_tokens = self._evictions = 0
        for _ in range(n_chunks):
            self.add_chunk()

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def n_chunks(self) -> int:
        return len(self._present) - len(self._gone_chunks)

    @property
    def pages_total(self) -> int:
        return self.n_chunks * self.chunk_pages

    @property
    def available_pages(self) -> int:
        """Pages an allocation can take now: free ones, then cached ones by eviction."""
        return self._n_free + len(self._lru)

    @property
    def page_id_limit(self) -> int:
        """Every page id is below this: the size of a backend's chunk table times chunk_pages."""
        return len(self._present) * self.chunk_pages

    def chunk_ids(self) -> list[int]:
        return [c for c, here in enumerate(self._present) if here]

    def can_fit(self, n_positions: int, prompt_tokens: Tokens | None = None) -> bool:
        """Whether a new sequence with positions [0, n_positions) would get its pages now (after
        reusing the cached prefix of ``prompt_tokens``, if given)."""
        reused = self.prefix_match(prompt_tokens) if prompt_tokens is not None else []
        return self._new_pages_needed(n_positions, reused) <= self._available_besides(reused)

    # -- chunks ---------------------------------------------------------------------------------
    def add_chunk(self) -> int:
        """Add ``chunk_pages`` free pages (the lowest chunk id not in use); returns the chunk id,
        whose memory the backend allocates before the pages are used."""
        if self._gone_chunks:
            chunk = heapq.heappop(self._gone_chunks)
        else:
            chunk = len(self._present)
            self._present.append(False)
            self._chunk_in_use.append(0)
            self._refs.extend([0] * self.chunk_pages)
            self._in_heap.extend([False] * self.chunk_pages)
        self._present[chunk] = True
        for page in range(chunk * self.chunk_pages, (chunk + 1) * self.chunk_pages):
            self._push_free(page)
        return chunk

    def releasable_chunks(self) -> list[int]:
        """Chunks none of whose pages a sequence holds, highest first (the order to release in:
        allocation fills the lowest ids first)."""
        return [c for c in reversed(range(len(self._present))) if self._present[c] and self._chunk_in_use[c] == 0]

    def release_chunk(self, chunk: int) -> int:
        """Take chunk ``chunk``'s pages out of the pool, so the backend can free its memory; its
        cached pages are evicted first. Returns how many were. Refused (ValueError) while a
        sequence holds one of its pages."""
        if not (0 <= chunk < len(self._present) and self._present[chunk]):
            raise ValueError(f"KV pool has no chunk {chunk}; its chunks are {self.chunk_ids()}")
        if self._chunk_in_use[chunk]:
            raise ValueError(f"KV chunk {chunk} still has {self._chunk_in_use[chunk]} pages in use; "
                             f"release one of releasable_chunks() {self.releasable_chunks()}")
        evicted = 0
        for page in range(chunk * self.chunk_pages, (chunk + 1) * self.chunk_pages):
            if page in self._key_of_page:
                del self._lru[page]
                self._unregister(page)
                evicted += 1
            else:
                self._n_free -= 1  # its heap entry stays and is skipped when popped
        self._present[chunk] = False
        heapq.heappush(self._gone_chunks, chunk)
        self._evictions += evicted
        return evicted

    # -- sequences ------------------------------------------------------------------------------
    def new_sequence(self, prompt_tokens: Tokens,
                     n_positions: int | None = None) -> tuple[SeqPages, int]:
        """A sequence for ``prompt_tokens`` with pages for positions [0, n_positions) (default:
        the prompt's), reusing the cached pages of its longest matching prefix. Returns the
        sequence and how many leading prompt tokens already have their K/V (a multiple of
        PAGE_TOKENS, always less than the prompt's length): the engine prefills from there.

        All or nothing: raises KvPoolExhausted, with nothing taken and no counter moved, when
        the pages do not fit."""
        n_prompt = len(prompt_tokens)
        n_positions = n_prompt if n_positions is None else n_positions
        reused, keys = self._match(prompt_tokens)
        need = self._new_pages_needed(n_positions, reused)
        available = self._available_besides(reused)
        if need > available:
            raise KvPoolExhausted(need, available, self.pages_total)
        seq = SeqPages(self, self._next_seq_id)
        self._next_seq_id += 1
        self._live[seq.seq_id] = seq
        for page in reused:
            self._ref(page)
        seq._pages.extend(reused)
        seq._keys.extend(keys)
        seq._pages.extend(self._take(need))
        n_reused_tokens = len(reused) * PAGE_TOKENS
        self._lookups += 1
        self._hit_pages += len(reused)
        self._hit_tokens += n_reused_tokens
        self._miss_tokens += n_prompt - n_reused_tokens
        return seq, n_reused_tokens

    def grow(self, seq: SeqPages, n_positions: int) -> bool:
        """Pages for positions [0, n_positions) of ``seq``; False (nothing taken) if they do not fit."""
        self._check_own(seq)
        return seq.ensure(n_positions)

    def commit(self, seq: SeqPages, tokens: Tokens) -> int:
        """Register the pages of ``seq`` that ``tokens`` (the sequence's tokens at positions
        [0, len(tokens)), every one's K/V written) fill and that were not committed before.
        A page whose key another page already holds stays unregistered. Returns the number of
        pages newly registered."""
        self._check_own(seq)
        seq._check_live()
        if len(tokens) > seq.capacity_positions:
            raise ValueError(f"commit of {len(tokens)} tokens to sequence {seq.seq_id}, which has pages "
                             f"for {seq.capacity_positions} positions: grow it and write them first")
        first, end = len(seq._keys), len(tokens) // PAGE_TOKENS
        if end <= first:  # most passes: no page filled since the last commit
            return 0
        registered = 0
        prev_key = seq._keys[-1] if seq._keys else self._seed
        for i, key in enumerate(_chain_keys(prev_key, tokens, first, end), first):
            seq._keys.append(key)
            if key not in self._page_of_key:
                page = seq._pages[i]
                self._page_of_key[key] = page
                self._key_of_page[page] = key
                registered += 1
        return registered

    def release(self, seq: SeqPages) -> bool:
        """Hand back every page of ``seq``, tail first; False if it was released before."""
        self._check_own(seq)
        return seq.free()

    def prefix_match(self, tokens: Tokens) -> list[int]:
        """The pages a new sequence with prompt ``tokens`` would reuse (taking no reference):
        the longest chain of registered pages matching its leading full pages, at most
        (len(tokens) - 1) // PAGE_TOKENS of them (never the page of the prompt's last token)."""
        return self._match(tokens)[0]

    def page_table_array(self, seqs: Sequence[SeqPages], max_pages: int | None = None) -> np.ndarray:
        """The page tables of ``seqs`` as one array for attention: [len(seqs), max_pages] int32,
        row i the page ids of seqs[i], padded with -1 (max_pages: default the longest table)."""
        for s in seqs:
            self._check_own(s)
            s._check_live()
        width = max((s.n_pages for s in seqs), default=0) if max_pages is None else max_pages
        table = np.full((len(seqs), width), -1, dtype=np.int32)  # [n, max_pages]
        for row, s in enumerate(seqs):
            if s.n_pages > width:
                raise ValueError(f"sequence {s.seq_id} has {s.n_pages} pages, more than the table's {width}")
            table[row, :s.n_pages] = s._pages
        return table

    def stats(self) -> KvPoolStats:
        return KvPoolStats(
            page_tokens=PAGE_TOKENS, chunk_pages=self.chunk_pages, chunks=self.n_chunks,
            pages_total=self.pages_total, pages_in_use=self._n_in_use, pages_cached=len(self._lru),
            pages_free=self._n_free, sequences=len(self._live), prefix_lookups=self._lookups,
            prefix_hit_pages=self._hit_pages, prefix_hit_tokens=self._hit_tokens,
            prefix_miss_tokens=self._miss_tokens, evictions=self._evictions)

    def page_state(self, page: int) -> str:
        """'free', 'cached', 'in_use' or 'absent' (a chunk the pool does not have)."""
        if not 0 <= page < self.page_id_limit or not self._present[page // self.chunk_pages]:
            return "absent"
        if self._refs[page]:
            return "in_use"
        return "cached" if page in self._lru else "free"

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # -- internals ------------------------------------------------------------------------------
    def _match(self, tokens: Tokens) -> tuple[list[int], list[bytes]]:
        pages: list[int] = []
        keys: list[bytes] = []
        for key in _chain_keys(self._seed, tokens, 0, max(0, len(tokens) - 1) // PAGE_TOKENS):
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        return pages, keys

    @staticmethod
    def _new_pages_needed(n_positions: int, reused: list[int]) -> int:
        return max(0, pages_for_positions(n_positions) - len(reused))

    def _available_besides(self, reused: list[int]) -> int:
        """Pages an allocation could take once the cached pages among ``reused`` are taken back."""
        return self.available_pages - sum(1 for p in reused if self._refs[p] == 0)

    def _check_own(self, seq: SeqPages) -> None:
        if seq._pool is not self:
            raise ValueError(f"sequence {seq.seq_id} belongs to another KV pool")

    def _push_free(self, page: int) -> None:
        self._n_free += 1
        if not self._in_heap[page]:
            self._in_heap[page] = True
            heapq.heappush(self._free_heap, page)

    def _pop_free(self) -> int:
        while True:
            page = heapq.heappop(self._free_heap)
            self._in_heap[page] = False
            if self._present[page // self.chunk_pages]:  # else: a released chunk's stale entry
                self._n_free -= 1
                return page

    def _unregister(self, page: int) -> None:
        del self._page_of_key[self._key_of_page.pop(page)]

    def _take(self, n: int) -> list[int]:
        """``n`` pages, each with one reference: the lowest free ids, then the least recently
        cached pages (their prefix keys dropped). The caller checked that n fit."""
        taken = []
        for _ in range(n):
            if self._n_free:
                page = self._pop_free()
            else:
                page, _ = self._lru.popitem(last=False)
                self._unregister(page)
                self._evictions += 1
            self._refs[page] = 1
            self._chunk_in_use[page // self.chunk_pages] += 1
            taken.append(page)
        self._n_in_use += n
        return taken

    def _ref(self, page: int) -> None:
        if self._refs[page] == 0:  # cached: in use again, out of the LRU
            del self._lru[page]
            self._chunk_in_use[page // self.chunk_pages] += 1
            self._n_in_use += 1
        self._refs[page] += 1

    def _unref_tail_first(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            self._chunk_in_use[page // self.chunk_pages] -= 1
            self._n_in_use -= 1
            if page in self._key_of_page:
                self._lru[page] = None  # most recently cached
            else:
                self._push_free(page)

    # -- invariants (tests) ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless the pool's books agree: every page in exactly one state,
        refcounts equal to the page tables holding each page, the prefix keys on cached or
        in-use pages only, and the counters equal to what they count. Looks at everything."""
        held = [0] * len(self._refs)
        for seq_id, s in self._live.items():
            _expect(s.seq_id == seq_id and not s._released, f"live table {seq_id} is {s!r}")
            _expect(len(set(s._pages)) == len(s._pages), f"sequence {seq_id} holds a page twice")
            _expect(len(s._keys) <= len(s._pages), f"sequence {seq_id} has keys past its pages")
            for i, page in enumerate(s._pages):
                held[page] += 1
                if page in self._key_of_page:
                    _expect(i < len(s._keys) and self._key_of_page[page] == s._keys[i],
                            f"page {page} at index {i} of sequence {seq_id} is registered under another key")
        heap_pages = list(self._free_heap)
        _expect(len(heap_pages) == len(set(heap_pages)), "a page is in the free heap twice")
        _expect(set(heap_pages) == {p for p, flag in enumerate(self._in_heap) if flag}, "heap flags disagree")
        counts = {"free": 0, "cached": 0, "in_use": 0}
        chunk_in_use = [0] * len(self._present)
        for page, refs in enumerate(self._refs):
            _expect(refs == held[page], f"page {page} has refcount {refs} but {held[page]} page tables hold it")
            registered = page in self._key_of_page
            in_lru = page in self._lru
            if not self._present[page // self.chunk_pages]:
                _expect(refs == 0 and not registered and not in_lru, f"page {page} of a released chunk is used")
                continue
            if refs:
                state = "in_use"
                chunk_in_use[page // self.chunk_pages] += 1
                _expect(not in_lru, f"page {page} is in use and in the LRU")
            elif registered:
                state = "cached"
                _expect(in_lru, f"cached page {page} is not in the LRU")
            else:
                state = "free"
                _expect(self._in_heap[page] and not in_lru, f"free page {page} is not in the free heap")
            counts[state] += 1
        _expect(all(self._refs[p] == 0 and p in self._key_of_page for p in self._lru),
                "the LRU holds a page that is not cached")
        _expect(all(self._page_of_key.get(k) == p for p, k in self._key_of_page.items())
                and len(self._page_of_key) == len(self._key_of_page), "the key maps are not inverse")
        _expect(chunk_in_use == self._chunk_in_use,
                f"per-chunk in-use counts {self._chunk_in_use} but {chunk_in_use}")
        _expect((counts["free"], counts["cached"], counts["in_use"]) == (self._n_free, len(self._lru), self._n_in_use),
                f"counted {counts}, books say free {self._n_free} cached {len(self._lru)} in use {self._n_in_use}")
        _expect(sum(counts.values()) == self.pages_total, f"{counts} do not add up to {self.pages_total} pages")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"KV pool books disagree: {what}")
