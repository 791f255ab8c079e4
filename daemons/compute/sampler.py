"""Choosing the next token from the logits.

Order of the steps is llama.cpp's default chain, so a seed and settings behave the way users
of llama.cpp expect: repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.
(Note: top-p and min-p therefore see the *untempered* distribution, as in llama.cpp.)

- Repetition penalty looks at the last ``REPETITION_WINDOW`` (= 64, llama.cpp's default
  ``penalty_last_n``) tokens of the history; each distinct token there has a positive logit
  divided by the penalty and a negative one multiplied by it.
- Ties are broken toward the lower token id everywhere (greedy, top-k cut, logprobs), so
  results do not depend on the sort algorithm.
- Every Sampler owns a ``numpy.random.Generator(PCG64(seed))``; the same seed and the same
  logits give the same tokens. With ``seed=None`` a seed is drawn from OS entropy and kept in
  ``sampler.seed`` so it can be reported and the run replayed.
- Work is done in float64 on a copy: the caller's logits are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ntx.daemons.compute.backend import MAX_PICK_K, Pick, Picked, log_normaliser, top_entries
from ntx.shared.errors import NtxError
from ntx.shared.sampling_fields import SamplingParams, draw_seed

__all__ = ["SamplingParams", "Sampler", "NumericalError", "logprobs_topk", "REPETITION_WINDOW"]

REPETITION_WINDOW = 64


class NumericalError(NtxError):
    """The logits of a request cannot be drawn from: NaN, +inf, or no finite value at all.

    Why an error of the request and not of the process: a broken weight or hyperparameter (an
    ``rms_eps`` of NaN, an overflowing layer) spoils the numbers of the requests that run through
    it, not the engine's state; the engine fails those requests (``numerical_error``) and keeps
    serving, instead of crashing the daemon on an empty candidate list and spending a restart."""


def check_logits(vals: np.ndarray) -> None:
    """Raise NumericalError unless ``vals`` (a row [V] or candidate values [k]) can be sampled
    from: no NaN, no +inf, at least one finite value (-inf alone is a masked token, allowed)."""
    top = float(vals.max()) if vals.size else math.nan  # max propagates NaN; a NaN row has no top-k
    if math.isnan(top):
        found = "NaN"
    elif top == math.inf:
        found = "+inf"
    elif top == -math.inf:
        found = "no finite value"
    else:
        return
    raise NumericalError(f"the model's logits are not finite ({found}): a NaN or inf weight or "
                         f"hyperparameter (e.g. rms_eps) broke the numbers; this request cannot be sampled")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def logprobs_topk(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens under the raw logits as (id, log-probability), best first,
    ties by lower id. Log-softmax over the whole vocab, in float64."""
    # logits: [V]
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if k <= 0:
        return []
    k = min(k, x.shape[0])
    log_z = log_normaliser(x)
    ids = top_entries(x, k)
    return [(int(i), float(x[i] - log_z)) for i in ids]


