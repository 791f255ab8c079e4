#!/usr/bin/env python3
"""Would token recycling draft summaries better than the lookahead? An offline estimate.

Token Recycling (Luo et al., 2024) keeps, for every token, the k tokens the target last ranked
highest after it (an adjacency matrix filled from every verify pass's rows, which a verify pass
computes anyway) and drafts a fixed-shape tree from it by breadth-first expansion from the last
token. It needs each row's top-k where the lookahead uses its top-1.

This replays that on the real SmolLM2 without a drafter in the engine: each text's greedy
continuation is generated plainly, then scored whole (``prompt_logprobs``: every position's
top-k under the true context). At each decode step a tree is drafted from the matrix, its longest
path that the greedy tokens follow is accepted, and the matrix learns the rows of that path (the
rows on the true context; a real verify pass also has the rejected nodes' rows, not modelled:
they would add entries for tokens off the path). The tree's shape is fixed per run: the
``NODES`` best nodes by the product of their ranks' hit rates (measured in a first replay with a
wide tree; ``lookahead.recycled_shape``), as Sequoia chooses a static tree.

    python dev/spec/recycling_sim.py [--tokens 192] [--nodes 64] [--k 8] [--kinds summarise edit chat]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from draft_acceptance import run_task, tasks  # noqa: E402

from ntx.ctl.local import build_local_engine  # noqa: E402
from ntx.ctl.models import ensure_default_model  # noqa: E402
from ntx.daemons.compute.lookahead import RECYCLE_K, RecycledTokens, recycled_paths, recycled_shape  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402


def replay(full: list[int], start: int, topk: list[list[int]], matrix: RecycledTokens,
           shape: tuple[tuple[int, ...], ...], rank_hits: list[int]) -> tuple[int, int]:
    """Decode ``full[start:]`` with recycled drafts: (verify passes, accepted tokens). ``topk[i]``:
    the top-k after ``full[:i + 1]``. Counts each rank's hits on the accepted paths."""
    pos, passes, accepted = start, 0, 0
    while pos < len(full):
        tree = recycled_paths(matrix, full[pos - 1], shape)
        best, best_path = 0, ()
        for rp, toks in tree.items():
            n = 0
            while n < len(toks) and pos + n < len(full) and toks[n] == full[pos + n]:
                n += 1
            if n == len(toks) and n > best:
                best, best_path = n, rp
        for r in best_path:
            rank_hits[r] += 1
        passes += 1
        accepted += best
        for i in range(pos - 1, min(pos + best, len(full) - 1)):  # the rows on the accepted path
            matrix.learn(full[i], topk[i])
        pos += best + 1
    return passes, accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--nodes", type=int, nargs="+", default=[64])
    ap.add_argument("--k", type=int, default=RECYCLE_K, help=f"ranks kept a token (1-{RECYCLE_K}, the engine's)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--kinds", nargs="+", default=["summarise", "edit", "chat"])
    ap.add_argument("--seed-prompt", action="store_true",
                    help="fill the matrix from the prompt's rows first (a prefill that scores every row)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.k <= RECYCLE_K:
        ap.error(f"--k: 1 to {RECYCLE_K}")
    engine = build_local_engine(str(ensure_default_model()), "cpu", options=EngineOptions(max_batch=1, ctx=2048))
    texts = {n: t for n, t in tasks().items() if t[0] in a.kinds}
    scored = {}
    for name, (kind, msgs) in texts.items():
        prompt = engine.prompt_tokens(messages=msgs)
        gen = run_task(engine, prompt, a.tokens)["tokens"]
        full = list(prompt) + list(gen)
        lp = run_task(engine, full, 1, prompt_logprobs=a.k)["prompt_logprobs"]
        # lp[i + 1] scores full[i + 1]: its first k pairs are the top-k after full[:i + 1]
        topk = [[int(t) for t, _ in e[: a.k]] for e in lp[1:]]
        scored[name] = (kind, len(prompt), full, topk)
        print(f"{name}: prompt {len(prompt)}, generated {len(gen)}", flush=True)
    # a first replay with a wide tree measures each rank's hit rate
    wide = recycled_shape(256, a.depth, tuple(0.5 ** (r + 1) for r in range(a.k)))
    hits = [0] * a.k
    for kind, start, full, topk in scored.values():
        replay(full, start, topk, RecycledTokens(), wide, hits)
    rank_hit = [max(h, 1) / max(1, sum(hits)) for h in hits]
    print("rank hit shares:", [round(x, 3) for x in rank_hit])
    results = []
    for nodes in a.nodes:
        shape = recycled_shape(nodes, a.depth, tuple(rank_hit))
        by_kind: dict[str, list[int]] = {}
        matrix = RecycledTokens()  # one for the instance, kept across texts as the paper does
        for name, (kind, start, full, topk) in scored.items():
            if a.seed_prompt:
                for i in range(start - 1):
                    matrix.learn(full[i], topk[i])
            passes, acc = replay(full, start, topk, matrix, shape, [0] * a.k)
            tot = by_kind.setdefault(kind, [0, 0, 0])
            tot[0] += passes
            tot[1] += acc
            tot[2] += len(full) - start
            print(f"  {nodes} nodes {name:>18}: acceptance {acc / passes:.2f}, "
                  f"tokens a pass {(len(full) - start) / passes:.3f}")
        for kind, (passes, acc, n) in by_kind.items():
            row = {"nodes": nodes, "kind": kind, "passes": passes, "acceptance_length": round(acc / passes, 3),
                   "tokens_per_pass": round(n / passes, 3), "seed_prompt": a.seed_prompt, "k": a.k}
            results.append(row)
            print(f"{nodes} nodes {kind:>10} (pooled): acceptance {row['acceptance_length']:.2f}, "
                  f"tokens a pass {row['tokens_per_pass']:.3f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rank_hit": rank_hit, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
