"""``ntxctl bench`` on the cpu backend, end to end: real daemons for (a) and (b), the in-process
naive baseline (c) and the all-resident check, on a small synthetic model. What it must show is
the report's shape and honesty: stage figures taken over decode passes only, the limits measured
in the same run, the chart, and greedy tokens equal to the all-resident run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from ntx.shared.config import InstanceConfig
from tests.synth_models import write_tiny
from tests.pipeline_util import free_port


@pytest.mark.slow
def test_bench_cpu_reports_decode_passes_limits_and_equal_tokens(tmp_path):
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "1", "--tokens", "6", "--scenarios", "a,b,c,check,skip", "--skip-layers", "2", "--out", str(out),
         "--ring-slots", "3",
         "--listen", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "bench.json").read_text())
    assert rep["limits"]["host_copy_gbps"] > 0 and rep["limits"]["disk_read_gbps"] > 0
    by = {s["label"]: s for s in rep["scenarios"]}
    assert set(by) == {"a", "b", "c", "check", "skip"}
    assert by["a"]["plan_tiers"] == {"vram": 1, "cpu": 0, "ram": 3, "storage": 0, "skipped": 0}
    assert {by[k]["status"]["plan"]["n_slots"] for k in ("a", "b", "skip")} == {3}  # --ring-slots reaches them
    assert by["b"]["plan_tiers"] == {"vram": 1, "cpu": 0, "ram": 0, "storage": 3, "skipped": 0}
    # (skip): (a) without layer 2, whose bytes no pass moves any more
    assert by["skip"]["plan_tiers"] == {"vram": 1, "cpu": 0, "ram": 2, "storage": 0, "skipped": 1}
    assert by["skip"]["skipped_layers"] == [2]
    assert by["skip"]["streamed_bytes_per_pass"] == by["a"]["streamed_bytes_per_pass"] - by["skip"]["skipped_bytes_per_pass"]
    assert rep["skip_over_a"] > 0 and "(skip)/(a)" in r.stdout and "never read nor copied" in r.stdout
    for label in ("a", "b", "skip"):
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


@pytest.mark.slow
def test_bench_spec_times_verify_passes_and_controlled_acceptance_with_the_replay_drafter(tmp_path):
    """``--scenarios a,spec`` on the cpu backend: a plain run records the replay reference; chains of
    1 and 4 drafted tokens are timed on compute's clock over their verify passes (every draft
    right: 1 and 4 accepted a pass); at K = 4 the acceptance length asked (4: p = 0) is what is
    measured, and with every draft wrong nothing is accepted. The draft model given runs behind
    the replay in those two runs. At --spec-batch 2 both cases run again beside plain batch 2, each
    sequence verifying its own chains in the shared passes. Every spec line says replay."""
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    # The draft model is a quarter of the target: the tree shape weighs a draft depth's time against a
    # verify pass's and turns drafting off when it does not pay, which a stall on a busy machine
    # must not bring about in a test of controlled acceptance.
    draft = write_tiny(tmp_path, name="draft.gguf", n_layers=1, type="Q8_0")
    out = tmp_path / "out"
    # a real drafter's passes (scripts/draft_acceptance.py --trace-out): 4 drafted, 2 accepted; then none
    trace = tmp_path / "trace-ngram-edit.json"
    trace.write_text(json.dumps({"label": "ngram edit", "acceptance_length": 2.0, "tokens_per_decode_pass": 2.0,
                                 "trace": [[4, 2], [0, 0]]}))
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "1", "--tokens", "4", "--scenarios", "a,spec", "--out", str(out),
         "--listen", f"tcp://127.0.0.1:{free_port()}", "--spec-verify-draft-tokens", "1,4",
         "--spec-verify-passes", "2", "--spec-accept-draft-tokens", "4", "--spec-accept-length", "4",
         "--spec-tokens", "11", "--draft-model", str(draft), "--spec-batch", "2", "--spec-accept-trace", str(trace)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "bench.json").read_text())
    a, spec = rep["scenarios"]
    assert a["label"] == "a" and spec["label"] == "spec" and spec["drafter"] == "replay"
    ref = json.loads((out / "replay.json").read_text())["sequences"]
    assert len(ref) == 1 and spec["reference_tokens"] == 11  # 1 + 2 passes x (4 + 1), the longest run
    assert spec["plain"]["pass_s"] > 0 and spec["plain"]["n_passes"] == 10 and spec["plain"]["tokens_per_s"] > 0
    assert spec["link_pass_s"] > 0 and spec["plan_tiers"]["vram"] == 1
    assert [v["draft_tokens"] for v in spec["verify"]] == [1, 4]
    for v in spec["verify"]:
        assert v["n_passes"] == 2 and v["pass_s"] > 0 and v["ratio_to_plain_pass"] > 0
        assert v["accepted_per_pass"] == v["draft_tokens"]
    right, wrong, traced = spec["acceptance"]
    # the trace's passes, replayed as they were: 2 accepted of every 4 drafted, passes without drafts
    # between (fewer at the end, where max_tokens leaves less room)
    assert traced["case"] == "trace ngram edit" and traced["p_wrong"] is None and traced["expected_length"] == 2.0
    assert traced["trace"]["expected_tokens_per_decode_pass"] == 2.0 and traced["trace"]["passes"] == 2
    assert 1.0 <= traced["accepted_per_pass"] <= 2.0 and 0 < traced["acceptance_rate"] < 1.0
    assert traced["tokens_per_s"] > 0 and "met" not in traced
    # every draft right: all accepted, chains of up to 4 (the shape sizes them to what a pass costs)
    assert right["p_wrong"] == 0.0 and right["expected_length"] == 4 and 1.0 <= right["accepted_per_pass"] <= 4.0
    assert right["acceptance_rate"] == 1.0
    # every draft wrong: nothing accepted; verify passes only while the shape still drafts (shadow
    # probes measure acceptance without one), judged against the same instance's plain request
    assert wrong["p_wrong"] == 1.0 and wrong["accepted_per_pass"] == 0.0
    assert (wrong["verify_passes"] == 0) == (wrong["pass_s"] is None)
    assert wrong["plain_same_instance_tokens_per_s"] > 0 and wrong["ratio_to_plain_same_instance"] > 0
    assert "met" in wrong and "goal" not in right  # the tok/s goal is judged at acceptance length 6 only
    assert right["pass_s"] > 0 and "plain_same_instance_tokens_per_s" not in right
    for point in (right, wrong):
        assert point["tokens_per_s"] > 0 and point["ratio_to_plain"] > 0
        assert point["draft_model"] == str(draft)
    b = spec["batch"]
    assert b["batch"] == 2 and [x["case"] for x in b["runs"]] == ["plain", "acceptance length 4", "every draft wrong"]
    plain_b, right_b, wrong_b = b["runs"]
    assert all(x["tokens_per_s"] > 0 for x in b["runs"]) and plain_b["speculation"] is None
    assert plain_b["plan_tiers"] == right_b["plan_tiers"] == wrong_b["plan_tiers"]
    assert right_b["speculation"]["acceptance_rate"] == 1.0 and right_b["ratio_to_plain"] > 0 and "met" in right_b
    assert wrong_b["speculation"]["accepted"] == 0
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("(spec) ") and "plain" not in ln.split(":")[0]]
    assert len(lines) >= 8 and all("replay" in ln for ln in lines), r.stdout
    # the trace's 2 passes make 5 tokens (the prefill's, 2 + 1, 0 + 1), cycled to fill --spec-tokens
    assert any("(trace ngram edit, 2 passes of 5 tokens cycled in 11;" in ln for ln in lines), r.stdout


def test_batch_runs_with_and_without_drafts_plan_the_same_largest_pass(tmp_path):
    """The batch runs of ``--scenarios spec`` compare plain and speculative instances: each gets
    the prompt chunk that makes its largest pass (chunk beside the other sequences' chains) the
    replay's, so their workspaces, and so their resident layers, are the same."""
    from ntx.ctl.bench import _with_largest_pass

    base = InstanceConfig(model=str(write_tiny(tmp_path, n_layers=2, type="Q8_0")), backend="cuda", max_batch=8)
    replay = replace(base, draft_tokens=16, draft_replay=str(tmp_path / "replay.json")).validate()
    assert replay.largest_pass_rows == base.largest_pass_rows == 512 + 7  # drafts take what a chunk leaves
    assert _with_largest_pass(base, 512 + 7) == base and _with_largest_pass(replay, 512 + 7) == replay
    wide = replace(replay, max_batch=64).validate()  # 64 chains of 17 outgrow a chunk beside 63 rows
    rows = wide.largest_pass_rows
    assert rows == 64 * 17
    plain = _with_largest_pass(replace(base, max_batch=64), rows)
    assert plain.largest_pass_rows == rows and plain.prefill_chunk_tokens == rows - 63
    assert _with_largest_pass(wide, rows) == wide


@pytest.mark.slow
@pytest.mark.parametrize("passes", [3, 1])
def test_bench_spec_times_every_chain_length_asked_for_its_passes_of_k_plus_1_rows(tmp_path, passes):
    """Every chain length asked for gets ``--spec-verify-passes`` timed verify passes of exactly
    K + 1 rows, whatever the plan and ``--spec-tokens``: here nothing streams, so on the CPU a
    pass of K + 1 rows costs many 1-token passes and the tree shape's back-off, left to itself,
    would draft less (or nothing) in some of those passes and leave their chains untimed. With one
    pass each, every chain runs in one instance (its chains the longest asked for, each request's
    max_tokens leaving room for its K only)."""
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    ks = [1, 16, 32, 64]
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "4", "--scenarios", "spec", "--out", str(out), "--listen", f"tcp://127.0.0.1:{free_port()}",
         "--spec-verify-draft-tokens", ",".join(map(str, ks)), "--spec-verify-passes", str(passes),
         "--spec-accept-draft-tokens", "2", "--spec-accept-length", "1", "--spec-tokens", "2"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (spec,) = json.loads((out / "bench.json").read_text())["scenarios"]
    assert [(v["draft_tokens"], v["n_passes"], v["accepted_per_pass"]) for v in spec["verify"]] == \
        [(k, passes, float(k)) for k in ks], r.stdout
    # one instance (the same start for every chain), or one a chain (start times may round alike)
    assert [v["instance"] for v in spec["verify"]] == ([0] * len(ks) if passes == 1 else list(range(len(ks))))
    assert passes != 1 or len({v["start_s"] for v in spec["verify"]}) == 1
    chains = [ln for ln in r.stdout.splitlines() if "verify pass, chain of" in ln]
    assert len(chains) == len(ks) and not any("n/a" in ln for ln in chains), r.stdout
    assert all(v["pass_s"] > 0 for v in spec["verify"])


def test_bench_spec_says_up_front_what_it_cannot_time(tmp_path):
    """A chain that the model's context cannot hold, or more timed passes than compute's status
    keeps, is one line naming the fix before anything runs, not a chain reported as n/a."""
    from ntx.ctl.bench import SPEC_PROMPT_POSITIONS, spec_positions
    from ntx.ctl.bench_options import SpecOptions
    from ntx.shared.errors import ConfigError
    from ntx.shared.gguf_index import open_model

    index = open_model(write_tiny(tmp_path, context_length=512))
    assert spec_positions(SpecOptions(verify_draft_tokens=(1, 128)), index) == 1 + 2 * 129 + 64
    with pytest.raises(ConfigError, match=r"need 579 positions .* trained for 512: chains "
                                          r"\(--spec-verify-draft-tokens\) of at most 222 tokens at --spec-verify-passes 2"):
        spec_positions(SpecOptions(verify_draft_tokens=(1, 256)), index)
    with pytest.raises(ConfigError, match=r"--spec-tokens at most 448"):
        spec_positions(SpecOptions(verify_draft_tokens=(1,), accept_tokens=600), index)
    # a trace replays whole: 1 + 300 passes x (2 + 1) tokens
    from ntx.daemons.compute.replay import trace_tokens

    long_trace = [(4, 2)] * 300
    assert trace_tokens(long_trace, 4) == 901 and trace_tokens(long_trace, 1) == 601  # cut to chains of 1
    opts = SpecOptions(verify_draft_tokens=(1,), accept_traces=("/x/trace-ngram-summarise.json",),
                       trace_tokens=(trace_tokens(long_trace, 8),))
    assert opts.reference_tokens == 901 and opts.trace_run_tokens(0) == 901
    with pytest.raises(ConfigError, match=r"a shorter --spec-accept-trace than trace-ngram-summarise.json"):
        spec_positions(opts, index)
    with pytest.raises(ConfigError, match=r"--spec-verify-passes 40: from 1 to 31"):
        SpecOptions(verify_passes=40).validate()
    # the trace alone (--spec-cases with none of the others): its reference is the trace's, not the chains'
    only = SpecOptions(verify_draft_tokens=(512,), accept_tokens=16, accept_traces=("/x/t.json",), trace_tokens=(40,),
                       cases=()).validate()
    assert only.reference_tokens == 40 and spec_positions(only, index) == 40 + SPEC_PROMPT_POSITIONS
    assert SpecOptions(verify_draft_tokens=(8,), cases=("verify",)).reference_tokens == 1 + 2 * 9
    with pytest.raises(ConfigError, match=r"--spec-cases verify,plain: 'plain' is none of verify, controlled, wrong"):
        SpecOptions(cases=("verify", "plain")).validate()
    # the CLI says it before the limits are measured or any scenario runs
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(index.path), "--backend", "cpu",
         "--scenarios", "a,spec", "--out", str(tmp_path / "out"), "--spec-verify-draft-tokens", "1,256"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run")),
    )
    assert r.returncode == 1 and "at most 222 tokens" in r.stderr and "limits:" not in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_bench_kv_scenarios_default_flags_long_prompts_one_long_sequence_and_a_cached_prefix(tmp_path):
    """(a) at start's default flags beside (a512) at --ctx 512; (long) concurrent long prompts all
    complete, reported against the plan in force; (ctx) one sequence's long prompt; (prefix) a
    request with a cached prefix reuses it (its first token no slower than a cold one)."""
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu",
         "--gpu-layers", "1", "--tokens", "4", "--scenarios", "a,a512,long,ctx,prefix", "--long", "3,200",
         "--ctx-prompt", "600", "--out", str(out), "--listen", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "bench.json").read_text())
    by = {s["label"]: s for s in rep["scenarios"]}
    assert set(by) == {"a", "a512", "long", "ctx", "prefix"}
    assert by["a512"]["ctx"] == 512 and by["a"]["ctx"] > 512 and by["a"]["max_batch"] == 16
    assert rep["a_over_a512"] > 0 and "(a512)" in r.stdout
    assert by["long"]["completed"] == 3 and by["long"]["tokens_per_s"] > 0
    assert by["long"]["limit_tokens_per_s"] > 0 and "limit for the plan in force" in r.stdout
    assert by["ctx"]["completed"] == 1 and by["ctx"]["prompt_tokens"] == 600
    assert by["prefix"]["prefix_hit_tokens"] >= 192  # the cached 200-token prefix: six whole pages
    assert by["prefix"]["first_token_reused_s"] > 0 and by["prefix"]["first_token_short_s"] > 0


