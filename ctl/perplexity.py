"""``ntxctl perplexity``: a model's perplexity over a text file, by llama-perplexity's method.

Perplexity numbers only compare across engines when they are computed the same way, and the
number people quote is llama.cpp's (tools/perplexity). So this follows it step for step:

- the whole file is tokenized once, as llama.cpp does (``add_special``: a BOS first only when
  the model's ``add_bos_token`` says so; special-token text is not parsed);
- ``n_chunks = n_tokens // ctx`` chunks of ``ctx`` tokens, the remainder dropped; when the model
  adds a BOS, each chunk's first token is replaced by BOS (a chunk starts a fresh context);
- each chunk is evaluated from an empty KV cache, and only its second half is scored: the
  predictions made at positions ctx/2 … ctx-2 of tokens ctx/2+1 … ctx-1 (ctx - ctx/2 - 1 per
  chunk), so every scored token has at least ctx/2 tokens of context;
- the running value after each chunk is exp(mean negative log-likelihood so far); the final
  ± is the standard error of that mean, sqrt((E[nll²] - E[nll]²) / (n - 1)), times the PPL.

One difference: llama.cpp refuses texts of fewer than 2·ctx tokens; one chunk is enough here.

Chunks are scored in this process (``LocalScorer``: the engine factory's model, logits of the
scored half) or by a running pipeline (``PipelineScorer``: one generate request per chunk with
``tokens`` and ``prompt_logprobs``, whose entries carry the actual prompt token's log-probability).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np

from ntx.daemons.compute.backend import log_normaliser
from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.errors import NtxError

ROWS_PER_PASS = 512  # in-process: short chunks are evaluated side by side up to this many rows
MIN_CTX = 3  # the smallest chunk with a token scored: ctx - ctx//2 - 1 >= 1


class PerplexityError(NtxError):
    """A text or setting perplexity cannot be measured on; one line naming it."""


@dataclass
class PerplexityResult:
    """What ``ntxctl perplexity`` reports (``--json`` prints it as is)."""

    ppl: float
    ppl_stderr: float
    ctx: int
    n_chunks: int
    n_tokens: int  # the whole file's tokens (n_chunks * ctx of them evaluated)
    n_scored: int  # tokens whose log-likelihood entered the mean
    running_ppl: list[float] = field(default_factory=list)  # after each chunk
    model: str = ""
    scorer: str = ""  # "in-process (cpu)" or "pipeline tcp://…"
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class NllTally:
    """Sums of the scored tokens' negative log-likelihoods and their squares, as llama.cpp keeps
    them (in float64), for the running PPL and the final standard error."""

    def __init__(self) -> None:
        self.sum_nll = 0.0
        self.sum_nll2 = 0.0
        self.count = 0

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.sum_nll += float(nll.sum())
        self.sum_nll2 += float((nll * nll).sum())
        self.count += int(nll.size)

    @property
    def ppl(self) -> float:
        return math.exp(self.sum_nll / self.count)

    @property
    def ppl_stderr(self) -> float:
        """The standard error of the mean NLL carried through exp: PPL * sqrt(var / (n - 1))."""
        mean = self.sum_nll / self.count
        var = self.sum_nll2 / self.count - mean * mean
        if self.count < 2 or var <= 0:
            return 0.0
        return self.ppl * math.sqrt(var / (self.count - 1))


def read_text(path: str | Path) -> str:
    """The file's text; unreadable, non-UTF-8 or empty files are one-line errors."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise PerplexityError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PerplexityError(f"{p}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise PerplexityError(f"{p}: the file is empty")
    return text


def tokenize(tokenizer: Tokenizer, text: str) -> list[int]:
    """The whole text's ids as llama-perplexity gets them: the model's own BOS rule, special
    tokens' text read as plain text."""
    return tokenizer.encode(text, add_bos=None, parse_special=False)