def _cuttop_entries(ids: np.ndarray, vals: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """Top-p, then min-p, on the top-k candidates ``ids`` [k] with logits ``vals`` [k], best first."""
    if top_p < 1.0:
        cum = np.cumsum(_softmax(vals))
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest prefix with mass >= top_p
        ids, vals = ids[:keep], vals[:keep]
    if min_p > 0.0:
        ids = ids[vals >= vals[0] + math.log(min_p)]  # p_i >= min_p * p_max
    return ids


def _truncate(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Ids that survive top-k, then top-p, then min-p (llama.cpp semantics).

    Top-p and min-p both keep a best-first prefix, so their result is the shorter prefix.
    Without top-k we avoid sorting the whole vocab: min-p gives a cheap upper bound on the
    set, and the top-p prefix is searched among the best 1024, 8192, ... ids.
    """
    # x: [V]
    n_vocab = x.shape[0]
    if 0 < top_k < n_vocab:
        ids = top_entries(x, top_k)  # best first
        return _cuttop_entries(ids, x[ids], top_p, min_p)

    x_max = float(x.max())
    pool = np.flatnonzero(x >= x_max + math.log(min_p)) if min_p > 0.0 else None  # ascending ids
    if top_p >= 1.0:
        return pool if pool is not None else np.arange(n_vocab)
    log_z = log_normaliser(x)  # normaliser over the whole vocab
    sub = x[pool] if pool is not None else x
    size = sub.shape[0]
    k = min(size, 1024)
    while True:
        order = top_entries(sub, k)
        ids = pool[order] if pool is not None else order
        cum = np.cumsum(np.exp(x[ids] - log_z))
        if cum[-1] >= top_p or k == size:
            keep = int(np.searchsorted(cum, top_p, side="left")) + 1
            return ids[:keep]
        k = min(size, k * 8)


class Sampler:
    """Draws tokens for one request. ``sample(logits, history)`` -> token id."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params.validate()
        self.seed: int = params.seed if params.seed is not None else draw_seed()
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Draw from a whole row of logits [V]."""
        return self.sample_picked(Picked(row=np.asarray(logits)), history)

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """A float64 working copy of the row [V] with the repetition penalty applied."""
        p = self.params
        x = np.array(logits, dtype=np.float64).reshape(-1)
        n_vocab = x.shape[0]
        if n_vocab == 0:
            raise ValueError("empty logits")
        if p.repetition_penalty != 1.0 and len(history):
            recent = np.unique(np.asarray(history[-REPETITION_WINDOW:], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < n_vocab)]
            vals = x[recent]
            x[recent] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        return x

    def distribution(self, picked: Picked, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a draw can give and their probabilities, ids [C] and probs [C] best first,
        after the whole chain (penalty, top-k, top-p, min-p, temperature); greedy: the best
        token alone, with probability 1. Speculative verification accepts drafts against this.
        Logits that cannot be drawn from raise NumericalError (``check_logits``)."""
        p = self.params
        if picked.row is not None:
            x = self._penalised(picked.row, history)
            check_logits(x)
            if p.temperature == 0:
                return np.array([int(np.argmax(x))]), np.ones(1)  # first max = lowest id on ties
            ids = _truncate(x, p.top_k, p.top_p, p.min_p)  # ids: [C]
            vals = x[ids]
        else:
            check_logits(picked.vals)  # best first: a NaN row comes back with no candidates
            if p.temperature == 0:
                return picked.ids[:1], np.ones(1)
            ids, vals = picked.ids[: p.top_k], picked.vals[: p.top_k]
            ids = _cuttop_entries(ids, vals, p.top_p, p.min_p)  # a best-first prefix
            vals = vals[: len(ids)]
        return ids, _softmax(vals / p.temperature)

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One token from candidates ``ids`` [C] with weights ``probs`` [C] (need not sum to 1:
        a distribution with some candidates removed is drawn from as renormalised)."""
        cum = np.cumsum(probs)
        r = self._rng.random() * cum[-1]
        j = min(int(np.searchsorted(cum, r, side="right")), len(ids) - 1)
        return int(ids[j])

    def uniform(self) -> float:
        """A draw from U[0, 1) of this request's generator (speculative acceptance tests)."""
        return float(self._rng.random())

    def pick(self, n_vocab: int, logprobs: int = 0, rank: int = 1) -> Pick:
        """What ``sample_picked`` needs from a row of logits, plus ``logprobs`` alternatives:
        the top-1 for greedy (the top ``rank``, which a drafter learns from, ``Drafter.row_top_k``:
        greedy takes the first of any k), the top-k for top-k sampling, the whole row when the
        repetition penalty changes values before ranking or when no top-k cut bounds the
        candidates."""
        p = self.params
        if p.repetition_penalty != 1.0:
            return Pick(0)
        if p.temperature == 0:
            k = max(1, rank)
        elif 0 < p.top_k < n_vocab:
            k = p.top_k
        else:
            return Pick(0)
        k = max(k, logprobs)
        if k > MAX_PICK_K or k >= n_vocab:
            return Pick(0)
        return Pick(k, lse=logprobs > 0)

    def sample_picked(self, picked: Picked, history: Sequence[int] = ()) -> int:
        """``sample`` from what ``pick`` asked for: the same token for the same seed and logits
        (the candidates are the same ids and values in the same order)."""
        ids, probs = self.distribution(picked, history)
        return int(ids[0]) if self.params.temperature == 0 else self.draw(ids, probs)
