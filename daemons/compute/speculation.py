"""Speculative decoding: a drafter proposes the next tokens of a sequence cheaply, one pass of the
target verifies all of them, and every accepted token is a token the pass did not have to stream.

At batch 1 a streamed pass moves ~20 GB over the link to produce one token while the GPU idles;
verifying a few hundred drafted tokens in that pass costs little more. The engine asks a
``Drafter`` for a ``DraftTree`` per sequence and runs it as one tree chunk after the sequence's
last token (``batch.SeqChunk.parents``: each row sees the cached prefix and its own ancestors),
then ``verify_tree`` decides what the pass yields and the backend keeps the accepted path's KV
entries (``kv_keep``); the rejected branches' entries are left behind past the sequence's end,
where no later row sees them and the next pass overwrites them.

The tree's shape: a chain of the drafter's best tokens, depth D, and at each depth the next w - 1
candidates of the same draft distribution as leaves beside the chain node (they cost no extra
draft pass). A chain is the tree of width 1. ``TreeShape`` picks D and w from what it measures:
the rate at which the chain's token is accepted, the rate at which a sibling of rank r rescues a
rejected one, the verify pass's time and a draft depth's time; it takes the (D, w) within the
token budget that maximises expected tokens per second.

Acceptance (``verify_tree``). Drafts are deterministic (the drafter's best tokens), so the rule
that keeps the target's distribution p exactly at a node with children x1, x2, … (best first) is:
accept x1 with probability p(x1); otherwise remove x1 from p (renormalise) and try x2 the same
way; …; when every child is rejected, draw from what is left of p and stop. Each step asks "is the
draw x_k?" with its conditional probability given that it was none of x1..x_(k-1), so the token
chosen is distributed as p. After an accepted leaf, one more token is drawn from its row. With
temperature 0, p is the target's argmax: a child is accepted when it equals it, and the output is
token for token the target's greedy output.
"""

from __future__ import annotations

import math
import time
from collections import deque
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ntx.daemons.compute.backend import Pick, Picked
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.model import LlamaModel
from ntx.daemons.compute.sampler import Sampler
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import ModelIndex

__all__ = ["DraftTree", "DraftRequest", "Drafter", "PassDrafter", "SelfDrafter", "ModelDrafter", "TreeShape",
           "check_same_vocabulary", "verify_tree"]


@dataclass
class DraftTree:
    """Drafted tokens hanging off a sequence's last token: node i is ``tokens[i]``, child of node
    ``parents[i]`` (-1: of the last token); parents come first, and a node's children in the
    order they are tried (best first). The chain of best tokens is nodes 0..depth-1, so when all
    of it is accepted its KV entries are already where they belong."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # its best path came from a one-token match (the lookup's, on a ``weak`` request): counted
    # apart (``SpecCounts``), since such guesses are accepted less often than the others
    weak: bool = field(default=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def chunk_parents(self) -> tuple[int, ...]:
        """Parents as chunk rows (row 0 is the last token, row i + 1 is node i)."""
        return (-1, *(p + 1 for p in self.parents))


@dataclass(frozen=True)
class DraftRequest:
    """Draft ``depth`` tokens deep and ``width`` wide after ``tokens`` (the sequence so far,
    prompt and generated; the last one is not yet in the target's KV cache: it sits at position
    len(tokens) - 1). ``capacity``: the positions the sequence can ever reach (its cache size).
    ``weak``: the verify pass costs what a plain one does (``TreeShape.weak_pays``), so a draft
    accepted less often is still worth trying (the lookup then follows one-token matches, the
    lookahead adds its window: ``rows_free``)."""

    seq_id: int
    tokens: Sequence[int]
    depth: int
    width: int
    capacity: int
    weak: bool = False
    # the same condition, kept where a combined tree asks the lookup for strong matches only
    # (``CombinedDrafter``): the rows are free, so the lookahead's window of guesses rides along
    rows_free: bool = False


class Drafter(ABC):
    """Proposes draft trees for several sequences at once.

    ``depth_s`` is what the last ``propose`` says one draft depth costs, for ``TreeShape``: a
    model drafter's first pass after a verify also feeds what its cache has not seen (a new
    request's whole prompt), which is catch-up, not drafting, and must not count as depth."""

    name = "?"
    depth_s: float | None = None  # one draft depth in the last propose; None: nothing measured

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """For each request, a tree at most ``depth`` deep and ``width`` wide."""

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop whatever the drafter keeps for it."""

    # whether ``verified`` wants the target's best tokens at every row of a verify pass, and how
    # many of them a greedy row is to rank (its pick widened from the top-1: the token drawn is
    # still the best one, so greedy output does not change)
    learns_from_rows = False
    row_top_k = 1

    def verified(self, seq_id: int, tree: DraftTree, ranked: Sequence[Sequence[int]], path: Sequence[int]) -> None:
        """A pass verified ``tree`` for ``seq_id``: ``ranked[row]`` the target's best tokens at
        each chunk row, best first (row 0 the last token, row i + 1 node i; up to ``row_top_k``
        of them, at least one, none where the row had no finite logits), ``path`` the accepted
        nodes. Called only where ``learns_from_rows``."""

    def report(self) -> dict[str, int]:
        """What the drafter itself counts, for status's ``speculation`` (none by default)."""
        return {}


