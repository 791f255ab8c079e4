"""Does any request pay for warm-up? Start a pipeline, then send requests of new shapes one after
another, each the first of its kind, and time each one's first token; then the same shapes again
(now warm). Also decode speed right after a long prompt against after a short one.

    python scripts/bench_first_requests.py MODEL.gguf [--backend cuda] [--vram-budget 24GiB]
        [--ctx 2048] [--out first_requests.json]

Prompts are token ids (no tokenizer work), greedy, one request at a time: the time to the first
token is one prefill of that many tokens through the whole pipeline. Issue 14's goal: the first
of each shape within 10% of the second, the 1024-token prompt's first token within 1.0 s on a
70B at 24 GiB, and decode after a long prompt within 10% of decode after a short one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ntx.ctl import instance
from ntx.ctl.client import Client
from ntx.daemons.compute.backend import plan_for
from ntx.shared.config import InstanceConfig, parse_size
from ntx.shared.gguf_index import open_model

PROMPT_TOKENS = [1, 1, 8, 64, 256, 512, 1024]  # in the order sent; the first 1 is the first request
DECODE_TOKENS = 24


def _prompt(n: int, salt: int) -> list[int]:
    """n token ids, different per salt (no prefix shared with another request)."""
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def _timed(listen: str, n_prompt: int, salt: int, max_tokens: int) -> dict:
    """One greedy request: seconds to its first token, and decode tokens/s after it."""
    t0 = time.perf_counter()
    times = []
    with Client(listen, event_timeout_s=600) as c:
        for ev in c.generate(tokens=_prompt(n_prompt, salt), temperature=0.0, max_tokens=max_tokens):
            if ev["type"] == "token":
                times.append(time.perf_counter())
    first_s = times[0] - t0
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else None
    return {"prompt_tokens": n_prompt, "first_token_s": round(first_s, 3),
            "decode_tokens_per_s": round(decode, 3) if decode else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--vram-budget", default="24GiB")
    ap.add_argument("--ctx", type=int, default=None, help="default: ntxctl start's (the model's trained context)")
    ap.add_argument("--max-batch", type=int, default=None, help="default: ntxctl start's")
    ap.add_argument("--listen", default="tcp://127.0.0.1:5611")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    index = open_model(args.model)
    cfg = InstanceConfig(model=os.path.abspath(args.model), name=f"first-{os.getpid()}", backend=args.backend,
                         listen=args.listen,
                         vram_budget=parse_size(args.vram_budget, "--vram-budget") if args.backend == "cuda" else None,
                         ctx=args.ctx, **({"max_batch": args.max_batch} if args.max_batch else {})).validate()
    plan = plan_for(index, cfg)
    print("plan: " + "; ".join(plan.describe()[:3]), flush=True)
    t0 = time.perf_counter()
    instance.start(cfg, plan)
    report: dict = {"model": os.path.basename(args.model), "ready_s": round(time.perf_counter() - t0, 2),
                    "first": [], "again": []}
    print(f"ready after {report['ready_s']} s", flush=True)
    try:
        for rnd in ("first", "again"):
            for i, n in enumerate(PROMPT_TOKENS):
                r = _timed(cfg.listen, n, salt=i + (100 if rnd == "again" else 0), max_tokens=2)
                report[rnd].append(r)
                print(f"{rnd:5s} prompt {n:5d} tokens: first token {r['first_token_s']:.3f} s", flush=True)
        short = _timed(cfg.listen, 8, salt=500, max_tokens=DECODE_TOKENS)
        long = _timed(cfg.listen, 1024, salt=501, max_tokens=DECODE_TOKENS)
        report["decode_after_short"], report["decode_after_long"] = short, long
        print(f"decode after an 8-token prompt {short['decode_tokens_per_s']} tok/s, "
              f"after a 1024-token prompt {long['decode_tokens_per_s']} tok/s", flush=True)
    finally:
        instance.stop(cfg.name, force=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
