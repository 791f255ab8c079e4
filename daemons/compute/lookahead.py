"""Lookahead drafting (``--draft lookahead``): the target guesses its own n-grams in the rows a
verify pass has to spare, so drafts exist even where the text quotes nothing.

A prompt lookup drafts only where the model copies its context; SmolLM2 summarising paraphrases
most documents and accepts 1.49 tokens a verify pass there (docs/PERFORMANCE.md). On a streamed
model a verify pass costs what a plain one does up to dozens of rows (its layers' copy sets the
time, not its rows), so rows are free there, and Lookahead Decoding (Fu et al., 2024) spends them
on Jacobi iteration: beside the drafts, the pass also computes a window of guesses for the next
positions, and each guess's row yields a better guess one position further on. The guesses along
a diagonal form an n-gram that the model itself nearly produced; those n-grams, kept in a pool by
their first token, are drafted whenever a sequence reaches that token again.

The window here is a tree the existing verifier takes unchanged: ``LEVELS`` levels of ``W``
guesses each, the guess at level l, column j for offset l + j + 1 past the last token: level 0
a chain (column j the child of column j - 1), a higher level's guess the child of the level
below's at the same column, so its row sees the path that Jacobi iteration would give it.
Every path in it is an ordinary draft: where the guesses are what the model would say, the
verifier accepts them like any other draft (greedy output stays the target's). After the pass
(``verified``, given every row's best token): each column's guesses and its top row's
prediction make an n-gram of ``LEVELS + 1`` tokens for the pool, the levels move down and the
top rows' predictions become the new top level.

Only where a verify pass's rows are free (``DraftRequest.rows_free``: the measured verify pass
of the tree's rows within 3% of a plain one, as for the lookup's one-token matches, or a fixed
shape, or nothing timed yet, so that the first such pass measures them) is the window added;
elsewhere (the CPU, a resident model at many rows) the drafter is the prompt lookup alone,
since guesses accepted this rarely would cost more rows than they save.

The same rows also rank tokens: Token Recycling (Luo et al., 2024) keeps, for every token, the
``RECYCLE_K`` tokens the target last ranked highest after it (``RecycledTokens``, learnt from
every row of every verify pass: each row is a node's token and the target's ranking of what
follows it), and grows a tree from the last token through them along a fixed shape of ranks
(``recycled_shape``). Its nodes take what the rest of the tree leaves. On SmolLM2 (CPU, 63
nodes a pass, 192 tokens a text; ``scripts/draft_acceptance.py``, docs/PERFORMANCE.md) it
raised the summarising texts' acceptance from 1.23 to 1.39 (2.189 -> 2.349 tokens a decode
pass) and the editing ones' from 2.13 to 2.50 (3.131 -> 3.505), the chat's unchanged, greedy
output identical. The engine asks a greedy verify row for its top ``RECYCLE_K`` instead of its
top-1 (``Drafter.row_top_k``).

A tree holds, within the request's node budget: the prompt lookup's continuations (the
sequence's own text, as ``--draft ngram``), then the pool's n-grams that start at the last token
(newest first), then the window, whose nodes are reserved first (``window_shape``) so that it
always advances, then the recycled tokens' tree. ``verified`` finds the window's rows by their
token paths, so the window also works inside a merged tree (``CombinedDrafter``). Memory: a
window per sequence, one pool for the instance (``NgramPool``: at most ``POOL_KEYS`` first
tokens, ``POOL_PER_KEY`` n-grams each) and one ``RecycledTokens`` (at most ``RECYCLED_KEYS``
tokens' rankings of ``RECYCLE_K``: about 30 MiB when full).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from ntx.daemons.compute.lookup import LookupDrafter, add_path, tree_paths
from ntx.daemons.compute.speculation import DraftRequest, DraftTree

__all__ = ["LookaheadDrafter", "NgramPool", "RecycledTokens", "recycled_paths", "recycled_shape", "window_shape"]

LEVELS = 3  # guesses per window column: pool n-grams of LEVELS + 1 tokens (Lookahead Decoding's N = 4)
MAX_COLUMNS = 16  # the window's widest (its columns reach LEVELS + 15 positions ahead)
WINDOW_SHARE = 0.5  # of a tree's node budget, the most the window takes
POOL_PER_KEY = 4  # n-grams kept per first token, newest first
POOL_KEYS = 1 << 14  # first tokens the instance's pool keeps (at most 64 Ki n-grams, a few MiB)
RECYCLE_K = 8  # tokens a verify row ranks for the recycled tokens (Token Recycling's k)
RECYCLED_KEYS = 1 << 16  # tokens whose rankings the instance keeps, the least recently learnt dropped first
# each rank's share of the recycled tree's accepted nodes (dev/spec/recycling_sim.py: SmolLM2
# summarising the repo's six documents, a tree of 256 nodes): the weights recycled_shape grows by
RANK_HIT = (0.489, 0.228, 0.109, 0.043, 0.043, 0.033, 0.038, 0.016)


def window_shape(nodes: int, depth: int) -> tuple[int, int]:
    """(levels, columns) of a window of at most ``nodes`` nodes whose deepest path (levels +
    columns - 1) stays within ``depth``: ``LEVELS`` levels where they fit (fewer in small
    trees); (0, 0): no window (under 2 levels of 2 columns it guesses too little to pay)."""
    for levels in range(LEVELS, 1, -1):
        columns = min(MAX_COLUMNS, nodes // levels, depth - levels + 1)
        if columns >= 2:
            return levels, columns
    return 0, 0


class NgramPool:
    """The n-grams the target guessed (each window column's guesses and its top row's
    prediction), by first token, newest first, ``POOL_PER_KEY`` a token, at most ``POOL_KEYS``
    first tokens (the least recently added dropped first). One for the instance, as the suffix
    drafter's recent text is: what the model guesses after a token in one request it often
    guesses in the next (SmolLM2 summarising the repo's six texts in turn: 2.088 tokens a decode
    pass at 32 nodes against 2.021 with a pool per sequence; 32 held-out documents: 2.528
    against 2.38; docs/PERFORMANCE.md)."""

    def __init__(self, max_keys: int = POOL_KEYS) -> None:
        self.max_keys = max_keys
        self.by_first: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def add(self, ngram: Sequence[int]) -> None:
        first, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        kept = self.by_first.pop(first, [])
        self.by_first[first] = ([rest] + [g for g in kept if g != rest])[:POOL_PER_KEY]
        while len(self.by_first) > self.max_keys:
            self.by_first.popitem(last=False)

    def after(self, token: int) -> list[tuple[int, ...]]:
        """The n-grams that start with ``token``, without it: the newest first."""
        return self.by_first.get(int(token), [])

    def __len__(self) -> int:
        return len(self.by_first)


class RecycledTokens:
    """For each token, the ``RECYCLE_K`` tokens the target last ranked highest after it (Token
    Recycling's adjacency matrix): one for the instance, at most ``max_keys`` tokens, the least
    recently learnt dropped first. What follows a token depends on more than the token, so an
    entry is a guess; the newest is kept because it was ranked in the nearest context."""

    def __init__(self, max_keys: int = RECYCLED_KEYS) -> None:
        self.max_keys = max_keys
        self.by_token: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def learn(self, token: int, ranked: Sequence[int]) -> None:
        token = int(token)
        self.by_token.pop(token, None)
        self.by_token[token] = tuple(int(t) for t in ranked[:RECYCLE_K])
        while len(self.by_token) > self.max_keys:
            self.by_token.popitem(last=False)

    def after(self, token: int) -> tuple[int, ...]:
        """The tokens ranked after ``token``, best first (empty: never seen)."""
        return self.by_token.get(int(token), ())

    def __len__(self) -> int:
        return len(self.by_token)


def recycled_shape(nodes: int, depth: int, hits: tuple[float, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """The recycled tree's shape: the ``nodes`` rank paths (the ranks taken from the root, a
    node's parent before it) most likely accepted if each rank r is right with ``hits[r]``
    (``RANK_HIT`` by default) independently, none deeper than ``depth``: a static tree, as
    Sequoia and Token Recycling choose theirs."""
    return _likeliest_rank_paths(nodes, depth, RANK_HIT if hits is None else tuple(hits))


@lru_cache(maxsize=64)
def _likeliest_rank_paths(nodes: int, depth: int, hits: tuple[float, ...]) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    heap = [(-hit, (r,)) for r, hit in enumerate(hits)]
    heapq.heapify(heap)
    while heap and len(out) < nodes:
        neg_p, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r, hit in enumerate(hits):
                heapq.heappush(heap, (neg_p * hit, path + (r,)))
    return tuple(out)


def recycled_paths(recycled: RecycledTokens, last: int,
                   shape: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """The recycled tree from ``last`` along ``shape`` (rank paths, parents first): each rank
    path that the rankings reach, with its token path (``last`` left out), parents first."""
    paths: dict[tuple[int, ...], list[int]] = {}
    for ranks in shape:
        parent = paths.get(ranks[:-1]) if len(ranks) > 1 else []
        if parent is None:
            continue
        after = recycled.after(parent[-1] if parent else last)
        if ranks[-1] < len(after):
            paths[ranks] = parent + [after[ranks[-1]]]
    return paths


@dataclass
class _Window:
    """One sequence's window: ``levels[l][j]`` the guess at level l, column j (level 0 the
    oldest), up to ``n_levels`` of them; ``proposed`` the token paths (from the root) to the top
    level's guesses in the last tree, by column (None: no tree of this window awaits its pass);
    ``looked_up`` the last tree's nodes that the lookup drafted, as token paths."""

    levels: list[list[int]]
    n_levels: int
    proposed: list[tuple[int, ...]] | None = None
    looked_up: set[tuple[int, ...]] = field(default_factory=set)

    def column_paths(self) -> list[list[int]]:
        """Each column's path from the root to its top guess: level 0's columns up to it, then
        the levels above it."""
        return [[self.levels[0][c] for c in range(j + 1)] + [lv[j] for lv in self.levels[1:]]
                for j in range(len(self.levels[0]))]

    def advance(self, tops: list[int]) -> list[list[int]]:
        """The pass computed every column's top guess and predicted ``tops`` after them: the
        predictions become the top level. Once the window has all its levels, the oldest goes
        (the window moves one position on), and each column's guesses with its prediction are
        an n-gram for the pool: returned."""
        ngrams = []
        if len(self.levels) >= self.n_levels:
            ngrams = [[lv[j] for lv in self.levels] + [top] for j, top in enumerate(tops)]
            del self.levels[: len(self.levels) - self.n_levels + 1]
        self.levels.append(list(tops))
        return ngrams


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's token path from the root, by node (a trie's paths are distinct)."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tok),))
    return paths