class PassDrafter(Drafter):
    """A drafter that runs a model: one batched pass per depth, whose top tokens give the chain
    and the siblings beside it."""

    caught_up = False  # set by ``_step``: this pass also fed tokens the drafter's cache had not seen

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """For each request, a chain of its best tokens ``depth`` deep with ``width - 1``
        alternatives beside each chain node (the next best of the same draft distribution)."""
        trees = [DraftTree() for _ in requests]
        alternatives: list[list[tuple[int, list[int]]]] = [[] for _ in requests]  # (parent, tokens)
        broken: set[int] = set()  # requests whose draft logits had no candidate (NaN): drafted no deeper
        depth = 0
        step_s: list[float] = []  # the draft depths timed: those that fed one token per sequence
        while True:
            todo = [i for i, r in enumerate(requests) if depth < r.depth and i not in broken]
            if not todo:
                break
            t0 = time.monotonic()
            self.caught_up = False
            picked = self._step([requests[i] for i in todo], depth, [trees[i].tokens for i in todo],
                                max(requests[i].width for i in todo))
            if not self.caught_up:
                step_s.append(time.monotonic() - t0)
            for i, pk in zip(todo, picked):
                best = [int(t) for t in pk.ids[: requests[i].width]]
                if not best:  # a wrong draft costs nothing; a drafter crash would cost the daemon
                    broken.add(i)
                    continue
                alternatives[i].append((depth - 1, best[1:]))
                trees[i].tokens.append(best[0])
                trees[i].parents.append(depth - 1)
            depth += 1
        self.depth_s = sum(step_s) / len(step_s) if step_s else None
        for tree, alts in zip(trees, alternatives):
            for parent, tokens in alts:
                tree.tokens.extend(tokens)
                tree.parents.extend([parent] * len(tokens))
        return trees

    @abstractmethod
    def _step(self, requests: list[DraftRequest], depth: int, chains: list[list[int]], k: int) -> list[Picked]:
        """One batched draft pass: for each request, the top-``k`` next tokens after its tokens
        and the ``depth`` chain tokens drafted so far (``chains``). Sets ``caught_up`` when it
        also fed tokens its cache had not seen (that pass's time is not a draft depth's)."""


class SelfDrafter(PassDrafter):
    """The target drafts for itself with its resident layers (all of them, or a chosen subset,
    less ``skip``: on SmolLM2 leaving out the two layers whose output is most like their input
    drafts 10x better than its first 15 layers, docs/PERFORMANCE.md) and its head: no bytes stream, and the drafted layers' KV entries are the target's own (the
    verify pass rewrites them at the same positions). The reference engine's self-speculation."""

    name = "self"

    def __init__(self, model: LlamaModel, layers: Sequence[int] | None = None, skip: Sequence[int] = ()) -> None:
        resident = sorted(model.resident)
        self.layers = sorted(set(resident if layers is None else layers) - set(skip))
        if not self.layers:
            raise ConfigError("--self-draft needs at least one resident layer to draft with")
        outside = [i for i in self.layers if i not in model.resident]
        if outside:
            raise ConfigError(f"--self-draft layers {outside} are not resident: a self-draft uses resident layers only")
        self.model = model

    def _step(self, requests, depth, chains, k):
        chunks = [SeqChunk(r.seq_id, len(r.tokens) - 1 + depth, (r.tokens[-1] if depth == 0 else chain[-1],))
                  for r, chain in zip(requests, chains)]
        return self.model.draft_forward(StepBatch(chunks), self.layers, [Pick(k)] * len(chunks))


