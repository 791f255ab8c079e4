"""Drafting without a draft model: continuations looked up in text already seen.

Prompt lookup (``--draft ngram``): the last few tokens of a sequence often occurred earlier in
it (a summary quotes its document, an edited file repeats the original, a chat quotes earlier
turns), and what followed them then is a good guess of what follows now. ``LookupDrafter``
finds the longest such suffix (``MAX_NGRAM`` down to ``MIN_NGRAM`` tokens) and proposes what
most often followed it (the earliest among equals), looking again after each drafted token
(``NgramIndex``). Where a verify pass costs what a plain one does (a streamed model's: its
layers' copy, not its rows, sets the time; ``DraftRequest.weak``), the last token alone is
looked up too (``WEAK_NGRAM``): a draft accepted less often, but free to try. With ``--draft
suffix`` it also looks in the instance's recent sequences (``RecentText``, bounded to
``HISTORY_TOKENS``): repeated tasks and agent loops repeat whole passages across requests, as
SuffixDecoding exploits.

Proposals cost no pass: an index lookup per sequence. A tree of width w holds up to w distinct
continuations, from the sequence itself first, longest match first, then the recent sequences,
merged where they share a prefix. An empty proposal (no match) leaves the sequence to a one-token
pass.

``CombinedDrafter`` puts a model drafter's tree (``--draft-model`` or ``--self-draft``) and the
lookup's continuations into one tree: each is a set of root-to-leaf paths, and the merged tree
verifies all of them in the same pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Sequence

from ntx.daemons.compute.speculation import DraftRequest, Drafter, DraftTree

MIN_NGRAM, MAX_NGRAM = 2, 5  # suffix lengths looked up; one token alone matches too much to pay ...
# ... except where a verify pass is free (DraftRequest.weak): SmolLM2 on the repo's nine texts,
# fixed chains of 8 (CPU), 1.536 -> 1.770 tokens a decode pass summarising, 2.209 -> 2.436 editing,
# 5.500 -> 5.923 in the chat, with fewer accepted per verify pass (more passes draft)
WEAK_NGRAM = 1
HISTORY_TOKENS = 1 << 16  # the recent text that --draft suffix searches (about 32 MiB of index for English prose)


_FIRST_BITS = 32  # a continuation's record: its count above these bits, where it first followed below
_FIRST_MASK = (1 << _FIRST_BITS) - 1


def _rank(record: int) -> tuple[int, int]:
    """A continuation's place among its n-gram's: the most frequent first, then the earliest."""
    return -(record >> _FIRST_BITS), record & _FIRST_MASK


class NgramIndex:
    """What followed each n-gram (``MIN_NGRAM``-``MAX_NGRAM`` tokens) of a token sequence, grown
    as the sequence grows: for each n-gram, each token that followed it, how often, and where it
    first did.

    A draft follows the most frequent continuation of the longest n-gram that ends the text so
    far, and asks again after each drafted token (``walk``) rather than copying one occurrence on:
    where an n-gram occurred several times each step takes what usually followed, and a repeating
    pattern (a count, a table's rows) goes on past the end of the text. Among continuations seen
    as often, the earliest wins: the source (a prompt's document, the original file, the
    earlier turn) over a copy made of it since, which is the model's own and may differ from it.
    On the repo's drafting tasks (scripts/draft_acceptance.py, greedy SmolLM2 outputs replayed
    offline at depth 8), frequency then earliest accepted 2.48 tokens a verify pass over the seven
    texts, where the last occurrence copied on accepted 2.29, and yielded more tokens a pass on six
    of them (the seventh: 1.214 against 1.223); on three held-out texts the two tied (2.06 against
    2.10). The branches of a wider tree are the same n-gram's other continuations, which is where
    the change pays most (docs/PERFORMANCE.md, "Acceptance on real text: drafting without a model")."""

    def __init__(self, min_n: int = MIN_NGRAM) -> None:
        self.min_n = min_n  # the shortest n-grams indexed (WEAK_NGRAM: a sequence's own index)
        self.tokens: list[int] = []
        # n-gram -> its one continuation's record, or {token: record} once two tokens followed it;
        # a record is count << _FIRST_BITS | the n-gram's end where that token first followed it
        self.next: dict[tuple[int, ...], int | dict[int, int]] = {}
        self.indexed = 0  # n-grams ending before this position are in ``next``

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Take ``tokens`` (which start with the tokens seen so far) and index the n-grams that
        end before ``upto`` (and before the last token: each needs the token after it)."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[-1]):
            self.__init__(self.min_n)  # another sequence under the same id: start over
            n = 0
        self.tokens.extend(tokens[n:])
        t, nxt, one = self.tokens, self.next, 1 << _FIRST_BITS
        stop = min(upto, len(t) - 1)
        for end in range(self.indexed, stop):
            follower = t[end + 1]
            for n in range(self.min_n, min(MAX_NGRAM, end + 1) + 1):
                key = tuple(t[end + 1 - n : end + 1])
                rec = nxt.get(key)
                if rec is None:
                    nxt[key] = one | end
                elif isinstance(rec, dict):
                    rec[follower] = rec.get(follower, end) + one
                elif t[(rec & _FIRST_MASK) + 1] == follower:
                    nxt[key] = rec + one
                else:
                    nxt[key] = {t[(rec & _FIRST_MASK) + 1]: rec, follower: one | end}
        self.indexed = max(self.indexed, stop)

    def _ranked(self, rec: int | dict[int, int]) -> list[int]:
        """The continuations a record holds, the most frequent first, then the earliest."""
        if not isinstance(rec, dict):
            return [self.tokens[(rec & _FIRST_MASK) + 1]]
        return sorted(rec, key=lambda tok: _rank(rec[tok]))

    def _best(self, rec: int | dict[int, int]) -> int:
        """``_ranked(rec)[0]`` without sorting the others."""
        if not isinstance(rec, dict):
            return self.tokens[(rec & _FIRST_MASK) + 1]
        return min(rec, key=lambda tok: _rank(rec[tok]))

    def candidates(self, tail: Sequence[int], min_n: int = MIN_NGRAM) -> list[tuple[int, int]]:
        """The tokens that followed n-grams (of ``min_n`` tokens or more) ending ``tail``, each
        with the length of the longest such n-gram: the longest n-gram's first, ranked, then the
        shorter ones' not yet named."""
        out: list[tuple[int, int]] = []
        for n in range(min(MAX_NGRAM, len(tail)), max(min_n, self.min_n) - 1, -1):
            rec = self.next.get(tuple(tail[len(tail) - n:]))
            if rec is not None:
                out += [(n, tok) for tok in self._ranked(rec) if all(tok != t for _, t in out)]
        return out

    def best(self, tail: Sequence[int], min_n: int = MIN_NGRAM) -> tuple[int, int] | None:
        """``candidates(tail, min_n)[0]`` without the others: (n-gram length, token), or None."""
        for n in range(min(MAX_NGRAM, len(tail)), max(min_n, self.min_n) - 1, -1):
            rec = self.next.get(tuple(tail[len(tail) - n:]))
            if rec is not None:
                return n, self._best(rec)
        return None

    def walk(self, tail: Sequence[int], first: int, depth: int, min_n: int = MIN_NGRAM) -> list[int]:
        """``first``, then each token the longest seen n-gram (of ``min_n`` tokens or more) ending
        the text (``tail`` and the tokens drafted so far) was most often followed by, until
        ``depth`` tokens or none is seen."""
        seq = list(tail[max(0, len(tail) - MAX_NGRAM):]) + [first]
        out = [first]
        while len(out) < depth:
            hit = self.best(seq, min_n)
            if hit is None:
                break
            out.append(hit[1])
            seq.append(hit[1])
        return out


