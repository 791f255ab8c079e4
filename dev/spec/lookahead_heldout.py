"""Does ``--draft lookahead`` gain on documents it was not tuned on? (issue 28)

The lookahead's shape (3 levels, half the node budget, the pool from the window's tops only) was
chosen on the repo's six summarising texts (scripts/draft_tasks; docs/PERFORMANCE.md, "The
model's own guesses"). This runs the same instruction on held-out documents, the standard
library's docstrings of dev/spec/draft_history.py (700-1600 characters, shuffled with its seed),
greedily through the in-process engine: plain, then the prompt lookup and the lookahead with
fixed chains (every pass drafts the budget, as where a verify pass's rows are free), and reports
the tokens a decode pass pooled over the documents, per document how often each drafter did
better, and whether greedy output equals plain's.

    python dev/spec/lookahead_heldout.py [--docs 32] [--budgets 32 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ntx.ctl.local import build_local_engine
from ntx.ctl.models import ensure_default_model
from ntx.shared.config import EngineOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import SUMMARISE, run_task  # noqa: E402
from draft_history import TOKENS, held_out_documents  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = str(ensure_default_model())
    docs = held_out_documents()[: a.docs]
    plain = build_local_engine(model, "cpu", options=EngineOptions(max_batch=1, ctx=2048))
    prompts = [plain.prompt_tokens(messages=[{"role": "user", "content": f"{d}\n{SUMMARISE}"}]) for d in docs]
    want = [run_task(plain, p, TOKENS) for p in prompts]
    print(f"{len(docs)} held-out documents, {TOKENS} greedy tokens each; plain: "
          f"{sum(w['decode_passes'] for w in want)} decode passes", flush=True)
    out = {"model": model, "documents": len(docs), "tokens": TOKENS, "runs": []}
    for budget in a.budgets:
        per_doc = {}
        for kind in ("ngram", "lookahead"):
            eng = build_local_engine(model, "cpu", options=EngineOptions(
                max_batch=1, ctx=2048, draft=kind, draft_tokens=budget, draft_width=1, draft_fixed=True))
            got = [run_task(eng, p, TOKENS) for p in prompts]
            identical = all(g["tokens"] == w["tokens"] for g, w in zip(got, want))
            tokens = sum(len(g["tokens"]) - 1 for g in got)
            passes = sum(g["decode_passes"] for g in got)
            per_doc[kind] = [g["decode_passes"] for g in got]
            row = {"budget": budget, "drafter": kind, "decode_passes": passes,
                   "tokens_per_decode_pass": round(tokens / passes, 3), "identical": identical,
                   "per_document_decode_passes": per_doc[kind]}
            out["runs"].append(row)
            print(f"  budget {budget:>3} {kind:>9}: {row['tokens_per_decode_pass']} tokens a decode pass "
                  f"({passes} passes); greedy {'identical' if identical else 'DIFFERENT'}", flush=True)
        fewer = sum(la < ng for la, ng in zip(per_doc["lookahead"], per_doc["ngram"]))
        more = sum(la > ng for la, ng in zip(per_doc["lookahead"], per_doc["ngram"]))
        print(f"  budget {budget:>3}: the lookahead took fewer passes on {fewer} documents, more on {more}, "
              f"as many on {len(docs) - fewer - more}", flush=True)
        out["runs"].append({"budget": budget, "lookahead_fewer_passes": fewer, "lookahead_more_passes": more})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r.get("identical", True) for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
