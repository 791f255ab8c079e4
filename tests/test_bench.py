"""``ntxctl bench`` on the cpu backend, end to end: real daemons for (a) and (b), the in-process
naive baseline (c) and the all-resident check, on a small synthetic model. What it must show is
the report's shape and honesty: stage figures taken over decode passes only, the limits measured
in the same run, the chart, and greedy tokens equal to the all-resident run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.synth_models import write_tiny
from tests.pipeline_util import free_port


@pytest.mark.slow
def test_bench_cpu_reports_decode_passes_limits_and_equal_tokens(tmp_path):
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "1", "--tokens", "6", "--scenarios", "a,b,c,check", "--out", str(out),
         "--listen", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "bench.json").read_text())
    assert rep["limits"]["host_copy_gbps"] > 0 and rep["limits"]["disk_read_gbps"] > 0
    by = {s["label"]: s for s in rep["scenarios"]}
    assert set(by) == {"a", "b", "c", "check"}
    assert by["a"]["plan_tiers"] == {"vram": 1, "ram": 3, "storage": 0}
    assert by["b"]["plan_tiers"] == {"vram": 1, "ram": 0, "storage": 3}
    for label in ("a", "b"):
        st = by[label]["stages"]
        # 6 tokens: one prefill pass, then 5 decode passes; the per-pass records cover the decode
        assert {"compute", "dma"} <= set(st), st
        assert st["compute"]["n_passes"] == 5, st["compute"]
        assert st["dma"]["bytes"] == 5 * by[label]["streamed_bytes_per_pass"], st["dma"]
        assert by[label]["bottleneck"] in st
        assert by[label]["tokens_per_s"] > 0 and by[label]["ratio_to_limit"] > 0
    assert "reader" in by["b"]["stages"]
    assert rep["greedy_equal"] is True
    assert rep["a_over_c"] > 0
    assert "(a)/(c)" in r.stdout and "limit" in r.stdout


@pytest.mark.slow
def test_bench_batch_stage_figures_cover_decode_passes_only(tmp_path):
    """Several concurrent requests prefill in one or more passes; the stage figures must leave
    every one of those out (the compute clock marks each pass's prompt rows)."""
    model = write_tiny(tmp_path, n_layers=3, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "1", "--tokens", "5", "--batch", "3", "--scenarios", "a", "--out", str(out),
         "--listen", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (a,) = json.loads((out / "bench.json").read_text())["scenarios"]
    comp = a["stages"]["compute"]
    assert comp["n_passes"] >= 2 and comp["prefill_rows"] == 0
    assert comp["n_passes"] <= comp["rows"] <= 3 * comp["n_passes"]
    assert a["stages"]["dma"]["n_passes"] == comp["n_passes"]