class RecentText:
    """The instance's recent sequences (prompt and output), newest last, each with its n-gram
    index, at most ``HISTORY_TOKENS`` tokens in all: what ``--draft suffix`` searches besides the
    sequence itself."""

    def __init__(self, max_tokens: int = HISTORY_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.seqs: deque[NgramIndex] = deque()  # oldest first
        self.n_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) <= MIN_NGRAM:
            return
        idx = NgramIndex()
        tokens = list(tokens)[-self.max_tokens:]
        idx.extend(tokens, len(tokens))
        self.seqs.append(idx)
        self.n_tokens += len(tokens)
        while self.n_tokens > self.max_tokens:
            self.n_tokens -= len(self.seqs.popleft().tokens)

    def continuations(self, tail: Sequence[int], depth: int, limit: int) -> list[tuple[int, list[int]]]:
        """The best continuations of ``tail`` in at most ``limit`` recent sequences, each with the
        length of the n-gram it matched: the longest matches first, the newest first among equals.
        Only those are walked (a common n-gram can match in hundreds of short sequences)."""
        found = []
        for idx in reversed(self.seqs):
            hit = idx.best(tail)
            if hit is not None:
                found.append((*hit, idx))
        found.sort(key=lambda f: -f[0])  # stable: newest first among equals
        return [(n, idx.walk(tail, tok, depth)) for n, tok, idx in found[:limit]]


