"""What the cuda backend holds on the device against what the planner reserves for it.

The planner sums named layouts (memory.py) and adds ``ALLOCATOR_SLACK_BYTES`` for what no layout
covers: cuBLAS's workspace, the loaded kernel modules, the CUDA graphs' own memory, cupy's pool
rounding, the head's small selection buffers, and whatever the loading leaves in cupy's pool.
This measures that remainder on the device, after the warm-up and after the largest pass the
engine can run (``EngineOptions.largest_pass_rows``: a prompt chunk beside every other
sequence's decode row, or every sequence with its draft tree), and fails if it outgrows the
slack: the plan would then promise the user's ``--vram-budget`` more than it keeps. The figure
is printed either way, for tuning the slack (docs/PERFORMANCE.md, "Where the 24 GiB went").
Kernel modules that earlier tests of the same run loaded are not counted again: run this file
alone for the whole figure.
"""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.daemons.compute.cuda.memory import ALLOCATOR_SLACK_BYTES, cuda_memory_costs  # noqa: E402
from ntx.daemons.compute.factory import build_engine  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402
from ntx.shared.gguf_index import open_model  # noqa: E402
import synth_gguf as sg  # noqa: E402  (scripts/synth_gguf, on sys.path through tests/conftest.py)

MiB = 1 << 20


def _device_used_bytes() -> int:
    """Bytes of the device in use: every process's (a test run has the device to itself), cupy's
    pool with its freed blocks included (they stay the process's)."""
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


def test_what_no_layout_covers_stays_within_the_slack(tmp_path, capsys):
    path = tmp_path / "vram-q4km.gguf"
    sg.write_llama_gguf(path, sg.preset_config("tiny", n_layers=4, d_model=1024, d_ff=2816, n_heads=16,
                                               n_kv_heads=4, vocab_size=8192, type="Q4_K_M", seed=3))
    index = open_model(path)
    options = EngineOptions(max_batch=4, ctx=1024, draft="ngram", draft_tokens=8)
    rows = options.largest_pass_rows  # 512 + 3
    cp.zeros(1)  # the context exists before the baseline: it is the device's, not the plan's
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    before = _device_used_bytes()

    engine = build_engine(index, "cuda", options)  # every layer resident; warmed up
    backend = engine.model.backend
    backend.alloc_sequence(99, rows)
    engine.model.forward(StepBatch([SeqChunk(99, 0, tuple(range(1, rows + 1)))]))  # the largest eager pass
    backend.sync()
    used = _device_used_bytes() - before

    costs = cuda_memory_costs(index, max_seqs=options.max_batch, max_ctx=options.ctx, max_pass_rows=rows)
    kv_bytes = backend.kv_stats().pages_total * backend.kv_page_bytes()
    laid_out = sum(costs.layer_bytes) + costs.globals_bytes + kv_bytes + costs.workspace_bytes - ALLOCATOR_SLACK_BYTES
    outside = used - laid_out
    pool = cp.get_default_memory_pool()
    line = (f"device memory beyond the layouts after the warm-up and a {rows}-row pass: {outside / MiB:.1f} MiB "
            f"(slack {ALLOCATOR_SLACK_BYTES / MiB:.0f} MiB); used {used / MiB:.1f} MiB, laid out "
            f"{laid_out / MiB:.1f} MiB; cupy's pool holds {pool.total_bytes() / MiB:.1f} MiB, "
            f"{pool.used_bytes() / MiB:.1f} MiB of it in use")
    with capsys.disabled():
        print("\n" + line)
    assert outside <= ALLOCATOR_SLACK_BYTES, line
