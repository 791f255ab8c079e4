"""``ntxctl perplexity`` (ctl/perplexity.py) on a tiny synthetic model: its PPL and standard error
equal ones computed here by hand from the float64 reference logits, a running pipeline gives
the in-process numbers, and bad inputs are one error line each. (The real SmolLM2 against
llama.cpp's numbers is in docs/QUALITY.md: minutes of CPU, too slow for the suite.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ntx.ctl import perplexity as ppl
from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.gguf_index import open_model

from .pipeline_util import free_port, ntxctl, running_pipeline
from .synth_models import ReferenceWeights, log_softmax64, reference_logits, write_tiny

CTX = 16
# the float32 reference kernels: the figures are held to a float64 hand computation at 1e-4
REFERENCE = "cpu-quantized=off"
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3
        + "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump! " * 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppl")
    model = write_tiny(folder)
    text = folder / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return model, text


@pytest.fixture(scope="module")
def local_result(tiny):
    model, text = tiny
    return ppl.measure(ppl.LocalScorer(str(model), kernels=REFERENCE), text, CTX)


def test_ppl_equals_the_hand_computed_one(tiny, local_result):
    model, _ = tiny
    tok = Tokenizer.from_metadata(open_model(model).metadata)
    assert tok.add_bos  # this model adds a BOS: every chunk must start with it
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id
    n_chunks = len(ids) // CTX
    assert n_chunks >= 3
    w = ReferenceWeights(model)
    nll = []
    for c in range(n_chunks):
        chunk = [tok.bos_id] + ids[c * CTX + 1:(c + 1) * CTX]
        logp = log_softmax64(reference_logits(w, chunk))  # [CTX, V], row p predicts chunk[p+1]
        nll += [-logp[p - 1, chunk[p]] for p in range(CTX // 2 + 1, CTX)]
    nll = np.asarray(nll)
    want_ppl = math.exp(nll.mean())
    want_err = want_ppl * math.sqrt(((nll**2).mean() - nll.mean() ** 2) / (len(nll) - 1))

    r = local_result
    assert (r.n_chunks, r.n_tokens, r.n_scored) == (n_chunks, len(ids), n_chunks * (CTX - CTX // 2 - 1))
    assert r.ppl == pytest.approx(want_ppl, rel=1e-4)
    assert r.ppl_stderr == pytest.approx(want_err, rel=1e-3)
    assert len(r.running_ppl) == n_chunks and r.running_ppl[-1] == r.ppl
    first = nll[: CTX - CTX // 2 - 1]
    assert r.running_ppl[0] == pytest.approx(math.exp(first.mean()), rel=1e-4)


def test_pipeline_gives_the_in_process_numbers(tiny, local_result, tmp_path):
    model, text = tiny
    with running_pipeline(str(model), tmp_path, "--ctx", "256", "--kernels", REFERENCE) as p:
        r = ntxctl("perplexity", str(text), "--ctx", str(CTX), "--json", "--listen", p.listen)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["scorer"] == f"pipeline {p.listen}"
    assert got["n_chunks"] == local_result.n_chunks and got["n_scored"] == local_result.n_scored
    np.testing.assert_allclose(got["running_ppl"], local_result.running_ppl, rtol=1e-4)
    assert got["ppl_stderr"] == pytest.approx(local_result.ppl_stderr, rel=1e-3)


def _one_error_line(r) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ntxctl: error: ")]
    assert len(errors) == 1, r.stderr
    assert r.stdout == ""
    return errors[0]


@pytest.mark.parametrize("case, needle", [
    ("empty", "the file is empty"),
    ("short", "tokens, fewer than one chunk of --ctx 512; --ctx "),  # "… N or less would fit"
    ("ctx", "--ctx 2: choose 3 to"),
    ("missing", "cannot read"),
    ("binary", "not UTF-8 text"),
])
def test_bad_inputs_are_one_error_line(tiny, tmp_path, case, needle):
    model, text = tiny
    path, ctx = tmp_path / "in.txt", "512"
    if case == "empty":
        path.write_text(" \n")
    elif case == "short":
        path.write_text("The quick brown fox.")
    elif case == "ctx":
        path, ctx = text, "2"
    elif case == "binary":
        path.write_bytes(b"\xff\xfe\x00text")
    r = ntxctl("perplexity", str(path), "--model", str(model), "--ctx", ctx, "--local",
               "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert needle in _one_error_line(r)


def test_skipped_layers_leave_the_pass(tiny):
    """``--skip-layers``: the PPL of the model without layer 1, by hand from the reference pass
    that leaves layer 1 out, and different from the whole model's."""
    model, text = tiny
    r = ppl.measure(ppl.LocalScorer(str(model), skip_layers=[1], kernels=REFERENCE), text, CTX, max_chunks=2)
    tok = Tokenizer.from_metadata(open_model(model).metadata)
    ids = tok.encode(TEXT)
    w = ReferenceWeights(model)
    nll = []
    for c in range(2):
        chunk = [tok.bos_id] + ids[c * CTX + 1:(c + 1) * CTX]
        logp = log_softmax64(reference_logits(w, chunk, skip=(1,)))
        nll += [-logp[p - 1, chunk[p]] for p in range(CTX // 2 + 1, CTX)]
    assert r.n_chunks == 2 and r.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    whole = ppl.measure(ppl.LocalScorer(str(model), kernels=REFERENCE), text, CTX, max_chunks=2)
    assert abs(whole.ppl - r.ppl) > 1e-3 * r.ppl