def cut_chunks(tokens: list[int], ctx: int, bos_id: int | None, *, max_ctx: int, source: str = "the text",
               max_chunks: int | None = None) -> list[list[int]]:
    """``len(tokens) // ctx`` chunks of ``ctx`` tokens (the first ``max_chunks`` of them), each
    starting with ``bos_id`` when it is given (the model adds a BOS). ``max_ctx``: the most
    positions the scorer can evaluate."""
    if not MIN_CTX <= ctx <= max_ctx:
        raise PerplexityError(f"--ctx {ctx}: choose {MIN_CTX} to {max_ctx}")
    n_chunks = len(tokens) // ctx
    if n_chunks == 0:
        fits = f"; --ctx {len(tokens)} or less would fit" if len(tokens) >= MIN_CTX else ""
        raise PerplexityError(f"{source} has {len(tokens)} tokens, fewer than one chunk of --ctx {ctx}{fits}")
    if max_chunks is not None:
        if max_chunks < 1:
            raise PerplexityError(f"--chunks {max_chunks}: choose 1 or more")
        n_chunks = min(n_chunks, max_chunks)
    chunks = [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(n_chunks)]
    if bos_id is not None:
        for c in chunks:
            c[0] = bos_id
    return chunks


def scored_range(ctx: int) -> range:
    """The chunk positions whose tokens are scored: ctx/2+1 … ctx-1."""
    return range(ctx // 2 + 1, ctx)


class Scorer(Protocol):
    """Evaluates chunks, each from an empty context. ``tokenizer`` and ``model_path`` are the
    model's; ``max_ctx`` the longest chunk it can take."""

    name: str
    model_path: str
    tokenizer: Tokenizer
    max_ctx: int

    def score_all(self, chunks: list[list[int]]) -> Iterator[np.ndarray]:
        """Each chunk's scored NLLs, [len(scored_range(ctx))] float64, chunk by chunk in order."""

    def close(self) -> None: ...


class LocalScorer:
    """Chunks evaluated by ``LlamaModel.forward`` in this process: the context half in one pass,
    then the scored half with every row's logits (the first half's logits are never needed).
    The model loads on the first chunk, after the text was found usable."""

    def __init__(self, model_path: str, backend: str = "cpu", skip_layers: list[int] | None = None,
                 kernels: str = "") -> None:
        from ntx.shared.gguf_index import open_model

        self.model_path = model_path
        self.index = open_model(model_path)
        self.tokenizer = Tokenizer.from_metadata(self.index.metadata)
        self.max_ctx = self.index.hparams.n_ctx_train
        self.backend = backend
        self.skip_layers = sorted(skip_layers or [])
        self.kernels = kernels  # the kernels' switches (--kernels)
        self.name = f"in-process ({backend})" + (f", layers {self.skip_layers} skipped" if self.skip_layers else "")
        self.model = None

    def score_all(self, chunks: list[list[int]]) -> Iterator[np.ndarray]:
        from ntx.daemons.compute.factory import build_engine
        from ntx.shared.config import EngineOptions

        ctx = len(chunks[0])
        n_seq = max(1, ROWS_PER_PASS // ctx)  # chunks side by side in one pass, as llama.cpp's n_seq
        options = EngineOptions(max_batch=n_seq, ctx=ctx, prefill_chunk_tokens=ctx, skip_layers=self.skip_layers,
                                kernels=self.kernels)
        self.model = build_engine(self.index, self.backend, options).model
        for i in range(0, len(chunks), n_seq):
            yield from self._score(chunks[i:i + n_seq])

    def _score(self, chunks: list[list[int]]) -> list[np.ndarray]:
        """One group of chunks, each its own sequence: a pass over their context halves, then a
        pass over their scored halves returning every row's logits."""
        from ntx.daemons.compute.batch import SeqChunk, StepBatch

        ctx, first = len(chunks[0]), len(chunks[0]) // 2
        be = self.model.backend
        for seq in range(len(chunks)):
            be.alloc_sequence(seq, ctx)
        try:
            self.model.forward(StepBatch([SeqChunk(seq, 0, tuple(c[:first])) for seq, c in enumerate(chunks)]))
            logits = self.model.forward(StepBatch([SeqChunk(seq, first, tuple(c[first:]), all_logits=True)
                                                   for seq, c in enumerate(chunks)]))  # [n_seq * (ctx-first), V]
        finally:
            for seq in range(len(chunks)):
                be.free_sequence(seq)
        out = []
        for seq, c in enumerate(chunks):
            # rows: [ctx-first-1, V]; row j predicts c[first+1+j]
            rows = logits[seq * (ctx - first):(seq + 1) * (ctx - first) - 1]
            lse = np.array([log_normaliser(r) for r in rows])  # float64, as llama.cpp sums
            out.append(lse - rows[np.arange(rows.shape[0]), c[first + 1:]].astype(np.float64))
        return out

    def close(self) -> None:
        if self.model is not None:
            self.model.backend.close()


class PipelineScorer:
    """Chunks sent to a running pipeline as generate requests (``tokens``, ``prompt_logprobs: 1``,
    ``max_tokens: 1``, greedy); each ``prompt_logprobs`` entry carries the actual token's pair.
    Up to ``in_flight`` chunks are queued at once, so the pipeline batches them."""

    def __init__(self, listen: str, model_path: str | None = None, in_flight: int = 4) -> None:
        from ntx.ctl.client import Client
        from ntx.shared.gguf_index import open_model

        self.client = Client(listen)
        self._sent: dict[int, str] = {}
        st = self.client.status()
        self.model_path = st.get("model")  # operators only: connections from this machine
        if self.model_path is None:
            self.client.close()
            raise PerplexityError(f"the pipeline on {listen} does not name its model to this connection (status "
                                  "details are for this machine): run perplexity on the pipeline's machine")
        if model_path is not None and Path(model_path).resolve() != Path(self.model_path).resolve():
            self.client.close()
            raise PerplexityError(f"the pipeline on {listen} serves {self.model_path}, not {model_path} "
                                  "(stop it, or run with --local)")
        index = open_model(self.model_path)
        self.tokenizer = Tokenizer.from_metadata(index.metadata)
        # a prompt and its one generated token within the model's context; a pipeline started
        # with a shorter --ctx refuses longer chunks itself (context_overflow)
        self.max_ctx = index.hparams.n_ctx_train - 1
        self.in_flight = in_flight
        self.name = f"pipeline {listen}"

    def score_all(self, chunks: list[list[int]]) -> Iterator[np.ndarray]:
        sent = 0
        for i, chunk in enumerate(chunks):
            while sent < len(chunks) and sent < i + self.in_flight:
                self._sent[sent] = self.client.submit(tokens=chunks[sent], prompt_logprobs=1, max_tokens=1,
                                                      temperature=0.0, stream=False)
                sent += 1
            done = list(self.client.events(self._sent.pop(i)))[-1]
            yield self._nll(chunk, done["prompt_logprobs"])

    @staticmethod
    def _nll(chunk: list[int], entries: list) -> np.ndarray:
        """The scored tokens' NLLs from the entries: entry p holds prompt token p's pair."""
        return np.asarray([-dict((int(i), lp) for i, lp in entries[p])[chunk[p]] for p in scored_range(len(chunk))],
                          dtype=np.float64)

    def close(self) -> None:
        for rid in self._sent.values():
            self.client.cancel(rid)
        self.client.close()


def measure(scorer: Scorer, text_path: str | Path, ctx: int, *, max_chunks: int | None = None,
            on_start: Callable[[int], None] | None = None,
            on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """The perplexity of ``scorer``'s model over the file: ``on_start(n_chunks)`` once the text
    is cut, ``on_chunk(i, running_ppl)`` after each chunk."""
    t0 = time.monotonic()
    text = read_text(text_path)
    tokens = tokenize(scorer.tokenizer, text)
    bos = scorer.tokenizer.bos_id if scorer.tokenizer.add_bos else None
    chunks = cut_chunks(tokens, ctx, bos, max_ctx=scorer.max_ctx, source=str(text_path), max_chunks=max_chunks)
    if on_start:
        on_start(len(chunks))
    tally, running = NllTally(), []
    for i, nll in enumerate(scorer.score_all(chunks)):
        tally.add(nll)
        running.append(tally.ppl)
        if on_chunk:
            on_chunk(i, tally.ppl)
    return PerplexityResult(
        ppl=tally.ppl, ppl_stderr=tally.ppl_stderr, ctx=ctx, n_chunks=len(chunks), n_tokens=len(tokens),
        n_scored=tally.count, running_ppl=running, model=scorer.model_path, scorer=scorer.name,
        elapsed_s=round(time.monotonic() - t0, 3),
    )
