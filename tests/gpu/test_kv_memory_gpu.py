"""The paged KV cache on the cuda backend: resident layers demoted for pages (streamed from the
file afterwards) and promoted back keep the greedy output token for token, and a shared prefix
reused from cached pages gives the tokens of a cold run. The cpu twins: tests/test_kv_memory.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

from ntx.ctl.local import LocalEngine  # noqa: E402
from ntx.daemons.compute.backend import make_backend  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.daemons.compute.residency import PROMOTE_AFTER_PASSES, Residency  # noqa: E402
from ntx.daemons.compute.sampler import SamplingParams  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
from ntx.shared.gguf_index import open_model  # noqa: E402
from ntx.shared.kv_sizing import KvSizing  # noqa: E402
from ntx.shared.messages import EngineRequest  # noqa: E402
from ntx.shared.plan import demotion_order  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)

from ..test_kv_memory import run  # noqa: E402  (greedy tokens of prompts submitted at once)

N_LAYERS = 8
STREAMED = (2, 5)  # read from the file every pass from the start


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvgpu") / "kv-q4km.gguf"
    cfg = sg.preset_config("tiny", n_layers=N_LAYERS, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type="Q4_K_M", seed=5)
    sg.write_llama_gguf(path, cfg)
    return open_model(path)


def _paged(index, n_chunks: int, max_chunks: int, **kw) -> LocalEngine:
    backend = make_backend("cuda", index, max_seqs=2, max_ctx=512, kv=KvSizing(2, n_chunks, max_chunks))
    return LocalEngine(build_engine(index, backend, EngineOptions(max_batch=2, ctx=512), **kw))


def test_demoted_and_promoted_layers_keep_every_token_on_the_gpu(index):
    """Two of eight layers streamed and a pool of 4 pages: a 200-token prompt needs more, so
    resident layers are demoted (their device memory becomes pages; from then on they stream
    from the file); the tokens are the all-resident engine's. After PROMOTE_AFTER_PASSES passes
    with plenty of pages the last one is promoted back, and short requests keep their tokens."""
    roomy = LocalEngine(build_engine(index, "cuda", EngineOptions(max_batch=2, ctx=512)))
    long = {"long": [(7 * i + 3) % 1000 + 1 for i in range(200)]}
    short = {"s": [504, 357, 282, 464, 314, 17, 300]}
    want = run(roomy, long, 10)
    want_short = run(roomy, short, PROMOTE_AFTER_PASSES + 10)
    resident = [i for i in range(N_LAYERS) if i not in STREAMED]
    eng = _paged(index, n_chunks=2, max_chunks=400, resident_layers=resident)
    model = eng.core.model
    costs = model.backend.memory_costs(index, max_seqs=1, max_ctx=1, max_pass_rows=1)
    room = eng.core.kv_room = Residency(model, demotion_order(resident), costs.layer_bytes)
    assert run(eng, long, 10) == want
    demoted = list(room.demoted)
    assert demoted and all(i not in model.resident for i in demoted)
    assert set(model.streamed_layers) == set(STREAMED) | set(demoted)
    assert run(eng, short, PROMOTE_AFTER_PASSES + 10) == want_short
    assert len(room.demoted) == len(demoted) - 1 and demoted[-1] in model.resident


def test_a_reused_prefix_gives_the_tokens_of_a_cold_run_on_the_gpu(index):
    """The same 100-token prompt twice: the second prefills only past its cached pages (its
    last page is always run) and decodes the cold run's tokens."""
    eng = _paged(index, n_chunks=64, max_chunks=64)
    prompt = [(11 * i + 5) % 1000 + 1 for i in range(100)]
    first = run(eng, {"a": prompt}, 12)
    eng.submit(EngineRequest("b", list(prompt), SamplingParams(temperature=0.0, max_tokens=12)))
    events = eng.step()
    assert eng.core.last_pass[2] == 100 - 96  # prompt rows of that pass: the last page's 4 tokens
    while eng.has_work:
        events += eng.step()
    assert [ev["token"] for ev in events if ev["type"] == "token"] == first["a"]
    assert eng.core.model.backend.kv_stats().prefix_hit_tokens == 96