class LookaheadDrafter(LookupDrafter):
    """Prompt lookup, the pool of n-grams the target guessed, and a window of Jacobi guesses,
    as one tree (the module's docstring). ``seed``: the first window's guesses are tokens drawn
    from the prompt with it (a deterministic draw: the same request drafts the same trees)."""

    learns_from_rows = True
    row_top_k = RECYCLE_K

    def __init__(self, seed: int = 0) -> None:
        super().__init__("ngram")
        self.name = "lookahead"
        self.seed = seed
        self.windows: dict[int, _Window] = {}
        self.pool = NgramPool()
        self.recycled = RecycledTokens()
        self.roots: dict[int, int] = {}  # each sequence's last token when its tree was proposed: row 0's
        # accepted tokens that only the pool, the window or the recycled tokens drafted (the
        # lookup did not), and the verify passes with a window in them: what lookahead adds
        self.guessed_accepted = 0
        self.window_passes = 0

    def report(self) -> dict[str, int]:
        return {"guessed_accepted": self.guessed_accepted, "window_passes": self.window_passes,
                "pool_tokens": len(self.pool), "recycled_tokens": len(self.recycled)}

    def _window(self, r: DraftRequest, levels: int, columns: int) -> _Window:
        """``r``'s window, shaped to ``levels`` and ``columns`` (a tree of another budget: more
        columns guess again what the last one guessed, fewer levels drop the oldest)."""
        w = self.windows.get(r.seq_id)
        if w is None:
            rng = random.Random(self.seed * 1_000_003 + len(r.tokens))
            w = self.windows[r.seq_id] = _Window([[int(r.tokens[rng.randrange(len(r.tokens))])
                                                   for _ in range(columns)]], levels)
        w.n_levels = levels
        del w.levels[: max(0, len(w.levels) - levels)]
        for level in w.levels:
            del level[columns:]
            level.extend([level[-1]] * (columns - len(level)))
        return w

    def _propose(self, r: DraftRequest) -> DraftTree:
        """The lookup's continuations, the pool's n-grams after the last token, the window. The
        window has half the nodes, or what a strong lookup match (2-5 tokens: a quote, usually
        long) and the pool's n-grams leave of them if less; a one-token match's guess gets what
        the pool's and the window's leave."""
        budget = r.depth * r.width
        lookup = super()._propose(r)
        self.roots[r.seq_id] = int(r.tokens[-1])
        w = self.windows.get(r.seq_id)
        if not r.rows_free:  # guesses accepted this rarely pay only where a verify pass's rows cost nothing
            if w is not None:
                w.proposed = None
            return lookup
        guessed = [list(cont[: r.depth]) for cont in self.pool.after(r.tokens[-1])]
        pooled = sum(map(len, guessed))
        share = int(budget * WINDOW_SHARE)
        window_nodes = share if lookup.weak else min(share, budget - len(lookup) - pooled)
        levels, columns = window_shape(window_nodes, r.depth)
        if not columns:
            if w is not None:
                w.proposed = None
            children = {(p, t): i for i, (t, p) in enumerate(zip(lookup.tokens, lookup.parents))}
            self._add_recycled(lookup, children, r, budget)  # onto the lookup's tree, where it leaves room
            return lookup
        w = self._window(r, levels, columns)
        drafts = budget - columns * len(w.levels)  # the nodes the window leaves
        tree, children = DraftTree(weak=lookup.weak), {}
        w.looked_up = set()
        for path in tree_paths(lookup):  # the lookup's first, within what the pool's leave
            nodes = add_path(tree, children, path, drafts - pooled)
            w.looked_up.update(tuple(path[: k + 1]) for k in range(len(nodes)))
        for path in guessed:
            add_path(tree, children, path, drafts)
        proposed = []
        for path in w.column_paths():
            if len(add_path(tree, children, path, budget)) < len(path):
                break
            proposed.append(tuple(path))
        w.proposed = proposed
        self._add_recycled(tree, children, r, budget)
        return tree

    def _add_recycled(self, tree: DraftTree, children: dict, r: DraftRequest, budget: int) -> None:
        """The recycled tokens' tree from the last token (``recycled_paths`` along
        ``recycled_shape``), in what ``tree`` leaves of ``budget``."""
        if len(tree) >= budget or not len(self.recycled):
            return
        for path in recycled_paths(self.recycled, int(r.tokens[-1]), recycled_shape(budget, r.depth)).values():
            if len(tree) >= budget:
                break
            add_path(tree, children, path, budget)

    def verified(self, seq_id: int, tree: DraftTree, ranked: Sequence[Sequence[int]], path: Sequence[int]) -> None:
        """Learn from the pass that verified ``tree`` (which holds this drafter's last proposal
        for ``seq_id``, perhaps merged with others'): ``ranked[row]`` the target's best tokens at
        each chunk row (row 0 the last token, row i + 1 node i); ``path`` the accepted nodes.
        Every row's ranking is recycled, the accepted path's last (their context is the text's
        own); the window's columns take their top rows' best tokens."""
        root = self.roots.pop(seq_id, None)
        if root is not None:
            tokens = [root] + [int(t) for t in tree.tokens]
            on_path = [0] + [i + 1 for i in path]
            kept = set(on_path)
            for row in [row for row in range(min(len(ranked), len(tokens))) if row not in kept] + on_path:
                if row < len(ranked) and ranked[row]:
                    self.recycled.learn(tokens[row], ranked[row])
        w = self.windows.get(seq_id)
        if w is None or not w.proposed:
            return
        proposed, w.proposed = w.proposed, None
        paths = node_paths(tree)
        nodes = {p: i for i, p in enumerate(paths)}
        self.window_passes += 1
        self.guessed_accepted += sum(1 for i in path if paths[i] not in w.looked_up)
        tops = []
        for col_path in proposed:
            node = nodes.get(col_path)
            if node is None or node + 1 >= len(ranked) or not len(ranked[node + 1]):
                break
            tops.append(int(ranked[node + 1][0]))  # the column's top row's best token
        if tops and len(tops) == len(w.levels[0]):  # a cut window stays as it was
            for ngram in w.advance(tops):
                self.pool.add(ngram)

    def forget(self, seq_id: int) -> None:
        self.windows.pop(seq_id, None)
        self.roots.pop(seq_id, None)
        super().forget(seq_id)
