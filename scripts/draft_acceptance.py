#!/usr/bin/env python3
"""Acceptance of drafting without a draft model on real text: three tasks shipped in
scripts/draft_tasks (summarise a document, rewrite a source file with one change, a chat whose
last turn asks to repeat an earlier answer), each run greedily through the in-process engine
plain and with each drafter, on the real SmolLM2 by default (real weights only: synthetic
models measure speed, not acceptance).

For each task and drafter it prints the acceptance length (drafted tokens accepted per verify
pass), the tokens each decode pass yields (every pass counted, drafted or not), and whether the
greedy tokens equal the plain run's. ``suffix`` runs the tasks in order in one engine, so a task
can draw on the text of the ones before it.

    python scripts/draft_acceptance.py [--model M] [--backend cpu] [--tokens 96] [--draft-tokens 8]
        [--drafters ngram:1 ngram:auto suffix:auto] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ntx.ctl.local import build_local_engine
from ntx.ctl.models import ensure_default_model
from ntx.shared.config import EngineOptions
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams

TASKS_DIR = Path(__file__).resolve().parent / "draft_tasks"


def tasks() -> dict[str, list[dict[str, str]]]:
    """Each task as chat messages."""
    doc = (TASKS_DIR / "summarise.txt").read_text()
    src = (TASKS_DIR / "edit.py").read_text()
    return {
        "summarise": [{"role": "user", "content": f"{doc}\nSummarise the text above in four sentences, using its own "
                                                  "words where you can."}],
        "edit": [{"role": "user", "content": f"Here is a Python file:\n\n```python\n{src}```\n\nRewrite the whole file "
                                             "with the function `clean` renamed to `clean_readings`. Output only the "
                                             "file."}],
        "chat": json.loads((TASKS_DIR / "chat.json").read_text()),
    }


def run_task(engine, prompt: list[int], n: int) -> dict:
    """One greedy request alone: its tokens, speculation counts and decode passes."""
    first_pass = engine.core.model.next_pass_id
    t0 = time.monotonic()
    engine.submit(EngineRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=n)))
    done = None
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                done = ev
            elif ev["type"] == "error":
                raise RuntimeError(ev["message"])
    passes = engine.core.model.next_pass_id - first_pass
    decode_passes = passes - math.ceil(len(prompt) / engine.core.prefill_chunk_tokens)
    tokens = done["tokens"]
    return {"tokens": tokens, "speculation": done.get("speculation"), "seconds": round(time.monotonic() - t0, 2),
            "decode_passes": decode_passes,
            "tokens_per_decode_pass": round((len(tokens) - 1) / decode_passes, 3) if decode_passes > 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--drafters", nargs="+", default=["ngram:1", "ngram:auto", "suffix:auto"],
                    help="KIND:WIDTH, KIND ngram or suffix, WIDTH a number or auto")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or str(ensure_default_model())
    ctx = 2048

    plain = build_local_engine(model, a.backend, options=EngineOptions(max_batch=1, ctx=ctx))
    prompts = {name: plain.prompt_tokens(messages=msgs) for name, msgs in tasks().items()}
    want = {name: run_task(plain, p, a.tokens) for name, p in prompts.items()}
    print(f"{model} ({a.backend}): {a.tokens} greedy tokens a task; prompts "
          + ", ".join(f"{k} {len(p)} tokens" for k, p in prompts.items()), flush=True)
    for name, r in want.items():
        print(f"  plain {name:>9}: {r['seconds']:.1f} s, {r['decode_passes']} decode passes", flush=True)
    rows = []
    for spec in a.drafters:
        kind, _, width = spec.partition(":")
        eng = build_local_engine(model, a.backend, options=EngineOptions(
            max_batch=1, ctx=ctx, draft=kind, draft_tokens=a.draft_tokens,
            draft_width=None if width in ("", "auto") else int(width)))
        for name, p in prompts.items():
            got = run_task(eng, p, a.tokens)
            sp = got["speculation"] or {}
            row = {"task": name, "drafter": kind, "width": width or "auto", "draft_tokens": a.draft_tokens,
                   "verify_passes": sp.get("verify_passes", 0), "drafted": sp.get("drafted", 0),
                   "accepted": sp.get("accepted", 0), "acceptance_length": sp.get("accepted_per_pass", 0.0),
                   "acceptance_rate": sp.get("acceptance_rate", 0.0), "decode_passes": got["decode_passes"],
                   "tokens_per_decode_pass": got["tokens_per_decode_pass"],
                   "plain_decode_passes": want[name]["decode_passes"], "identical": got["tokens"] == want[name]["tokens"],
                   "seconds": got["seconds"], "plain_seconds": want[name]["seconds"]}
            rows.append(row)
            print(f"  {kind}:{width or 'auto':<4} {name:>9}: acceptance length {row['acceptance_length']:.2f} over "
                  f"{row['verify_passes']} verify passes ({row['acceptance_rate']:.0%} of {row['drafted']} drafted); "
                  f"{row['tokens_per_decode_pass']} tokens a decode pass ({row['decode_passes']} passes against "
                  f"{row['plain_decode_passes']}); greedy {'identical' if row['identical'] else 'DIFFERENT'}; "
                  f"{row['seconds']:.1f} s against {row['plain_seconds']:.1f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": model, "backend": a.backend, "tokens": a.tokens,
                                            "prompt_tokens": {k: len(p) for k, p in prompts.items()},
                                            "runs": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
