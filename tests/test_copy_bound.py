"""The copy bound of dev/spec/copy_bound.py (docs/PERFORMANCE.md cites it as the most any
drafter that copies from the request could accept on the shipped texts): its oracle on texts
small enough to count by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("copy_bound", ROOT / "dev" / "spec" / "copy_bound.py")
copy_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(copy_bound)


def test_the_longest_copy_anywhere_or_after_the_anchor():
    context = [1, 2, 3, 4, 2, 3, 5]
    assert copy_bound.longest_copy(context, [2, 3, 5, 9], 10, None) == 3  # at index 4
    assert copy_bound.longest_copy(context, [2, 3, 5, 9], 10, 4) == 3  # 4 precedes that 2
    assert copy_bound.longest_copy(context, [2, 3, 5, 9], 10, 1) == 2  # after 1: 2, 3, then 4
    assert copy_bound.longest_copy(context, [2, 3, 5, 9], 2, None) == 2  # the budget caps it
    assert copy_bound.longest_copy(context, [8], 10, None) == 0


def test_a_decode_drafting_the_oracles_copy_pass_by_pass():
    prompt, output = [1, 2, 3, 4, 5], [9, 2, 3, 4, 7, 8]
    # anywhere: 2 3 4 copied in the first pass (which also yields 7), then 8 alone
    assert copy_bound.oracle_passes(prompt, output, 63, anchored=False) == [3, 0]
    # after the last token: nothing follows 9; after 2 comes 3 4; nothing follows 7
    assert copy_bound.oracle_passes(prompt, output, 63, anchored=True) == [0, 2, 0]
    assert copy_bound.oracle_passes(prompt, output, 1, anchored=False) == [1, 1, 0]