class ModelDrafter(PassDrafter):
    """A small model with the target's vocabulary, all resident, with its own KV cache per
    sequence. It remembers which tokens its cache holds, so after a verify pass it feeds only
    what it has not seen (the accepted tokens past its last draft, and the correction)."""

    name = "model"

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.cached: dict[int, list[int]] = {}  # seq -> tokens whose KV entries the draft cache holds

    def _step(self, requests, depth, chains, k):
        chunks = []
        for r, chain in zip(requests, chains):
            if depth == 0:
                known = self._known(r)
                self.cached[r.seq_id] = list(r.tokens)
                chunks.append(SeqChunk(r.seq_id, known, tuple(r.tokens[known:])))  # at least the last token
                self.caught_up |= len(r.tokens) - known > 1
            else:
                self.cached[r.seq_id].append(chain[-1])
                chunks.append(SeqChunk(r.seq_id, len(r.tokens) - 1 + depth, (chain[-1],)))
        return self.model.forward(StepBatch(chunks), picks=[Pick(k)] * len(chunks))

    def _known(self, r: DraftRequest) -> int:
        """How many leading tokens of ``r`` the draft cache already holds (never all of them:
        the last one is fed to get the first draft)."""
        cached = self.cached.get(r.seq_id)
        if cached is None:
            self.model.backend.alloc_sequence(r.seq_id, r.capacity)
            return 0
        n = 0
        limit = min(len(cached), len(r.tokens) - 1)
        while n < limit and cached[n] == r.tokens[n]:
            n += 1
        return n

    def forget(self, seq_id: int) -> None:
        if self.cached.pop(seq_id, None) is not None:
            self.model.backend.free_sequence(seq_id)


def check_same_vocabulary(target: ModelIndex, draft: ModelIndex) -> None:
    """A draft model must tokenize exactly as the target does; one clear line otherwise."""
    t_tokens = target.metadata.get("tokenizer.ggml.tokens") or []
    d_tokens = draft.metadata.get("tokenizer.ggml.tokens") or []
    if target.hparams.n_vocab != draft.hparams.n_vocab or len(t_tokens) != len(d_tokens):
        raise ConfigError(
            f"--draft-model {draft.path}: its vocabulary has {draft.hparams.n_vocab} tokens, the target's "
            f"{target.hparams.n_vocab}: choose a draft model of the target's family (same tokenizer)"
        )
    for i, (a, b) in enumerate(zip(t_tokens, d_tokens)):
        if a != b:
            raise ConfigError(
                f"--draft-model {draft.path}: token {i} is {b!r} in the draft but {a!r} in the target: "
                "choose a draft model of the target's family (same tokenizer)"
            )