def add_path(tree: DraftTree, children: dict[tuple[int, int], int], path: Sequence[int], max_nodes: int) -> list[int]:
    """Add ``path`` (tokens from the root) to ``tree``, sharing the nodes it already has
    (``children``: (parent node, token) -> node, kept with the tree), at most ``max_nodes`` nodes
    in all: the path's nodes, up to where the budget cut it."""
    nodes, parent = [], -1
    for tok in path:
        node = children.get((parent, tok))
        if node is None:
            if len(tree) >= max_nodes:
                break
            node = len(tree)
            tree.tokens.append(int(tok))
            tree.parents.append(parent)
            children[(parent, tok)] = node
        nodes.append(node)
        parent = node
    return nodes


def tree_of_paths(paths: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """One tree holding ``paths`` (root-to-leaf token lists, best first) with shared prefixes
    merged, at most ``max_nodes`` nodes: a path that does not fit whole is cut where it does."""
    tree = DraftTree()
    children: dict[tuple[int, int], int] = {}
    for path in paths:
        add_path(tree, children, path, max_nodes)
    return tree


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """The root-to-leaf token paths of ``tree``, in node order of their leaves."""
    has_child = set(tree.parents)
    out = []
    for leaf in range(len(tree)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node != -1:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        out.append(path[::-1])
    return out


class LookupDrafter(Drafter):
    """Prompt lookup over each sequence's own tokens (``ngram``), and over the instance's recent
    sequences too (``suffix``): up to ``width`` distinct continuations, ``depth`` deep, as one tree.
    A request marked ``weak`` (a verify pass as cheap as a plain one) also follows a match of the
    last token alone, in the sequence's own text (the recent text's one-token matches would be
    anyone's)."""

    def __init__(self, kind: str = "ngram", recent: RecentText | None = None) -> None:
        self.name = kind
        self.recent = recent if recent is not None else (RecentText() if kind == "suffix" else None)
        self.own: dict[int, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        self.depth_s = 0.0  # an index lookup: no pass
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> DraftTree:
        idx = self.own.get(r.seq_id)
        if idx is None:
            idx = self.own[r.seq_id] = NgramIndex(min_n=WEAK_NGRAM)
        idx.extend(r.tokens, len(r.tokens) - 1)  # n-grams ending before the last token: the query's own end excluded
        tail = r.tokens[max(0, len(r.tokens) - MAX_NGRAM):]
        min_n = WEAK_NGRAM if r.weak else MIN_NGRAM
        # (matched length, path): the sequence's own continuations, then the recent text's; the
        # longest match first, the sequence's own first among equals (a stable sort)
        found = [(n, idx.walk(tail, tok, r.depth, min_n)) for n, tok in idx.candidates(tail, min_n)[: r.width]]
        if self.recent is not None:
            found += self.recent.continuations(tail, r.depth, r.width)
        found.sort(key=lambda f: -f[0])
        paths: list[list[int]] = []
        for _, path in found:
            if path not in paths:
                paths.append(path)
        tree = tree_of_paths(paths[: r.width], r.depth * r.width)
        tree.weak = bool(found) and found[0][0] < MIN_NGRAM
        return tree

    def forget(self, seq_id: int) -> None:
        idx = self.own.pop(seq_id, None)
        if idx is not None and self.recent is not None:
            self.recent.add(idx.tokens)


class CombinedDrafter(Drafter):
    """A model drafter's tree and the lookup's continuations as one tree: the lookup's paths
    first (they cost nothing and, where they exist, are usually long), then the model's, within
    the request's node budget. ``inner``: the model drafter (its passes are warmed up and timed)."""

    def __init__(self, inner: Drafter, lookup: LookupDrafter) -> None:
        self.inner = inner
        self.lookup = lookup
        self.name = f"{inner.name}+{lookup.name}"

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        model_trees = self.inner.propose(requests)
        self.depth_s = self.inner.depth_s
        # the model's drafts before a one-token match's guess: the lookup drafts strong matches only
        lookup_trees = self.lookup.propose([replace(r, weak=False) for r in requests])
        return [tree_of_paths(tree_paths(lk) + tree_paths(md), r.depth * r.width)
                for r, md, lk in zip(requests, model_trees, lookup_trees)]

    @property
    def learns_from_rows(self) -> bool:
        return self.inner.learns_from_rows or self.lookup.learns_from_rows

    @property
    def row_top_k(self) -> int:
        return max(self.inner.row_top_k, self.lookup.row_top_k)

    def verified(self, seq_id, tree, ranked, path) -> None:
        for drafter in (self.inner, self.lookup):
            if drafter.learns_from_rows:
                drafter.verified(seq_id, tree, ranked, path)

    def report(self) -> dict[str, int]:
        return {**self.inner.report(), **self.lookup.report()}

    def forget(self, seq_id: int) -> None:
        self.inner.forget(seq_id)
        self.lookup.forget(seq_id)
