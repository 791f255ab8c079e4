"""dev/spec/recycling_primed.py's priming (docs/PERFORMANCE.md, "Recycled tokens primed from the
prompt"): a prompt_logprobs list becomes what follows each prompt token, in prompt order."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ntx.daemons.compute.lookahead import RECYCLE_K, RecycledTokens

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("recycling_primed", ROOT / "dev" / "spec" / "recycling_primed.py")
recycling_primed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recycling_primed)


def test_each_positions_ranking_is_learnt_after_the_token_before_it():
    prompt = [7, 8, 7, 9]
    entries = [None,
               [[8, -0.1], [5, -2.0]],          # position 1 (after 7): 8 best
               [[6, -0.3], [7, -0.9]],          # position 2 (after 8)
               [[4, -0.2], [9, -0.5], [1, -3.0]]]  # position 3 (after the second 7): the newer ranking
    r = RecycledTokens()
    assert recycling_primed.prime(r, prompt, entries) == 3
    assert r.after(7) == (4, 9, 1)  # the later occurrence's, learnt last
    assert r.after(8) == (6, 7)
    assert r.after(9) == ()  # the last token: nothing after it in the prompt
    long = [[t, -float(t)] for t in range(RECYCLE_K + 4)]
    assert recycling_primed.prime(r, [3, 0], [None, long]) == 1
    assert r.after(3) == tuple(range(RECYCLE_K))  # the best RECYCLE_K, best first