def verify_tree(tree: DraftTree, rows: list[Picked], sampler: Sampler, history: list[int]) -> tuple[list[int], list[int]]:
    """What one verify pass yields for a sequence: (tokens, path). ``path`` holds the accepted
    nodes from the root down; ``tokens`` their tokens and one more from the target (a draw from
    what is left at the first node none of whose children was accepted, or after an accepted
    leaf). ``rows[j]`` is the target's pick at chunk row j (row 0 the last token, row i + 1 node
    i); ``history`` the tokens before row 0's prediction (for the repetition penalty)."""
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]  # by row
    for i, p in enumerate(tree.parents):
        children[p + 1].append(i + 1)
    greedy = sampler.params.temperature == 0
    out: list[int] = []
    path: list[int] = []
    row = 0
    while True:
        ids, probs = sampler.distribution(rows[row], history + out)
        chosen = None
        if greedy:
            best = int(ids[0])
            chosen = next((c for c in children[row] if tree.tokens[c - 1] == best), None)
        else:
            probs = probs.copy()
            for c in children[row]:
                hit = ids == tree.tokens[c - 1]
                total = float(probs.sum())
                mass = float(probs[hit].sum())
                if mass > 0 and (mass >= total or sampler.uniform() * total < mass):
                    chosen = c
                    break
                probs[hit] = 0.0  # rejected: the rest of p, renormalised, for the next child
        if chosen is None:
            out.append(int(ids[0]) if greedy else sampler.draw(ids, probs))
            return out, path
        out.append(tree.tokens[chosen - 1])
        path.append(chosen - 1)
        row = chosen


@dataclass
class Acceptance:
    """How drafts fared, as running means: ``chain_rate``, how often the chain's node is accepted
    where it is tried; ``rescue_rate[r]``, how often the sibling of rank r (2, 3, …) is accepted
    when every better one was rejected; ``undrafted_passes``, passes in a row left undrafted since
    drafting was judged a loss. The engine keeps one per sequence (texts differ: a request that
    quotes its prompt accepts most drafts, a creative one few, and one must not switch drafting
    off or on for the other); ``TreeShape`` keeps the instance's, all sequences' together, which
    a new sequence starts from."""

    RESCUE_PRIOR = 0.2  # a sibling rank's rate until it is measured

    chain_rate: float = 0.6
    rescue_rate: dict[int, float] = field(
        default_factory=lambda: {r: Acceptance.RESCUE_PRIOR for r in TreeShape.WIDTHS[1:]})
    undrafted_passes: int = 0
    observed: int = 0  # verify passes learnt from
    nodes: int = 0  # chain nodes learnt from: the running mean's weight of the past grows with it
    probe_every: int = 0  # passes between probes while drafting is off (0: TreeShape.PROBE_EVERY)

    def rescue(self, rank: int) -> float:
        """``rescue_rate`` of sibling rank ``rank``: a tree wider than ``TreeShape.WIDTHS``
        (``--draft-width`` up to the budget) has ranks that start from the prior."""
        return self.rescue_rate.get(rank, self.RESCUE_PRIOR)

    def copy(self) -> Acceptance:
        """A new sequence's start: what the instance has measured, no pass of its own yet."""
        return Acceptance(self.chain_rate, dict(self.rescue_rate))


