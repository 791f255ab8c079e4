"""Drafting without a draft model: continuations looked up in text already seen.

Prompt lookup (``--draft ngram``): the last few tokens of a sequence often occurred earlier in
it (a summary quotes its document, an edited file repeats the original, a chat quotes earlier
turns), and what followed them then is a good guess of what follows now. ``LookupDrafter``
finds the longest such suffix (``MAX_NGRAM`` down to ``MIN_NGRAM`` tokens) and proposes the
tokens after its most recent earlier occurrence. With ``--draft suffix`` it also looks in the
instance's recent sequences (``RecentText``, bounded to ``HISTORY_TOKENS``): repeated tasks and
agent loops repeat whole passages across requests, as SuffixDecoding exploits.

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
from typing import Sequence

from ntx.daemons.compute.speculation import DraftRequest, Drafter, DraftTree

MIN_NGRAM, MAX_NGRAM = 2, 5  # suffix lengths looked up; one token alone matches too much to pay
HISTORY_TOKENS = 1 << 16  # the instance's recent text that --draft suffix searches (about 30 MiB of index)


class NgramIndex:
    """Where each n-gram (``MIN_NGRAM``-``MAX_NGRAM`` tokens) of a token sequence last ended,
    grown as the sequence grows. ``continuations`` gives what followed the earlier occurrences
    of a query suffix."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token
        self.indexed = 0  # n-grams ending before this position are in last_end

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Take ``tokens`` (which start with the tokens seen so far) and index the n-grams that
        end before ``upto``."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[-1]):
            self.__init__()  # another sequence under the same id: start over
            n = 0
        self.tokens.extend(tokens[n:])
        t = self.tokens
        for end in range(self.indexed, min(upto, len(t))):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.last_end[tuple(t[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, min(upto, len(t)))

    def continuation(self, suffix: tuple[int, ...], depth: int) -> list[int]:
        """The tokens that followed the last indexed occurrence of ``suffix`` (at most ``depth``)."""
        end = self.last_end.get(suffix)
        if end is None:
            return []
        return self.tokens[end + 1 : end + 1 + depth]


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

    def continuations(self, suffix: tuple[int, ...], depth: int) -> list[list[int]]:
        """Continuations of ``suffix`` in the recent sequences, newest first."""
        out = []
        for idx in reversed(self.seqs):
            c = idx.continuation(suffix, depth)
            if c:
                out.append(c)
        return out


def tree_of_paths(paths: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """One tree holding ``paths`` (root-to-leaf token lists, best first) with shared prefixes
    merged, at most ``max_nodes`` nodes: a path that does not fit whole is cut where it does."""
    tree = DraftTree()
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for path in paths:
        parent = -1
        for tok in path:
            node = children.get((parent, tok))
            if node is None:
                if len(tree) >= max_nodes:
                    break
                node = len(tree)
                tree.tokens.append(int(tok))
                tree.parents.append(parent)
                children[(parent, tok)] = node
            parent = node
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
    sequences too (``suffix``): up to ``width`` distinct continuations, ``depth`` deep, as one tree."""

    def __init__(self, kind: str = "ngram", recent: RecentText | None = None) -> None:
        self.name = kind
        self.recent = recent if recent is not None else (RecentText() if kind == "suffix" else None)
        self.own: dict[int, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        self.depth_s = 0.0  # an index lookup: no pass
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> DraftTree:
        idx = self.own.setdefault(r.seq_id, NgramIndex())
        idx.extend(r.tokens, len(r.tokens) - 1)  # n-grams ending before the last token: the query's own end excluded
        paths: list[list[int]] = []
        for n in range(min(MAX_NGRAM, len(r.tokens)), MIN_NGRAM - 1, -1):
            suffix = tuple(r.tokens[-n:])
            found = [idx.continuation(suffix, r.depth)]
            if self.recent is not None:
                found += self.recent.continuations(suffix, r.depth)
            for c in found:
                if c and c not in paths:
                    paths.append(c)
            if len(paths) >= r.width:
                break
        return tree_of_paths(paths[: r.width], r.depth * r.width)

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
        lookup_trees = self.lookup.propose(requests)
        return [tree_of_paths(tree_paths(lk) + tree_paths(md), r.depth * r.width)
                for r, md, lk in zip(requests, model_trees, lookup_trees)]

    def forget(self, seq_id: int) -> None:
        self.inner.forget(seq_id)
        self.lookup.forget(seq_id)