@pytest.mark.slow
def test_bench_on_a_model_that_streams_nothing_says_so_and_what_to_pass(tmp_path):
    """Every layer fits (no --gpu-layers, the cpu backend's default budget): bench says nothing
    streams and how to make layers stream; compute's figures are true (busy, the bottleneck),
    not 0 % and none."""
    model = write_tiny(tmp_path, n_layers=4, type="Q8_0")
    out = tmp_path / "out"
    env = dict(os.environ, NTX_RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "bench", "--model", str(model), "--backend", "cpu", "--tokens", "6",
         "--scenarios", "a", "--out", str(out), "--listen", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    note = next(ln for ln in r.stdout.splitlines() if ln.startswith("nothing streams: "))
    assert note.startswith("nothing streams: all 4 layers fit the --vram-budget of ") and "--gpu-layers 2: 2 layers " \
        "stream" in note and "a --vram-budget too small for every layer" in note, note
    (a,) = json.loads((out / "bench.json").read_text())["scenarios"]
    assert a["plan_tiers"]["vram"] == 4 and a["streamed_bytes_per_pass"] == 0
    assert "(a) " in r.stdout and "nothing streamed (every layer resident)" in r.stdout
    assert a["stages"]["compute"]["n_passes"] == 5 and a["stages"]["compute"]["busy_share"] > 0.9, a["stages"]
    assert a["bottleneck"] == "compute" and "bottleneck: None" not in r.stdout


def test_a_verify_run_that_left_its_recording_says_why_and_the_fix():
    """A chain run drafts the recording's own greedy tokens (p = 0): fewer accepted means the
    target's wide pass rounded differently from the one-row passes that recorded it (on the
    H200 every chain over 64 rows, through cuBLAS, left the synthetic 70B's recording)."""
    from ntx.ctl.bench import _spec_verify_line

    kept = {"draft_tokens": 16, "p_wrong": 0.0, "pass_s": 0.3746, "ratio_to_plain_pass": 1.011,
            "ratio_to_link_pass": 1.024, "n_passes": 1, "accepted_per_pass": 16.0}
    left = dict(kept, draft_tokens=64, pass_s=None, ratio_to_plain_pass=None, ratio_to_link_pass=None, n_passes=0,
                accepted_per_pass=13.0)
    assert "left its recording" not in _spec_verify_line(kept)
    line = _spec_verify_line(left)
    assert "chain of 64 drafted: n/a" in line and "--kernels batch-invariant=on" in line and "\n" not in line


@pytest.mark.slow
def test_timed_runs_keep_every_pass_and_stop_a_chain_once_its_passes_are_timed(tmp_path, run_dir, smollm2_path):
    """A verify chain whose drafts are rejected (here: every draft wrong; on the GPU a wide pass
    rounding a near tie the other way) goes on a token a pass. Compute's status keeps its last
    KEEP_PASSES passes only, so the bench reads it while the request runs and keeps what it saw:
    more than KEEP_PASSES passes of K + 1 rows timed. With ``stop_after`` the warm-up and the
    timed request are cancelled once their passes of K + 1 rows ended, instead of running to
    max_tokens. The real SmolLM2: compute reports its clock every STATS_INTERVAL_S, and a few
    hundred of its passes span several reports."""
    from dataclasses import replace

    from ntx.ctl import bench
    from ntx.daemons.compute.replay import write_references
    from ntx.shared.config import InstanceConfig
    from ntx.shared.gguf_index import open_model
    from ntx.shared.stats import KEEP_PASSES

    index = open_model(str(smollm2_path))
    base = InstanceConfig(model=str(smollm2_path), name="watch", backend="cpu", listen=f"tcp://127.0.0.1:{free_port()}",
                          max_batch=1, ctx=400, prefill_chunk_tokens=8).validate()
    plain = bench._timed_instance(base, index, 2, 320)
    replay = tmp_path / "replay.json"
    write_references(replay, [plain["done"]["prompt_tokens"] + plain["done"]["tokens"]])
    wrong = replace(base, draft_tokens=4, draft_width=1, draft_fixed=True, draft_replay=str(replay),
                    draft_replay_p=1.0).validate()
    every = bench._timed_instance(wrong, index, 2, 250)
    assert len(every["done"]["tokens"]) == 250
    assert len(every["pass_s_by_rows"].get(5, [])) > KEEP_PASSES  # each pass of 5 rows yields one token
    stopped = bench._timed_instance(wrong, index, 6, 300, stop_after=(5, 2))
    assert stopped["done"]["finish_reason"] == "cancelled" and len(stopped["done"]["tokens"]) < 300
    assert len(stopped["pass_s_by_rows"].get(5, [])) >= 2