class TreeShape:
    """Chooses the draft tree's depth D and width w from measured acceptance and timings.

    Measured: acceptance (``Acceptance``: per sequence, and the instance's); ``verify_cost(rows)``,
    a pass with drafts by the rows it computes (``observe_times(verify_s=…, rows=…)``: a pass's
    cost grows with its rows where its layers are computed at the arithmetic's speed, the host's
    cores or a resident GPU layer at many rows, and where more rows move the cpu tier's layers
    onto the link: 1.12x a plain pass at 2 rows, 1.41x at 9 on the 70B at 24 GiB); ``plain_s``, a
    decode pass without (until measured, taken as the narrowest verify pass); ``depth_s``, one
    draft depth.
    Expected accepted tokens of (D, w):
        E = sum_{d=1..D} a^(d-1) (a + (1 - a) R_w),  a = chain_rate, R_w = 1 - prod_{r=2..w} (1 - rescue_r)
    and the pass yields E + 1 tokens in verify_cost(D w + 1 + other rows) + D depth_s. ``best``
    returns the (D, w) with D w <= the budget that maximises that rate, or (0, w) — no draft, one
    token per plain_s — when no tree pays for its drafting (every draft wrong: the drafter's time
    and the verify pass's extra rows are then all loss). A width given (``--draft-width``) leaves
    the depth to choose, up to budget / w. ``choose``, asked once per pass
    and sequence, follows ``best``; while drafting is off, ``shadow_probe`` says when the pass
    measures acceptance anyway, with a one-token draft beside it (no verify rows: on the 70B at
    24 GiB with the cpu tier a one-token verify pass cost 1.43x a plain one, so that probing by
    verify passes cost a sequence whose drafts were all wrong 7% of its speed), so that drafting
    resumes when it pays again. Running means start from a prior of weight ``PRIOR_NODES`` (the instance's rates for a new
    sequence), so that a sequence's first rejected nodes move its rate fast; later ones weigh
    ``1 - DECAY``. Priors stand in until the first measurements. ``fixed`` (benchmarks timing a
    given shape): every pass drafts the whole budget in a tree of the fixed width (a chain when
    auto), whatever was measured, so that what is timed is that shape and not the shape's
    judgement."""

    WIDTHS = (1, 2, 3, 4)
    DECAY = 0.9  # weight of the past in the running means, once past the prior's
    PRIOR_NODES = 2  # the prior's weight in a running mean, in observations
    PROBE_EVERY = 8  # passes between shadow probes of a dear drafter while drafting is off, at first
    PROBE_MAX = 64  # ... after rejected probes, at most
    SHADOW_FREE = 0.05  # a draft depth under this share of a plain pass: a shadow probe every undrafted pass
    REMEASURE_GAIN = 1.25  # drafting off though free verify passes would gain this much: costs measured again
    COST_SAMPLES = 4  # a verify pass's cost per row count: the least of its last 4 passes
    WEAK_FREE = 0.03  # a verify pass within 3% of a plain one: weak drafts are tried (weak_pays)
    # A sequence's first passes measure its own acceptance (drafted, or a shadow probe each),
    # whatever the instance measured, before drafting is judged a loss for it
    EXPLORE_PASSES = 2

    def __init__(self, budget: int, width: int | None = None, fixed: bool = False) -> None:
        self.budget = budget
        self.width = (width or 1) if fixed else width
        self.fixed = fixed
        self.acc = Acceptance()  # the instance's
        self.verify_s = 1.0  # priors, replaced by the first measurement (all rows together)
        self.verify_by_rows: dict[int, float] = {}  # rows of a verify pass -> its cost (the least of recent ones)
        self._verify_samples: dict[int, deque[float]] = {}
        self._stale_passes = 0  # undrafted passes for the verify passes' cost alone (choose)
        self._remeasure_every = 0
        self.depth_s = 0.1
        self.plain_s: float | None = None
        self.timed = set()  # which of the times were measured

    def _mean(self, old: float, new: float) -> float:
        return self.DECAY * old + (1 - self.DECAY) * new

    def _learn(self, acc: Acceptance, old: float, new: float) -> float:
        """``acc``'s running mean moved towards ``new``: its past (a prior of ``PRIOR_NODES``
        observations, then each node it learnt from) weighs as much as it holds, up to ``DECAY``."""
        weight = min(self.DECAY, (acc.nodes + self.PRIOR_NODES) / (acc.nodes + self.PRIOR_NODES + 1))
        return weight * old + (1 - weight) * new

    def verify_cost(self, rows: int, other_rows: int = 0) -> float:
        """A pass of ``rows`` rows with drafts, in seconds: measured at those rows; else linear
        between the nearest measured row counts around it, a plain pass (``plain_s``) standing
        for one of ``1 + other_rows`` rows; beyond the widest, the widest's cost (a wider pass is
        tried at that cost once, then known; so is a jump between two measured counts, as at the
        cpu tier's ``WIDE_PASS_ROWS``); below the narrowest, the narrowest's; with no width
        measured, the mean of every verify pass (``verify_s``: the prior until the first)."""
        if not self.verify_by_rows:
            return self.verify_s
        known = dict(self.verify_by_rows)
        if self.plain_s is not None:
            known.setdefault(1 + other_rows, self.plain_s)
        if rows in known:
            return known[rows]
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        if below or above:
            return known[max(below) if below else min(above)]
        return self.verify_s

    def expected_accepted(self, depth: int, width: int, acc: Acceptance | None = None) -> float:
        acc = acc or self.acc
        a = min(acc.chain_rate, 0.999)
        rescue = 1.0 - math.prod(1.0 - acc.rescue(r) for r in range(2, width + 1))
        return (a + (1 - a) * rescue) * (1 - a ** depth) / (1 - a)

    def weak_pays(self, rows: int, other_rows: int = 0) -> bool:
        """Whether a verify pass of ``rows`` rows (``other_rows`` of them other sequences')
        costs within ``WEAK_FREE`` of a plain pass, by what was measured (or the shape is
        fixed, as where that is so): a weak draft (``DraftRequest.weak``) then costs nothing
        when wrong. On the 70B at 24 GiB with every streamed layer over the link, a chain of 8
        verified in 340.4 ms against 341.1 for a plain pass; on the CPU a 9-row pass costs more,
        and the weak drafts that raised tokens a pass there cost wall time (docs/PERFORMANCE.md)."""
        if self.fixed:
            return True
        if self.plain_s is None or not self.verify_by_rows:
            return False
        plain_s = self.plain_s
        if other_rows:
            plain_s = max(plain_s, self.verify_cost(1 + other_rows, other_rows))
        return self.verify_cost(rows + other_rows, other_rows) <= (1 + self.WEAK_FREE) * plain_s

    def best(self, acc: Acceptance | None = None, other_rows: int = 0) -> tuple[int, int]:
        """The shape that yields most tokens per second by what was measured (for ``acc``'s
        sequence; None: the instance's), its pass computing ``other_rows`` rows of other
        sequences besides; depth 0: none."""
        return self._best(acc, other_rows)[0]

    def _best(self, acc: Acceptance | None, other_rows: int, free: bool = False) -> tuple[tuple[int, int], float]:
        """``best``'s shape and its gain: tokens per second against a plain pass's. ``free``:
        as if a verify pass cost no more than a plain one (what drafting would gain by the
        acceptance alone)."""
        if self.fixed:
            return (max(1, self.budget // self.width), self.width), 1.0
        if self.width is not None:  # the width given: the depth is chosen
            shapes = [(d, self.width) for d in range(1, max(1, self.budget // self.width) + 1)]
        else:
            shapes = [(d, w) for w in self.WIDTHS for d in range(1, self.budget // w + 1)]
        acc = acc or self.acc
        plain_s = self.plain_s or self.verify_cost(1 + other_rows)  # not timed: the narrowest verify pass's
        if other_rows:  # a pass of the others' rows costs that much undrafted too
            plain_s = max(plain_s, self.verify_cost(1 + other_rows, other_rows))
        best, best_score = (0, shapes[0][1]), 1.0 / plain_s
        for d, w in shapes:
            verify_s = plain_s if free else self.verify_cost(d * w + 1 + other_rows, other_rows)
            score = (self.expected_accepted(d, w, acc) + 1) / (verify_s + d * self.depth_s)
            if score > best_score:
                best, best_score = (d, w), score
        return best, best_score * plain_s

    def choose(self, acc: Acceptance | None = None, other_rows: int = 0) -> tuple[int, int]:
        """This pass's shape for ``acc``'s sequence (None: the instance's): ``best``; depth 0
        when no tree pays (``shadow_probe`` then says whether the pass measures acceptance
        anyway). Until a plain pass was timed (``plain_s``), one is taken as costing what the
        narrowest verify pass does, and a tree expected to yield less than one accepted token
        waits for a plain pass, taken then, to be weighed against. Where drafting is off for
        its verify passes' cost alone (at no cost it would gain ``REMEASURE_GAIN``: the
        acceptance is there), the shape that would pay is drafted now and then, ``PROBE_EVERY``
        undrafted passes at first, twice as many after each that still did not pay: the costs
        are measured again (a pass's one-time costs, the cpu tier's first wide pass say, and a
        machine busy for a while must not switch drafting off for good)."""
        acc = acc or self.acc
        depth, width = self.best(acc, other_rows)
        if self.fixed:
            return depth, width
        if self.plain_s is None and (depth == 0 or self.expected_accepted(depth, width, acc) < 1.0):
            return 0, width  # drafting in doubt: a pass without drafts, to time what not drafting costs
        if depth > 0:
            acc.undrafted_passes, acc.probe_every = 0, 0
            self._stale_passes, self._remeasure_every = 0, 0
            return depth, width
        (free_depth, free_width), gain = self._best(acc, other_rows, free=True)
        if free_depth > 0 and gain >= self.REMEASURE_GAIN:
            self._stale_passes += 1
            if self._stale_passes >= (self._remeasure_every or self.PROBE_EVERY):
                self._stale_passes = 0
                self._remeasure_every = min(self.PROBE_MAX, 2 * (self._remeasure_every or self.PROBE_EVERY))
                return free_depth, free_width
        return 0, width

    def shadow_probe(self, acc: Acceptance | None = None) -> bool:
        """Whether an undrafted pass of ``acc``'s sequence (None: the instance's) carries a
        shadow probe: a one-token draft proposed beside the pass, not put in it, and compared
        with the token the pass yields (accepted where they are the same: for a sampled token,
        with the probability p(x) that speculative sampling accepts a one-token draft x with).
        It measures acceptance at the drafter's cost alone, no verify pass's rows: every
        undrafted pass where one draft depth costs under ``SHADOW_FREE`` of a plain pass (the
        lookup drafters, the replay) and in a sequence's first ``EXPLORE_PASSES`` (its text may
        quote its prompt and accept far more than the instance's mean, which it starts from),
        else after ``PROBE_EVERY`` undrafted passes, twice as many after each probe whose token
        was not the pass's (``PROBE_MAX`` at most; an accepted one starts again from
        ``PROBE_EVERY``)."""
        acc = acc or self.acc
        if self.fixed:
            return False
        plain_s = self.plain_s or self.verify_cost(1)
        if acc.observed < self.EXPLORE_PASSES or ("depth" in self.timed and self.depth_s <= self.SHADOW_FREE * plain_s):
            return True
        acc.undrafted_passes += 1
        if acc.undrafted_passes >= (acc.probe_every or self.PROBE_EVERY):
            acc.undrafted_passes = 0
            acc.probe_every = min(self.PROBE_MAX, 2 * (acc.probe_every or self.PROBE_EVERY))
            return True
        return False

    def observe(self, tree: DraftTree, path: list[int], acc: Acceptance | None = None) -> None:
        """Learn from one verified tree (into ``acc``, its sequence's, and the instance's): at
        each node the pass reached, was the chain's child accepted, or which sibling rank."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p, []).append(i)
        for target in [self.acc] + ([acc] if acc is not None and acc is not self.acc else []):
            target.observed += 1
            node = -1
            for nxt in path + [None]:
                kids = children.get(node, [])
                if not kids:
                    break
                rank = kids.index(nxt) + 1 if nxt in kids else None
                target.chain_rate = self._learn(target, target.chain_rate, 1.0 if rank == 1 else 0.0)
                for r in range(2, len(kids) + 1):  # siblings tried after a rejected chain node
                    if rank == 1:
                        break
                    target.rescue_rate[r] = self._learn(target, target.rescue(r), 1.0 if rank == r else 0.0)
                    if rank == r:
                        break
                target.nodes += 1
                if nxt is None:
                    break
                node = nxt
            if path:  # a token taken: probes, if drafting goes off again, start again from PROBE_EVERY
                target.probe_every = 0

    def observe_times(self, verify_s: float | None = None, depth_s: float | None = None,
                      plain_s: float | None = None, rows: int | None = None) -> None:
        """Running means of the times measured: ``verify_s`` a verify pass of ``rows`` rows (None:
        rows not known, only the mean of all), ``depth_s`` a draft depth, ``plain_s`` a decode
        pass without drafts."""
        for name, value in (("verify", verify_s), ("depth", depth_s), ("plain", plain_s)):
            if value is None:
                continue
            old = getattr(self, f"{name}_s")
            setattr(self, f"{name}_s", self._mean(old, value) if name in self.timed else value)
            self.timed.add(name)
        if verify_s is not None and rows is not None:  # the least of recent passes: one-time costs drop out
            recent = self._verify_samples.setdefault(rows, deque(maxlen=self.COST_SAMPLES))
            recent.append(verify_s)
            self.verify_by_rows[rows] = min(recent)
