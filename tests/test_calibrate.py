"""``ntxctl calibrate`` (ctl/calibrate.py): each layer's input/output cosine similarity equals the
one computed by hand from the float64 reference's hidden states, skip sets are chosen from it,
and a profile that cannot be used is one error line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ntx.ctl.calibrate import ProfileError, SkipProfile, calibrate
from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.gguf_index import open_model

from .synth_models import ReferenceWeights, reference_logits, write_tiny

CTX = 16
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calib")
    model = write_tiny(folder, n_layers=3)
    text = folder / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return model, text


def test_similarity_equals_the_hand_computed_one(tiny, tmp_path):
    model, text = tiny
    prof = calibrate(str(model), text, CTX, kernels="cpu-quantized=off")  # the float32 reference's numbers
    tok = Tokenizer.from_metadata(open_model(model).metadata)
    ids = tok.encode(TEXT)
    n_chunks = len(ids) // CTX
    w = ReferenceWeights(model)
    cos = []  # [chunks * CTX, n_layers]
    for c in range(n_chunks):
        hidden: list = []
        reference_logits(w, [tok.bos_id] + ids[c * CTX + 1:(c + 1) * CTX], hidden=hidden)
        xs = np.stack(hidden)  # [n_layers + 1, CTX, D]
        a, b = xs[:-1], xs[1:]
        cos.append(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).T)
    want = np.concatenate(cos).mean(axis=0)
    assert (prof.n_layers, prof.n_tokens, prof.ctx) == (3, n_chunks * CTX, CTX)
    np.testing.assert_allclose(prof.similarity, want, atol=1e-5)

    path = tmp_path / "p.json"
    prof.save(path)
    assert SkipProfile.load(path) == prof


def test_skip_sets():
    prof = SkipProfile("m", 4, "t", 16, 64, [0.5, 0.99, 0.98, 0.99])
    assert prof.layers_at(0.98) == [1, 2, 3]
    assert prof.most_similar(2) == [1, 3]
    assert prof.most_similar(1) == [3]  # a tie goes to the deeper layer


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ("not json", "not JSON"),
    (json.dumps({"format": "other"}), "format is not"),
    (json.dumps({"format": "ntx-skip-profile/1", "model": "m"}), "without 'n_layers'"),
    (json.dumps({"format": "ntx-skip-profile/1", "model": "m", "n_layers": 2, "text": "t", "ctx": 16,
                 "n_tokens": 32, "similarity": [0.5]}), "must hold 2 numbers"),
])
def test_bad_profiles_are_one_error_line(tmp_path, content, needle):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError) as e:
        SkipProfile.load(path)
    assert needle in str(e.value) and "\n" not in str(e.value)
