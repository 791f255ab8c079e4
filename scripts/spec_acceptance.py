#!/usr/bin/env python3
"""Acceptance of speculative decoding on real text: greedy continuations of prompts cut from a
text file, with each drafter, through the in-process engine (cpu by default).

Real weights only: synthetic models measure speed, not acceptance. For each drafter setting it
prints the mean acceptance length (drafted tokens accepted per verify pass), the acceptance rate,
and the tokens a pass yields, and checks the greedy tokens equal the plain run's.

    python scripts/spec_acceptance.py TEXT [--model M] [--prompts 8] [--prompt-tokens 48] [--tokens 48]
        [--self-draft 0-14 0-19 ...] [--draft-tokens 8] [--widths 1 auto] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ntx.ctl.local import build_local_engine
from ntx.ctl.models import ensure_default_model
from ntx.shared.config import EngineOptions, parse_layers
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams


def _generate(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n)))
    done = {}
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                done[ev["id"]] = ev["tokens"]
    return [done[f"p{i}"] for i in range(len(prompts))], time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("text")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--self-draft", nargs="+", default=["0-14", "0-19", "0-24"])
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--widths", nargs="+", default=["1", "auto"])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or str(ensure_default_model())
    plain = build_local_engine(model, a.backend, options=EngineOptions(max_batch=a.prompts,
                                                                       ctx=a.prompt_tokens + a.tokens + 16))
    ids = plain.tokenizer.encode(open(a.text, encoding="utf-8").read())
    step = max(a.prompt_tokens, (len(ids) - a.prompt_tokens) // a.prompts)
    prompts = [ids[i * step : i * step + a.prompt_tokens] for i in range(a.prompts)]
    want, plain_s = _generate(plain, prompts, a.tokens)
    print(f"{model}: {a.prompts} prompts of {a.prompt_tokens} tokens from {a.text}, {a.tokens} greedy tokens each; "
          f"plain {plain_s:.1f} s", flush=True)
    rows = []
    for layers in a.self_draft:
        for width in a.widths:
            eng = build_local_engine(model, a.backend, options=EngineOptions(
                max_batch=a.prompts, ctx=a.prompt_tokens + a.tokens + 16, self_draft=parse_layers(layers, "--self-draft"),
                draft_tokens=a.draft_tokens, draft_width=None if width == "auto" else int(width)))
            got, secs = _generate(eng, prompts, a.tokens)
            r = eng.core.spec.report()
            row = {"self_draft": layers, "width": width, "draft_tokens": a.draft_tokens, **r,
                   "tokens_per_verify_pass": round(r["accepted_per_pass"] + 1, 3), "identical": got == want,
                   "seconds": round(secs, 1), "shape_now": eng.core.shape.choose()}
            rows.append(row)
            print(f"  self-draft layers {layers:>6} width {width:>4}: acceptance length {r['accepted_per_pass']:.2f} "
                  f"({r['acceptance_rate']:.1%} of {r['drafted']} drafted), {row['tokens_per_verify_pass']:.2f} tokens "
                  f"a verify pass; greedy {'identical' if row['identical'] else 'DIFFERENT'}; {secs:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": model, "text": a.text, "prompts": a.prompts, "prompt_tokens": a.prompt_tokens,
                       "tokens": a.tokens, "plain_s": plain_s, "runs": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
