"""``ntxctl calibrate``: how much each layer changes the hidden state, as a skip profile.

A layer whose output is nearly its input (cosine similarity of the hidden state before and after
it close to 1) contributes little, and skipping it saves its bytes on every streamed pass; the
reference engine skips layers at 0.98 or more. The profile measured here is what a skip set is
chosen from (``SkipProfile.layers_at``: by threshold, ``most_similar``: the n most similar), and
``ntxctl perplexity`` is how its cost in quality is measured.

The similarity of layer i is the mean over every evaluated token of cos(x_i, x_{i+1}), x_i the
hidden state entering layer i, over the calibration text cut into chunks of ``ctx`` tokens as
``ntxctl perplexity`` cuts it (each chunk from an empty context).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ntx.ctl.perplexity import cut_chunks, read_text, tokenize
from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.errors import NtxError

PROFILE_FORMAT = "ntx-skip-profile/1"


class ProfileError(NtxError):
    """A skip profile that cannot be used; one line naming the file and the problem."""


@dataclass
class SkipProfile:
    """Per-layer input/output cosine similarity of one model over a calibration text."""

    model: str
    n_layers: int
    text: str
    ctx: int
    n_tokens: int  # tokens evaluated (whole chunks)
    similarity: list[float]  # [n_layers], mean cos(layer input, layer output)

    def layers_at(self, threshold: float) -> list[int]:
        """The layers whose similarity is at least ``threshold``, ascending."""
        return [i for i, s in enumerate(self.similarity) if s >= threshold]

    def most_similar(self, n: int) -> list[int]:
        """The ``n`` most similar layers (ties to the deeper one), ascending."""
        order = sorted(range(self.n_layers), key=lambda i: (-self.similarity[i], -i))
        return sorted(order[:n])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": PROFILE_FORMAT, **asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SkipProfile:
        """Read a profile; anything else is one ``ProfileError`` line."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except OSError as e:
            raise ProfileError(f"{p}: cannot read: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ProfileError(f"{p}: not a skip profile (not JSON); write one with `ntxctl calibrate`") from None
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{p}: not a skip profile (format is not {PROFILE_FORMAT!r})")
        try:
            prof = cls(**{k: d[k] for k in cls.__dataclass_fields__})
        except KeyError as e:
            raise ProfileError(f"{p}: skip profile without {e.args[0]!r}") from None
        sim = prof.similarity
        if not (isinstance(sim, list) and len(sim) == prof.n_layers
                and all(isinstance(s, (int, float)) and -1.0 <= s <= 1.0 for s in sim)):
            raise ProfileError(f"{p}: 'similarity' must hold {prof.n_layers} numbers in [-1, 1]")
        return prof


def layer_similarity(model, chunks: list[list[int]], on_chunk: Callable[[int], None] | None = None) -> np.ndarray:
    """Mean cos(layer input, layer output) per layer [n_layers] float64 over every token of
    ``chunks``, on a model whose layers are all resident on the cpu backend. The pass is run
    block by block here (``llama_block``), the hidden state read between blocks."""
    from ntx.daemons.compute.batch import SeqChunk, StepBatch
    from ntx.daemons.compute.model import llama_block

    be = model.backend
    if be.name != "cpu" or model.streamed_layers:
        raise NtxError("calibrate needs every layer resident on the cpu backend")
    n_layers = model.hp.n_layers
    cos_sum = np.zeros(n_layers, dtype=np.float64)
    n_rows = 0
    for c, chunk in enumerate(chunks):
        be.alloc_sequence(0, len(chunk))
        try:
            ws = be.begin_pass(StepBatch([SeqChunk(0, 0, tuple(chunk))]))
            be.embed(ws)
            for i in range(n_layers):
                x_in = np.array(ws.x, dtype=np.float64)  # [T, D], a copy: the block writes x in place
                llama_block(be, i, model.resident[i], ws)
                x_out = np.asarray(ws.x, dtype=np.float64)  # [T, D]
                dots = (x_in * x_out).sum(axis=1)
                cos_sum[i] += float((dots / (np.linalg.norm(x_in, axis=1) * np.linalg.norm(x_out, axis=1))).sum())
        finally:
            be.free_sequence(0)
        n_rows += len(chunk)
        if on_chunk:
            on_chunk(c)
    return cos_sum / n_rows


def calibrate(model_path: str, text_path: str | Path, ctx: int, *,
              on_start: Callable[[int], None] | None = None,
              on_chunk: Callable[[int], None] | None = None, kernels: str = "") -> SkipProfile:
    """The skip profile of ``model_path`` over the text file (in-process, cpu; ``kernels``: the
    switches, as ``--kernels``)."""
    from ntx.daemons.compute.factory import build_engine
    from ntx.shared.config import EngineOptions
    from ntx.shared.gguf_index import open_model

    text = read_text(text_path)
    index = open_model(model_path)
    tok = Tokenizer.from_metadata(index.metadata)
    chunks = cut_chunks(tokenize(tok, text), ctx, tok.bos_id if tok.add_bos else None,
                        max_ctx=index.hparams.n_ctx_train, source=str(text_path))
    if on_start:
        on_start(len(chunks))
    model = build_engine(index, "cpu", EngineOptions(max_batch=1, ctx=ctx, prefill_chunk_tokens=ctx,
                                                     kernels=kernels)).model
    sim = layer_similarity(model, chunks, on_chunk)
    return SkipProfile(model=str(model_path), n_layers=index.hparams.n_layers, text=str(text_path), ctx=ctx,
                       n_tokens=len(chunks) * ctx, similarity=[round(float(s), 6) for s in sim])


DEFAULT_THRESHOLD = 0.98  # the reference engine's: a layer this similar is skipped


def skip_layers(spec: str, n_layers: int, what: str = "--skip-layers") -> list[int]:
    """The layers a ``--skip-layers`` value (or another option ``what`` of the same grammar)
    names: a list (``20-27,29``), a profile file (its layers at cos >= 0.98), or ``PROFILE:N``
    (its N most similar). One line on a bad value."""
    from ntx.shared.config import parse_layers

    path, sep, n = spec.rpartition(":")
    if not sep or not Path(path).is_file():
        path, n = spec, ""
    if Path(path).is_file() or path.endswith(".json"):
        prof = SkipProfile.load(path)
        if prof.n_layers != n_layers:
            raise ProfileError(f"{path}: a profile of {prof.n_layers} layers, the model has {n_layers}")
        if not n:
            return prof.layers_at(DEFAULT_THRESHOLD)
        if not n.isdigit() or int(n) >= n_layers:
            raise ProfileError(f"{what} {spec}: N must be 0 to {n_layers - 1}")
        return prof.most_similar(int(n))
    layers = parse_layers(spec, what)
    if layers[-1] >= n_layers or len(layers) >= n_layers:
        raise ProfileError(f"{what} {spec}: the model has layers 0 to {n_layers - 1}, and one must stay")
    return layers
