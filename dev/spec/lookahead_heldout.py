"""Does ``--draft lookahead`` gain on documents it was not tuned on? (issue 28)

The lookahead's shape (3 levels, half the node budget, the pool from the window's tops only) was
chosen on the repo's six summarising texts (scripts/draft_tasks; docs/PERFORMANCE.md, "The
model's own guesses"). This runs the same instruction on held-out documents, the standard
library's docstrings of dev/spec/draft_history.py (700-1600 characters, shuffled with its seed),
greedily through the in-process engine: plain, then the prompt lookup and the lookahead with
fixed chains (every pass drafts the budget, as where a verify pass's rows are free), and reports
the tokens a decode pass pooled over the documents, per document how often each drafter did
better, and whether greedy output equals plain's.

    python dev/spec/lookahead_heldout.py [--task summarise|edit] [--docs 32] [--budgets 32 64] [--json OUT]

``--task edit``: functions of the standard library (12-40 lines), each to be written back whole
with itself renamed, draft_acceptance.py's editing instruction.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from ntx.ctl.local import build_local_engine
from ntx.ctl.models import ensure_default_model
from ntx.shared.config import EngineOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import SUMMARISE, run_task  # noqa: E402
from draft_history import TOKENS, held_out_documents  # noqa: E402


def held_out_functions(seed: int = 7) -> list[tuple[str, str]]:
    """Functions of the standard library of 12-40 lines (no nested definitions), shuffled: each
    as (its source, its name), for the editing task."""
    out = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "idlelib", "site-packages"} & set(f.parts):
            continue
        try:
            text = f.read_text(errors="ignore")
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 12 <= node.end_lineno - node.lineno + 1 <= 40:
                if not any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda)) for n in ast.walk(node) if n is not node):
                    out.append((ast.get_source_segment(text, node) + "\n", node.name))
    random.Random(seed).shuffle(out)
    return out


def edit_prompt(source: str, name: str) -> str:
    """draft_acceptance.py's editing instruction: the whole file back with one function renamed."""
    return (f"Here is a Python file:\n\n```python\n{source}```\n\nRewrite the whole file with the function "
            f"`{name}` renamed to `{name}_checked`. Output only the file.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--task", choices=("summarise", "edit"), default="summarise",
                    help="summarise docstrings, or rewrite functions with one renamed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = str(ensure_default_model())
    if a.task == "summarise":
        docs = [f"{d}\n{SUMMARISE}" for d in held_out_documents()[: a.docs]]
    else:
        docs = [edit_prompt(src, name) for src, name in held_out_functions()[: a.docs]]
    plain = build_local_engine(model, "cpu", options=EngineOptions(max_batch=1, ctx=2048))
    prompts = [plain.prompt_tokens(messages=[{"role": "user", "content": d}]) for d in docs]
    want = [run_task(plain, p, TOKENS) for p in prompts]
    print(f"{len(docs)} held-out documents ({a.task}), {TOKENS} greedy tokens each; plain: "
          f"{sum(w['decode_passes'] for w in want)} decode passes", flush=True)
    out = {"model": model, "task": a.task, "documents": len(docs), "tokens": TOKENS, "runs": []}
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
