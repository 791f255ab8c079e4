#!/usr/bin/env python3
"""How far drafting by copying can go on the shipped texts: an upper bound for every drafter
that proposes text already in the request (the prompt lookup, the lookahead's pool, the suffix
drafter within one request), measured on the real SmolLM2's greedy output.

Each text runs plain and greedy (scripts/draft_acceptance.py's tasks and `run_task`); then, pass
by pass as a speculative decode would go, an oracle drafts the best continuation the context
holds (the prompt and the output so far) and the pass accepts all of it that the greedy output
follows, capped at the node budget:

* ``anywhere``: the longest run of the coming tokens found anywhere in the context; no drafter
  without the answer can pick better among the context's runs.
* ``after the last token``: the same, but only runs that follow an occurrence of the last
  token, as a prompt lookup with a one-token match chooses among (its perfect choice).

The lookahead also drafts tokens the model itself guessed (its window, the recycled ranks),
which no copy bound covers, so its measured acceptance may pass ``after the last token`` but a
copying drafter's cannot pass ``anywhere``.

    python dev/spec/copy_bound.py [--tokens 192] [--budget 63] [--kinds summarise edit chat] [--json F]
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
from ntx.shared.config import EngineOptions  # noqa: E402


def longest_copy(context: list[int], coming: list[int], budget: int, anchor: int | None) -> int:
    """The longest prefix of ``coming`` (at most ``budget`` tokens) that ``context`` holds
    somewhere, or, with ``anchor``, somewhere right after an occurrence of that token."""
    best = 0
    n = len(context)
    for i in range(n):
        if anchor is not None and (i == 0 or context[i - 1] != anchor):
            continue
        k = 0
        while k < budget and k < len(coming) and i + k < n and context[i + k] == coming[k]:
            k += 1
        best = max(best, k)
        if best == min(budget, len(coming)):
            break
    return best


def oracle_passes(prompt: list[int], output: list[int], budget: int, anchored: bool) -> list[int]:
    """The tokens accepted at each decode pass after the first token (the prefill gives it) of
    a decode in which every pass drafts the oracle's copy: a pass yields its accepted tokens and
    the one the verify pass computes."""
    accepted: list[int] = []
    t = 1
    while t < len(output):
        context = prompt + output[:t]
        k = longest_copy(context, output[t:], budget, context[-1] if anchored else None)
        k = min(k, len(output) - t - 1)  # the pass's own token comes after the accepted ones
        accepted.append(k)
        t += k + 1
    return accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=192, help="greedy tokens a text")
    ap.add_argument("--budget", type=int, default=63, help="drafted tokens a pass at most")
    ap.add_argument("--kinds", nargs="+", default=["summarise", "edit", "chat"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or str(ensure_default_model())
    engine = build_local_engine(model, "cpu", options=EngineOptions(max_batch=1, ctx=2048))
    rows = []
    for name, (kind, messages) in tasks().items():
        if kind not in a.kinds:
            continue
        prompt = engine.prompt_tokens(messages=messages)
        output = run_task(engine, prompt, a.tokens)["tokens"]
        row = {"text": name, "kind": kind, "prompt_tokens": len(prompt), "output_tokens": len(output)}
        for label, anchored in (("anywhere", False), ("after_last_token", True)):
            acc = oracle_passes(list(prompt), list(output), a.budget, anchored)
            row[label] = {"decode_passes": len(acc), "accepted": sum(acc),
                          "acceptance_length": round(sum(acc) / len(acc), 3) if acc else 0.0,
                          "tokens_per_decode_pass": round((len(output) - 1) / len(acc), 3) if acc else None}
        rows.append(row)
        anywhere, anchored = row["anywhere"], row["after_last_token"]
        print(f"{name:>20} ({kind}): {len(output)} tokens; anywhere {anywhere['acceptance_length']:.2f} accepted a "
              f"pass ({anywhere['tokens_per_decode_pass']} a decode pass), after the last token "
              f"{anchored['acceptance_length']:.2f} ({anchored['tokens_per_decode_pass']})", flush=True)
    pooled = {}
    for kind in a.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        pooled[kind] = {}
        for label in ("anywhere", "after_last_token"):
            passes = sum(r[label]["decode_passes"] for r in mine)
            accepted = sum(r[label]["accepted"] for r in mine)
            tokens = sum(r["output_tokens"] - 1 for r in mine)
            pooled[kind][label] = {"decode_passes": passes, "accepted": accepted,
                                   "acceptance_length": round(accepted / passes, 3),
                                   "tokens_per_decode_pass": round(tokens / passes, 3)}
        print(f"{kind} ({len(mine)} texts): anywhere {pooled[kind]['anywhere']['acceptance_length']:.2f} accepted "
              f"a pass, after the last token {pooled[kind]['after_last_token']['acceptance_length']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": Path(model).name, "backend": "cpu", "tokens": a.tokens,
                                            "budget": a.budget, "texts": rows, "pooled": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
