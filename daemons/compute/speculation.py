"""Speculative decoding: a drafter proposes the next tokens of a sequence cheaply, one pass of the
target verifies all of them, and every accepted token is a token the pass did not have to stream.

At batch 1 a streamed pass moves ~20 GB over the link to produce one token while the GPU idles;
verifying a few drafted tokens in that pass costs almost nothing more. The engine asks a
``Drafter`` for up to N tokens per sequence, runs them as one chunk after the sequence's last
token (row 0 predicts draft[0], row i predicts draft[i], the last row the token after the whole
draft), then ``verify_chain`` decides what the pass yields.

Drafts here are chains (a tree of width 1); the draft is deterministic (each drafter proposes its
best token), so the acceptance rule that keeps the target's distribution exactly is: at row i,
accept draft token x with probability p_i(x); otherwise draw from p_i with x removed
(renormalised) and stop; after a fully accepted chain, draw one more token from the last row.
Then P(token = y) = p(x)[y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y) for every y. With
temperature 0, p_i is the target's argmax: drafts are accepted while they equal it, and the
output is token for token the target's greedy output.

KV entries: the chunk writes the target's cache at the draft's positions; positions past the
accepted ones hold stale keys that no later row sees (attention is causal over positions) and
that the next pass overwrites.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ntx.daemons.compute.backend import Pick, Picked
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.model import LlamaModel
from ntx.daemons.compute.sampler import Sampler
from ntx.shared.config import MAX_DRAFT_TOKENS
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import ModelIndex

__all__ = ["MAX_DRAFT_TOKENS", "DraftRequest", "Drafter", "SelfDrafter", "ModelDrafter", "check_same_vocabulary",
           "verify_chain"]


@dataclass(frozen=True)
class DraftRequest:
    """Draft up to ``n`` tokens after ``tokens`` (the sequence so far, prompt and generated; the
    last one is not yet in the target's KV cache: it sits at position len(tokens) - 1).
    ``capacity``: the positions the sequence can ever reach (its KV cache's size)."""

    seq_id: int
    tokens: Sequence[int]
    n: int
    capacity: int


class Drafter(ABC):
    """Proposes draft tokens for several sequences at once (one batched pass per depth)."""

    name = "?"

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """For each request, at most ``n`` tokens, best guess first."""

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop whatever the drafter keeps for it."""


def _greedy_chains(requests: list[DraftRequest], step) -> list[list[int]]:
    """Draft every request's chain one depth at a time: ``step(todo, depth, out)`` runs one
    batched pass for the requests ``todo`` (indices) still drafting at ``depth`` (``out`` holds
    what each drafted so far) and returns each one's best next token."""
    out: list[list[int]] = [[] for _ in requests]
    depth = 0
    while True:
        todo = [i for i, r in enumerate(requests) if len(out[i]) < r.n]
        if not todo:
            return out
        for i, tok in zip(todo, step(todo, depth, out)):
            out[i].append(tok)
        depth += 1


class SelfDrafter(Drafter):
    """The target drafts for itself with its resident layers (all of them, or a chosen subset)
    and its head: no bytes stream, and the drafted layers' KV entries are the target's own (the
    verify pass rewrites them at the same positions). The reference engine's self-speculation."""

    name = "self"

    def __init__(self, model: LlamaModel, layers: Sequence[int] | None = None) -> None:
        resident = sorted(model.resident)
        self.layers = resident if layers is None else sorted(set(layers))
        if not self.layers:
            raise ConfigError("--self-draft needs at least one resident layer to draft with")
        outside = [i for i in self.layers if i not in model.resident]
        if outside:
            raise ConfigError(f"--self-draft layers {outside} are not resident: a self-draft uses resident layers only")
        self.model = model

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        def step(todo, depth, out):
            chunks = []
            for i in todo:
                r = requests[i]
                tok = r.tokens[-1] if depth == 0 else out[i][-1]
                chunks.append(SeqChunk(r.seq_id, len(r.tokens) - 1 + depth, (tok,)))
            picked = self.model.draft_forward(StepBatch(chunks), self.layers, [Pick(1)] * len(chunks))
            return [int(p.ids[0]) for p in picked]

        return _greedy_chains(requests, step)


class ModelDrafter(Drafter):
    """A small model with the target's vocabulary, all resident, with its own KV cache per
    sequence. It remembers which tokens its cache holds, so after a verify pass it feeds only
    what it has not seen (the accepted tokens past its last draft, and the correction)."""

    name = "model"

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.cached: dict[int, list[int]] = {}  # seq -> tokens whose KV entries the draft cache holds

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        def step(todo, depth, out):
            chunks = []
            for i in todo:
                r = requests[i]
                if depth == 0:
                    known = self._known(r)
                    feed = list(r.tokens[known:])  # at least the last token
                    self.cached[r.seq_id] = list(r.tokens)
                    chunks.append(SeqChunk(r.seq_id, known, tuple(feed)))
                else:
                    self.cached[r.seq_id].append(out[i][-1])
                    chunks.append(SeqChunk(r.seq_id, len(r.tokens) - 1 + depth, (out[i][-1],)))
            picked = self.model.forward(StepBatch(chunks), picks=[Pick(1)] * len(chunks))
            return [int(p.ids[0]) for p in picked]

        return _greedy_chains(requests, step)

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


def verify_chain(draft: list[int], rows: list[Picked], sampler: Sampler, history: list[int]) -> list[int]:
    """What one verify pass yields for a sequence: the accepted prefix of ``draft`` and one token
    more from the target (the correction at the first rejection, or a bonus after a fully
    accepted draft). ``rows[i]`` is the target's pick at chunk row i (row 0 is the last token,
    predicting draft[0]); ``history`` the tokens before row 0's prediction (for the penalty)."""
    out: list[int] = []
    greedy = sampler.params.temperature == 0
    for i, x in enumerate(draft):
        ids, probs = sampler.distribution(rows[i], history + out)
        if greedy:
            out.append(int(ids[0]))
            if out[-1] != x:
                return out
            continue
        hit = ids == x
        if not hit.any() or sampler.uniform() >= float(probs[hit].sum()):
            rest = ~hit
            if rest.any():  # the residual max(0, p - draft) = p without x
                out.append(sampler.draw(ids[rest], probs[rest]))
                return out
        out.append(x)
    ids, probs = sampler.distribution(rows[len(draft)], history + out)
    out.append(int(ids[0]) if greedy else sampler.draw(ids, probs))
    return out
