"""Does the cpu backend's output depend on the CPU it was compiled for? Each target in a child
process (``NUMBA_CPU_NAME``, its own numba cache), the real SmolLM2 over the nine texts of
scripts/draft_tasks: the log-probability of each prompt token (``prompt_logprobs``), compared
between targets and with the float32 reference (``--kernels cpu-quantized=off``), and each
text's 96 greedy tokens, compared as a whole.

Why. The acceptance figures of issue 28 are measured on the CPU's greedy text. The same code
gave other figures on two VMs (docs/PERFORMANCE.md, "Acceptance on real text": 1.50 against 1.91
accepted a verify pass summarising). The int8 products are exact integer sums with their float
steps in a fixed order (no fast-math), so they agree bit for bit on every target; the norm's
float reduction (and attention's) is fast-math (``cpu_ops``: ``reassoc``), so LLVM vectorizes it
at the width the target prefers: 256-bit vectors on LLVM's Intel targets, AVX-512 or not
(``prefer-256-bit``) and on AVX2 CPUs, 512-bit ones on AMD Zen 4. The int8 rounding of the
activations that follows turns a difference in the last bit into a different rounding, layer
after layer, until the two are as far apart as either is from the float32 reference. So
``cpu_kernels._pin_vector_width`` compiles every kernel with ``prefer-256-bit``: a named target
(``znver4``) now gives the host's bits, and ``NAME,-prefer-256-bit`` (features given, so the pin
leaves them) still shows the unpinned ones.

    python dev/cpu/vector_width.py --targets host host,-prefer-256-bit --json F   # about 2 min on the VM
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENS = 96


def child(kernels: str) -> dict:
    """This process's figures: prompt log-probabilities and greedy tokens of each text."""
    sys.path.insert(0, str(REPO / "scripts"))
    from draft_acceptance import tasks

    from ntx.ctl.local import build_local_engine
    from ntx.ctl.models import ensure_default_model
    from ntx.shared.config import EngineOptions
    from ntx.shared.messages import EngineRequest
    from ntx.shared.sampling_fields import SamplingParams

    eng = build_local_engine(str(ensure_default_model()), "cpu",
                             options=EngineOptions(max_batch=1, ctx=2048, kernels=kernels))
    out: dict[str, dict] = {}
    for name, (_, msgs) in tasks().items():
        eng.submit(EngineRequest(name, eng.prompt_tokens(messages=msgs),
                                 SamplingParams(temperature=0.0, max_tokens=TOKENS), prompt_logprobs=1))
        rec = out.setdefault(name, {"tokens": [], "prompt_logprobs": None})
        while eng.has_work:
            for ev in eng.step():
                if ev.get("prompt_logprobs") is not None:
                    # each position's entry: [[its own token, log-probability], top...]; the first none
                    rec["prompt_logprobs"] = [None if e is None else e[0][1] for e in ev["prompt_logprobs"]]
                if ev["type"] == "done":
                    rec["tokens"] = list(ev["tokens"])
                elif ev["type"] == "error":
                    raise SystemExit(ev["message"])
    return out


def run_target(target: str, cache_root: Path) -> dict:
    """``target``: "host" (numba's default), "reference", an LLVM CPU name (compiled with that
    CPU's own features) or either followed by feature changes to this host's features, e.g.
    ``host,-prefer-256-bit`` (LLVM's Intel targets prefer 256-bit vectors even with AVX-512)."""
    env = dict(os.environ)
    kernels = ""
    name, *changes = target.split(",")
    if target == "reference":
        kernels = "cpu-quantized=off"
    elif target != "host":
        import llvmlite.binding as llvm

        features = ",".join([llvm.get_host_cpu_features().flatten(), *changes]) if changes else ""
        env.update(NUMBA_CPU_NAME=llvm.get_host_cpu_name() if name == "host" else name,
                   NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(cache_root / target.replace(",", "_")))
    r = subprocess.run([sys.executable, __file__, "--child", kernels], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"target {target}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["host", "host,-prefer-256-bit"],
                    help="host, an LLVM CPU name, or either with feature changes (run_target)")
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child)))
        return 0
    import llvmlite.binding as llvm

    with tempfile.TemporaryDirectory(prefix="ntx-vector-width-") as caches:
        runs = {t: run_target(t, Path(caches)) for t in [*a.targets, "reference"]}
    report: dict = {"host_cpu": llvm.get_host_cpu_name(), "tokens": TOKENS, "targets": {}, "pairs": []}
    for t, res in runs.items():
        report["targets"][t] = {name: {"greedy_tokens": len(r["tokens"]),
                                       "greedy_md5": hashlib.md5(str(r["tokens"]).encode()).hexdigest()[:8]}
                                for name, r in res.items()}
    print(f"host CPU (LLVM): {report['host_cpu']}")
    for x, y in itertools.combinations(runs, 2):
        diffs = [abs(p - q) for name in runs[x] for p, q in zip(runs[x][name]["prompt_logprobs"],
                                                                runs[y][name]["prompt_logprobs"])
                 if p is not None and q is not None]
        same = [name for name in runs[x] if runs[x][name]["tokens"] == runs[y][name]["tokens"]]
        pair = {"a": x, "b": y, "positions": len(diffs), "bitwise_equal": sum(d == 0 for d in diffs),
                "mean_abs_logprob_diff": statistics.mean(diffs), "max_abs_logprob_diff": max(diffs),
                "greedy_texts_equal": len(same), "texts": len(runs[x])}
        report["pairs"].append(pair)
        print(f"{x:>15} / {y:<15} prompt log-probabilities: {pair['bitwise_equal']}/{len(diffs)} bitwise equal, "
              f"mean |diff| {pair['mean_abs_logprob_diff']:.4f}, max {pair['max_abs_logprob_diff']:.4f}; "
              f"greedy texts equal: {len(same)}/{len(runs[x])}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
