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

__all__ = ["ReplayDrafter", "load_references", "write_references"]


def write_references(path: str | os.PathLike, sequences: Sequence[Sequence[int]]) -> None:
    """Store prompt + greedy continuation token sequences for ``load_references``."""
    Path(path).write_text(json.dumps({"sequences": [[int(t) for t in s] for s in sequences]}))


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
    different id with probability ``p_wrong``, deterministically from ``seed``."""

    name = "replay"

    def __init__(self, references: Sequence[Sequence[int]], p_wrong: float, n_vocab: int, *, seed: int = 0,
                 inner: Drafter | None = None) -> None:
        if n_vocab < 2:
            raise ConfigError("a replay drafter needs a vocabulary of at least 2 tokens to make a token wrong")
        self.references = [tuple(r) for r in references]
        self.p_wrong = p_wrong
        self.n_vocab = n_vocab
        self.inner = inner
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """Chains ``depth`` long (the recording has one continuation: width is not used)."""
        t0 = time.monotonic()
        if self.inner is not None:
            self.inner.propose(requests)  # its cost is the point; its guesses are not
        trees = [DraftTree.chain([self._maybe_wrong(t) for t in self._continuation(r.tokens)[: r.depth]])
                 for r in requests]
        self.depth_s = (self.inner.depth_s if self.inner is not None
                        else (time.monotonic() - t0) / max(1, max((r.depth for r in requests), default=1)))
        return trees

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
        return (tok + 1 + int(self.rng.integers(self.n_vocab - 1))) % self.n_vocab  # any id but tok

    def forget(self, seq_id: int) -> None:
        if self.inner is not None:
            self.inner.forget(seq_id)
