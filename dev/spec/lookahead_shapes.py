"""Does a larger lookahead window raise acceptance? (issue 28: 2.0 accepted a verify pass on
summarising)

Runs scripts/draft_acceptance.py with ``--draft lookahead``'s shape constants replaced in this
process (``daemons/compute/lookahead.py``: ``LEVELS``, ``MAX_COLUMNS``, ``POOL_PER_KEY``,
``WINDOW_SHARE``, ``RECYCLE_K`` with ``RANK_HIT`` cut or extended), so a shape can be tried on
the real SmolLM2 without changing the engine. Every argument after the shape's goes to
draft_acceptance.py as it is:

    python dev/spec/lookahead_shapes.py [--levels 3] [--columns 16] [--pool-per-key 4] \\
        [--window-share 0.5] [--recycle-k 8] \\
        -- --tokens 192 --drafters lookahead:1:fixed --draft-tokens 256 --json OUT

A fixed chain's depth is capped by the tokens left to generate (``EngineCore._draft_depth``), so
budgets past the generation length draft no more: use ``--tokens`` well above the budget's half.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import ntx.daemons.compute.lookahead as lookahead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=int, default=lookahead.LEVELS, help="guesses per window column")
    ap.add_argument("--columns", type=int, default=lookahead.MAX_COLUMNS, help="the window's widest")
    ap.add_argument("--pool-per-key", type=int, default=lookahead.POOL_PER_KEY, help="n-grams kept per first token")
    ap.add_argument("--window-share", type=float, default=lookahead.WINDOW_SHARE,
                    help="of a tree's node budget, the most the window takes")
    ap.add_argument("--recycle-k", type=int, default=lookahead.RECYCLE_K,
                    help="tokens a verify row ranks for the recycled tokens (0: none recycled)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then draft_acceptance.py's arguments")
    args = ap.parse_args()
    if args.levels < 2 or args.columns < 2 or args.pool_per_key < 1:
        ap.error("--levels and --columns: 2 or more; --pool-per-key: 1 or more")
    if not 0 <= args.window_share <= 1 or not 0 <= args.recycle_k <= 32:
        ap.error("--window-share: 0 to 1; --recycle-k: 0 to 32")
    lookahead.LEVELS, lookahead.MAX_COLUMNS, lookahead.POOL_PER_KEY = args.levels, args.columns, args.pool_per_key
    lookahead.WINDOW_SHARE = args.window_share
    if args.recycle_k != lookahead.RECYCLE_K:  # ranks past the measured ones: a share each of what is left
        extra = max(0, args.recycle_k - len(lookahead.RANK_HIT))
        hits = list(lookahead.RANK_HIT) + [lookahead.RANK_HIT[-1] / 2] * extra
        lookahead.RANK_HIT = tuple(hits[: args.recycle_k])
        lookahead.RECYCLE_K = args.recycle_k
        lookahead.LookaheadDrafter.row_top_k = max(1, args.recycle_k)
    print(f"lookahead shape: {args.levels} levels, up to {args.columns} columns, {args.pool_per_key} n-grams a key, "
          f"the window at most {args.window_share:g} of the nodes, {args.recycle_k} tokens recycled a row", flush=True)
    script = Path(__file__).resolve().parents[2] / "scripts" / "draft_acceptance.py"
    sys.argv = [str(script)] + [a for a in args.rest if a != "--"]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
