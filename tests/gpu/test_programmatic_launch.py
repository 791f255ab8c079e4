"""Programmatic dependent launch (runtime.Launcher, common.cuh pdl_*): used where the device has
it and the backend's KernelOptions ask for it, and invisible in the results: a kernel may start
while the one before it still writes its inputs, so any read of those inputs before its wait
would show as different bits here (the first GPU run with PDL had such reads: ptxas moved __ldg
loads of x above the wait)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from ntx.daemons.compute.backend import make_backend  # noqa: E402
from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.daemons.compute.cuda import runtime  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
from ntx.shared.gguf_index import open_model  # noqa: E402
from ntx.shared.kernel_options import KernelOptions  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)


def test_on_where_the_device_has_it():
    major, _ = cp.cuda.Device().compute_capability
    assert runtime.Launcher(KernelOptions()).pdl_enabled() == (int(major) >= 9)
    assert not runtime.Launcher(KernelOptions.parse("pdl=off")).pdl_enabled()


def _passes(model: str, rows: int, kernels: KernelOptions) -> np.ndarray:
    """Logits of a 12-token prefill per sequence and 6 decode steps of `rows` sequences at once
    (captured graphs: 1 row takes the i16 matvec, 4 rows mmq where the type has it), on a cuda
    backend with ``kernels``."""
    index = open_model(model)
    backend = make_backend("cuda", index, max_seqs=4, max_ctx=128, kernels=kernels)
    assert backend.kernels == kernels
    eng = build_engine(index, backend, options=EngineOptions(max_batch=4, ctx=128))
    m = eng.model
    out = []
    for s in range(rows):
        m.backend.alloc_sequence(s, 128)
        out.append(m.forward(StepBatch([SeqChunk(s, 0, tuple(range(3 + s, 15 + s)), all_logits=True)])))
    toks = [int(o[-1].argmax()) for o in out]
    for step in range(6):
        lg = m.forward(StepBatch([SeqChunk(s, 12 + step, (toks[s],)) for s in range(rows)]))
        out.append(lg)
        toks = [int(r.argmax()) for r in lg]
    return np.concatenate([np.asarray(o).reshape(-1) for o in out])


@pytest.mark.parametrize("qtype", ["F16", "Q4_0", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("rows", [1, 4])
def test_same_bits_with_and_without(tmp_path, qtype, rows):
    path = tmp_path / f"m-{qtype}.gguf"
    cfg = sg.preset_config("tiny", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type=qtype, seed=11)
    sg.write_llama_gguf(path, cfg)
    with_pdl = _passes(str(path), rows, KernelOptions())  # the defaults: pdl on, the matmuls plainly
    without = _passes(str(path), rows, KernelOptions(pdl=False))
    assert np.isfinite(without).all()
    assert np.array_equal(with_pdl, without)
