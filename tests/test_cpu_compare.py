"""scripts/cpu_vs_llamacpp.py: its options, and its table and JSON on a tiny synthetic model.

The script runs as a user runs it (a child process: it sets the thread variables in its own
environment before numpy loads). The llama.cpp half needs llama-bench, which only
scripts/build_llama_cpp.sh builds (minutes); the test that needs it skips, saying so, where it is
not built, and no test builds it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ntx.shared.gguf_index import open_model
from tests.synth_models import write_tiny

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "cpu_vs_llamacpp.py"
FAST = ["--tokens", "4", "--rounds", "2", "--bw-mib", "16", "--bw-repeats", "2"]


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    return write_tiny(tmp_path_factory.mktemp("cmp"), type="Q4_1")


def default_llama_bench() -> pathlib.Path:
    """The script's own answer, asked in a child so its imports stay out of this process."""
    r = subprocess.run([sys.executable, "-c", "import runpy, sys; "
                        f"m = runpy.run_path({str(SCRIPT)!r}); print(m['default_llama_bench']())"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return pathlib.Path(r.stdout.strip())


@pytest.mark.parametrize("args, said", [
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--tokens", "0"], "--tokens 0: must be at least 1"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
    (["--pp", "-1"], "--pp -1: must be at least 0"),
    (["--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no such file"),
    (["--llama-bench", "/nonexistent/llama-bench"], "--llama-bench /nonexistent/llama-bench: no such executable"),
    (["--no-llama", "--llama-bench", "/bin/true"], "contradict each other"),
    (["--threads", "two"], "invalid int value: 'two'"),
    (["--llama-args='-ngl"], "No closing quotation"),
])
def test_bad_options_are_refused_with_one_line(args, said):
    r = run_script(*args)
    assert r.returncode == 2
    assert said in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def report_for(load: float, threads: int, cores: int = 2) -> str:
    """The script's table for a made-up result (one engine, no llama.cpp) at this load average."""
    import runpy

    render = runpy.run_path(str(SCRIPT))["render_report"]
    tg = {"mean": 10.0, "std": 1.0, "n": 2, "samples": [9.0, 11.0]}
    return render({
        "host": {"cpu": "x", "cores": cores, "cpu_count": cores, "mem_bytes": 1 << 30, "load_avg_1m_before": load,
                 "load_avg_1m_after": load},
        "threads": threads, "tokens": 4, "pp": 0, "rounds": 2, "bw_repeats": 2, "host_read_gbps": 10.0,
        "model": {"path": "m.gguf", "type": "Q4_1", "layers": 2, "bytes_per_token": 10**8},
        "engines": [{"label": "ntx cpu (in-process)", "tg_tps": tg}], "ratio": None,
    })


def test_report_warns_when_other_work_takes_the_cores():
    assert "warning: the machine is busy" not in report_for(load=0.2, threads=2)
    assert "warning: the machine is busy" not in report_for(load=1.2, threads=1)  # one core left free for it
    assert "load average up to 1.2 on 2 cores, with 2 threads wanted" in report_for(load=1.2, threads=2)
    assert "warning: the machine is busy" in report_for(load=2.0, threads=1)
    row = next(line for line in report_for(load=0.0, threads=1).splitlines() if line.startswith("ntx cpu"))
    assert row.split()[-4:] == ["±", "1.0", "1.00", "10.0%"]  # 10 tok/s x 100 MB = 1 GB/s, of 10 GB/s


def test_ntx_half_table_and_json_with_llama_bench_missing(tiny_model, tmp_path):
    """No llama-bench where the build would put it (an empty cache): the ntx figures, the limit
    and the skip reason; the JSON holds every round's sample and the thread count given to ntx."""
    out = tmp_path / "res.json"
    r = run_script("--model", str(tiny_model), "--threads", "1", "--pp", "8", "--json", str(out), *FAST,
                   env={"NTX_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "llama.cpp half skipped: llama-bench is not built" in r.stderr
    assert "scripts/build_llama_cpp.sh" in r.stderr
    res = json.loads(out.read_text())
    index = open_model(str(tiny_model))
    assert res["model"]["bytes_per_token"] == index.layer_bytes_total + index.globals["token_embd"].nbytes  # tied head
    assert res["threads"] == 1 and res["thread_env"]["NTX_CPU_THREADS"] == "1"
    assert res["host"]["cores"] >= 1 and res["host_read_gbps"] > 0
    ntx, llama = res["engines"]
    assert ntx["label"] == "ntx cpu (in-process)"
    assert ntx["tg_tps"]["n"] == 2 and len(ntx["tg_tps"]["samples"]) == 2 and ntx["tg_tps"]["mean"] > 0
    assert ntx["pp_tps"]["n"] == 2 and ntx["pp_tps"]["mean"] > 0
    assert ntx["tg_gbps"] == pytest.approx(ntx["tg_tps"]["mean"] * res["model"]["bytes_per_token"] / 1e9)
    assert "skipped" in llama and "tg_tps" not in llama
    assert res["ratio"] is None
    table = r.stdout
    assert "limit: memory read" in table and "MB of weights per token" in table
    assert f"{ntx['tg_tps']['mean']:9.1f}" in table
    assert "llama.cpp cpu (llama-bench)    skipped: llama-bench is not built" in table
    assert "goal" not in table  # no ratio without llama.cpp's figure


@pytest.mark.slow
def test_pipeline_row(tiny_model, tmp_path):
    """--pipeline: a real pipeline of its own (run folder, port), its decode tok/s as a third row,
    and nothing of it left behind."""
    out = tmp_path / "res.json"
    r = run_script("--model", str(tiny_model), "--threads", "1", "--no-llama", "--pipeline", "--json", str(out), *FAST,
                   env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    pipe = res["engines"][1]
    assert pipe["label"] == "ntx cpu (pipeline)" and pipe["tg_tps"]["n"] == 2 and pipe["tg_tps"]["mean"] > 0
    assert 1 <= pipe["completion_tokens"]["mean"] <= 5  # --tokens 4: at most 5 (the first comes from the prompt's pass)
    assert "ntx cpu (pipeline)" in r.stdout
    assert not list(tmp_path.glob("ntx-cmp-*"))  # its run folder is gone


def test_side_by_side_with_llama_bench(tiny_model, tmp_path):
    binary = default_llama_bench()
    if not binary.is_file():
        pytest.skip(f"llama-bench is not built ({binary}); scripts/build_llama_cpp.sh builds it (not run by tests)")
    out = tmp_path / "res.json"
    r = run_script("--model", str(tiny_model), "--threads", "1", "--json", str(out), "--llama-args=-ngl 0", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    ntx, llama = res["engines"]
    assert llama["label"] == "llama.cpp cpu (llama-bench)" and llama["tg_tps"]["n"] == 2
    assert llama["command"].split()[1:] == ["-m", str(tiny_model), "-t", "1", "-n", "4", "-p", "0", "-r", "1",
                                            "-o", "json", "-ngl", "0"]
    assert llama["llama_bench"]["n_threads"] == 1
    assert res["ratio"] == pytest.approx(ntx["tg_tps"]["mean"] / llama["tg_tps"]["mean"])
    assert f"ntx / llama.cpp decode: {res['ratio']:.2f}x (goal: at least 0.8x" in r.stdout
    assert res["round_ratios"] == pytest.approx([a / b for a, b in zip(ntx["tg_tps"]["samples"],
                                                                        llama["tg_tps"]["samples"])])
    assert "round by round" in r.stdout
