"""scripts/profile_pass.py on the GPU: the spin holds the GPU while a pass is queued, so every
operation is timed back to back, and the check for idle time fires when the spin is too short."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

import profile_pass as pp  # noqa: E402  (scripts/, on sys.path through tests/conftest.py)
import synth_gguf as sg  # noqa: E402

N_LAYERS = 4
# llama_block's backend calls: the norms with their products, rope with the KV store, attention
# with W_o (apart where W_o's product is not the i16 matvec: CudaBackend.attention_fuses), swiglu
# with the down product
OPS_PER_LAYER = 5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    cfg = sg.preset_config("tiny", n_layers=N_LAYERS, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2,
                           vocab_size=1024, type="Q4_K_M", seed=7)
    return str(sg.write_llama_gguf(tmp_path_factory.mktemp("prof") / "m.gguf", cfg))


def test_decode_and_prefill_profiles_time_every_operation(model_path):
    report = pp.run(model_path, [1, 3], 80, reps=3, spin_ms=100.0, ctx=256)  # 80 rows: beyond the graphs
    assert set(report["passes"]) == {"decode_b1", "decode_b3", "prefill_80"}
    for name, prof in report["passes"].items():
        assert prof["exposed_ops"] == 0, name  # Python queued the whole pass while the GPU spun
        apart = sum(op["calls"] for op in prof["ops"] if op["op"] == "attention")  # attentions timed alone
        assert apart == {"decode_b1": 0, "prefill_80": N_LAYERS}.get(name, apart), name
        assert prof["ops_per_pass"] == 1 + N_LAYERS * OPS_PER_LAYER + apart + 2, name  # embed, layers, head, topk
        assert all(op["total_us"] > 0 for op in prof["ops"]), name
        assert 0 < prof["kernels_ms"] < 50, name  # the 100 ms spin is not inside the pass
        assert prof["queued_ms"] < 100, name
    assert report["passes"]["decode_b1"]["engine_pass"] == "graph"
    assert report["passes"]["prefill_80"]["engine_pass"] == "eager"


def test_a_spin_too_short_to_cover_the_queuing_is_reported(model_path):
    report = pp.run(model_path, [1], 0, reps=1, spin_ms=1e-3, ctx=256)
    assert report["passes"]["decode_b1"]["exposed_ops"] > 0
