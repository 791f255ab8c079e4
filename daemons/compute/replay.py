"""The replay drafter: a benchmark's drafter of controlled acceptance, not a way to generate.

Real draft/target pairs accept a few tokens per pass, and how many depends on the pair and the
text; synthetic models (random weights) accept nothing from each other. To measure the
speculation machinery at the acceptance lengths real pairs reach, ``ReplayDrafter`` proposes the
target's own greedy continuation, recorded from a plain run, with each proposed token made wrong
(a different token id) with probability ``p_wrong``, independently: under greedy verification a
pass then accepts i tokens with probability (1-p)^i p, so the expected acceptance length of a
draft of K tokens is sum_{i=1..K} (1-p)^i.

It can wrap another drafter (``inner``), run first on every request so that its cost (a resident
1B-shaped draft model, say) is paid in full; its proposals are discarded. Wherever its figures
are printed they are labelled ``replay``, because they are not a real pair's.

The recorded continuations live in a JSON file (``write_references`` / ``load_references``):
``{"sequences": [[token id, ...], ...]}``, each sequence a prompt and its greedy continuation.

A real drafter's acceptance is not geometric: a prompt lookup drafts long runs where the model
quotes and nothing where it does not. The file may also hold ``"trace": [[drafted, accepted],
...]``, a real drafter's passes in order (scripts/draft_acceptance.py ``--trace-out`` records
them on real text). With a trace, each sequence's n-th proposal is the recording's next
``accepted`` tokens followed by ``drafted - accepted`` wrong ones (nothing where it drafted
nothing), the trace starting over when it runs out, and ``p_wrong`` is not used: a target
model, a synthetic one too, then verifies exactly the real drafter's pattern of passes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ntx.daemons.compute.speculation import DraftRequest, Drafter, DraftTree
from ntx.shared.errors import ConfigError

__all__ = ["ReplayDrafter", "load_references", "load_trace", "write_references"]


def write_references(path: str | os.PathLike, sequences: Sequence[Sequence[int]],
                     trace: Sequence[Sequence[int]] | None = None) -> None:
    """Store prompt + greedy continuation token sequences for ``load_references`` (and a trace of
    (drafted, accepted) passes for ``load_trace``)."""
    doc: dict = {"sequences": [[int(t) for t in s] for s in sequences]}
    if trace is not None:
        doc["trace"] = [[int(d), int(a)] for d, a in trace]
    Path(path).write_text(json.dumps(doc))


def load_trace(path: str | os.PathLike, what: str = "--draft-replay") -> list[tuple[int, int]] | None:
    """The (drafted, accepted) passes a replay or trace file holds, None if it holds none; one
    clear line if they are not pairs of counts with 0 <= accepted <= drafted, or none at all."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path}: cannot read it as JSON ({e})") from None
    trace = doc.get("trace") if isinstance(doc, dict) else None
    if trace is None:
        return None
    if not isinstance(trace, list) or not trace or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in p)
        and 0 <= p[1] <= p[0] for p in trace
    ):
        raise ConfigError(f"{what} {path}: \"trace\" must be a non-empty list of [drafted, accepted] counts, "
                          "0 <= accepted <= drafted")
    return [(d, a) for d, a in trace]


def trace_tokens(trace: list[tuple[int, int]], k: int) -> int:
    """The tokens a request generates replaying ``trace`` once, each pass cut to chains of at most
    ``k``: the prefill's token, then each pass's accepted tokens and the one its verify pass adds."""
    return 1 + sum(min(a, d, k) + 1 for d, a in trace)


def load_references(path: str | os.PathLike) -> list[tuple[int, ...]]:
    """The token sequences of a replay file; one clear line if it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--draft-replay {path}: cannot read it as JSON ({e})") from None
    seqs = doc.get("sequences") if isinstance(doc, dict) else None
    if not isinstance(seqs, list) or not all(
        isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in s) for s in seqs
    ):
        raise ConfigError(f"--draft-replay {path}: expected {{\"sequences\": [[token id, ...], ...]}}")
    return [tuple(s) for s in seqs]


class ReplayDrafter(Drafter):
    """Proposes the recorded continuation of the sequence whose prefix equals the request's
    tokens (nothing when no recording extends them), each token independently replaced by a
    different id with probability ``p_wrong``, deterministically from ``seed``; or, given a
    ``trace``, each sequence's passes drafted and accepted as the trace says (module docstring)."""

    name = "replay"

    def __init__(self, references: Sequence[Sequence[int]], p_wrong: float, n_vocab: int, *, seed: int = 0,
                 inner: Drafter | None = None, trace: Sequence[tuple[int, int]] | None = None) -> None:
        if n_vocab < 2:
            raise ConfigError("a replay drafter needs a vocabulary of at least 2 tokens to make a token wrong")
        self.references = [tuple(r) for r in references]
        self.p_wrong = p_wrong
        self.n_vocab = n_vocab
        self.inner = inner
        self.rng = np.random.default_rng(seed)
        self.trace = list(trace) if trace else None
        self.trace_at: dict[int, int] = {}  # seq_id -> its next pass's index in the trace

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """Chains ``depth`` long at most (the recording has one continuation: width is not used)."""
        t0 = time.monotonic()
        if self.inner is not None:
            self.inner.propose(requests)  # its cost is the point; its guesses are not
        trees = [self._traced(r) if self.trace else
                 DraftTree.chain([self._maybe_wrong(t) for t in self._continuation(r.tokens)[: r.depth]])
                 for r in requests]
        self.depth_s = (self.inner.depth_s if self.inner is not None
                        else (time.monotonic() - t0) / max(1, max((r.depth for r in requests), default=1)))
        return trees

    def _traced(self, r: DraftRequest) -> DraftTree:
        """The sequence's next pass of the trace: ``accepted`` recorded tokens, then wrong ones up
        to ``drafted`` (both cut to the request's depth and to what the recording holds, so that
        the first wrong token is known to be wrong)."""
        at = self.trace_at.get(r.seq_id, 0)
        self.trace_at[r.seq_id] = at + 1
        drafted, accepted = self.trace[at % len(self.trace)]
        cont = self._continuation(r.tokens)
        drafted = min(drafted, r.depth, len(cont))
        accepted = min(accepted, drafted)
        return DraftTree.chain(list(cont[:accepted]) + [self._wrong(t) for t in cont[accepted:drafted]])

    def _continuation(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """What the first recording that starts with ``tokens`` holds after them."""
        prefix = tuple(tokens)
        n = len(prefix)
        for ref in self.references:
            if len(ref) > n and ref[:n] == prefix:
                return ref[n:]
        return ()

    def _maybe_wrong(self, tok: int) -> int:
        if self.rng.random() >= self.p_wrong:
            return tok
        return self._wrong(tok)

    def _wrong(self, tok: int) -> int:
        return (tok + 1 + int(self.rng.integers(self.n_vocab - 1))) % self.n_vocab  # any id but tok

    def forget(self, seq_id: int) -> None:
        self.trace_at.pop(seq_id, None)
        if self.inner is not None:
            self.inner.forget(seq_id)
