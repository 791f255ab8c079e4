#!/usr/bin/env python3
"""Acceptance of drafting without a draft model on real text: the tasks shipped in
scripts/draft_tasks, of three kinds (summarise a document: six of them; rewrite a source file
with one change: two; a chat whose last turn asks to repeat an earlier answer: one), each run
greedily through the in-process engine plain and with each drafter, on the real SmolLM2 by
default (real weights only: synthetic models measure speed, not acceptance).

For each text and drafter it prints the acceptance length (drafted tokens accepted per verify
pass), the tokens each decode pass yields (every pass counted, drafted or not), and whether the
greedy tokens equal the plain run's; then each kind's texts pooled (accepted over verify passes,
tokens over decode passes). How much a model quotes depends on the text: one document is a sample
of one. ``suffix`` runs the texts in order in one engine, so a text can draw on the ones before it.

    python scripts/draft_acceptance.py [--model M] [--backend cpu] [--tokens 96] [--draft-tokens 8]
        [--drafters ngram:1 ngram:auto suffix:auto ngram:1:fixed lookahead:1:fixed] [--self-draft N] [--json OUT]

``KIND:WIDTH:fixed`` drafts the whole budget every pass: the drafter's own acceptance, apart
from the tree shape this host's pass costs would choose.
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
from ntx.daemons.compute.lookup import tree_paths
from ntx.shared.config import EngineOptions
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams

TASKS_DIR = Path(__file__).resolve().parent / "draft_tasks"


SUMMARISE = "Summarise the text above in four sentences, using its own words where you can."
# edit-<name>.py: the function each file's task renames, and its new name (edit.py: the first)
RENAMES = {"edit.py": ("clean", "clean_readings"), "edit-inventory.py": ("needs_reorder", "items_to_reorder")}


def tasks() -> dict[str, tuple[str, list[dict[str, str]]]]:
    """Each text's name: its kind and its chat messages."""
    out: dict[str, tuple[str, list[dict[str, str]]]] = {}
    for path in sorted(TASKS_DIR.glob("summarise*.txt")):
        out[path.stem] = ("summarise", [{"role": "user", "content": f"{path.read_text()}\n{SUMMARISE}"}])
    for name, (old, new) in RENAMES.items():
        src = (TASKS_DIR / name).read_text()
        out[name.removesuffix(".py")] = ("edit", [{
            "role": "user", "content": f"Here is a Python file:\n\n```python\n{src}```\n\nRewrite the whole file with "
                                       f"the function `{old}` renamed to `{new}`. Output only the file."}])
    out["chat"] = ("chat", json.loads((TASKS_DIR / "chat.json").read_text()))
    return out


def pooled(rows: list[dict]) -> dict:
    """Rows of one kind and drafter as one: accepted over verify passes, tokens over decode passes."""
    verify = sum(r["verify_passes"] for r in rows)
    passes = sum(r["decode_passes"] for r in rows)
    strong = verify - sum(r.get("weak_verify_passes", 0) for r in rows)
    strong_accepted = sum(r["accepted"] - r.get("weak_accepted", 0) for r in rows)
    return {"texts": len(rows), "verify_passes": verify, "accepted": sum(r["accepted"] for r in rows),
            "acceptance_length": round(sum(r["accepted"] for r in rows) / verify, 3) if verify else 0.0,
            "strong_verify_passes": strong,
            "strong_acceptance_length": round(strong_accepted / strong, 3) if strong else 0.0,
            "decode_passes": passes, "plain_decode_passes": sum(r["plain_decode_passes"] for r in rows),
            "tokens_per_decode_pass": round(sum(r["generated"] - 1 for r in rows) / passes, 3) if passes else None,
            "identical": all(r["identical"] for r in rows)}


def run_task(engine, prompt: list[int], n: int, prompt_logprobs: int = 0) -> dict:
    """One greedy request alone: its tokens, speculation counts and decode passes (and, when
    ``prompt_logprobs`` asks, each prompt position's top alternatives)."""
    first_pass = engine.core.model.next_pass_id
    t0 = time.monotonic()
    engine.submit(EngineRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=n),
                                prompt_logprobs=prompt_logprobs))
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
            "finish_reason": done["finish_reason"],
            "prompt_logprobs": done.get("prompt_logprobs"),
            "decode_passes": decode_passes,
            "tokens_per_decode_pass": round((len(tokens) - 1) / decode_passes, 3) if decode_passes > 0 else None}


class PassTrace:
    """Records what a drafter proposed at each pass (its constructor wraps the drafter's
    ``propose``), so that ``trace`` can say, once the greedy tokens are known, how many of each
    proposal they accepted: the (drafted, accepted) passes a replay on another model repeats
    (daemons/compute/replay.py). A tree's pass is its nodes and its longest path that the
    tokens follow: the replay drafts a chain of as many rows with as many right, which costs
    a streamed pass what the tree did (its rows, not their shape, set the time)."""

    def __init__(self, drafter) -> None:
        self.calls: list[tuple[int, list[list[int]], int]] = []  # (the draft's start, its paths, its nodes)
        inner = drafter.propose

        def propose(requests):
            trees = inner(requests)
            for r, tree in zip(requests, trees):
                self.calls.append((len(r.tokens), tree_paths(tree), len(tree)))
            return trees

        drafter.propose = propose

    def trace(self, full: list[int], end_ids: frozenset[int] = frozenset()) -> list[list[int]]:
        """The passes recorded since the last call, against ``full`` (prompt and greedy tokens).
        ``end_ids``: the request ended on one of these tokens, which its tokens do not list; a
        drafted one right after the last token was accepted too (the engine counts it)."""
        out = []
        for pos, paths, nodes in self.calls:
            best = 0
            for path in paths:
                accepted = 0
                while accepted < len(path) and pos + accepted < len(full) and path[accepted] == full[pos + accepted]:
                    accepted += 1
                if accepted < len(path) and pos + accepted == len(full) and path[accepted] in end_ids:
                    accepted += 1
                best = max(best, accepted)
            out.append([nodes, best])
        self.calls.clear()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--drafters", nargs="+", default=["ngram:1", "ngram:auto", "suffix:auto"],
                    help="KIND:WIDTH[:fixed], KIND ngram, suffix or lookahead, WIDTH a number or auto; fixed: every "
                         "pass drafts --draft-tokens (WIDTH wide, a chain when auto), whatever this host's pass "
                         "costs make the tree shape choose: the drafter's own acceptance, as where a verify "
                         "pass costs what a plain one does (a streamed model)")
    ap.add_argument("--self-draft", type=int, default=0, metavar="N",
                    help="every drafter beside a self-draft of the model's first N layers (one merged tree); "
                         "KIND self: the self-draft alone")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-out", default=None, metavar="DIR",
                    help="write each fixed drafter's passes per kind of text, as (drafted, accepted) pairs, "
                         "to DIR/trace-KIND-TASK.json: what `ntxctl bench --spec-accept-trace` replays on another model")
    a = ap.parse_args()
    model = a.model or str(ensure_default_model())
    ctx = 2048

    plain = build_local_engine(model, a.backend, options=EngineOptions(max_batch=1, ctx=ctx))
    texts = tasks()
    prompts = {name: plain.prompt_tokens(messages=msgs) for name, (_, msgs) in texts.items()}
    want = {name: run_task(plain, p, a.tokens) for name, p in prompts.items()}
    print(f"{model} ({a.backend}): {a.tokens} greedy tokens a text; prompts "
          + ", ".join(f"{k} {len(p)} tokens" for k, p in prompts.items()), flush=True)
    for name, r in want.items():
        print(f"  plain {name:>18}: {r['seconds']:.1f} s, {r['decode_passes']} decode passes", flush=True)
    rows, pools = [], []
    for spec in a.drafters:
        kind, _, width = spec.partition(":")
        width, _, fixed = width.partition(":")
        width = width or "auto"
        if fixed not in ("", "fixed"):
            ap.error(f"--drafters {spec}: KIND:WIDTH or KIND:WIDTH:fixed")
        if kind == "self" and not a.self_draft:
            ap.error(f"--drafters {spec}: KIND self needs --self-draft N")
        eng = build_local_engine(model, a.backend, options=EngineOptions(
            max_batch=1, ctx=ctx, draft=None if kind == "self" else kind, draft_tokens=a.draft_tokens,
            self_draft=list(range(a.self_draft)) if a.self_draft else False,
            draft_width=None if width == "auto" else int(width), draft_fixed=bool(fixed)))
        if a.self_draft and kind != "self":
            kind = f"self+{kind}"  # the label from here on: a merged tree
        tracer = PassTrace(eng.core.drafter) if a.trace_out and fixed else None
        traces: dict[str, list[list[int]]] = {}
        width = width + (":fixed" if fixed else "")
        mine = []
        for name, p in prompts.items():
            weak_before = (eng.core.spec.weak_passes, eng.core.spec.weak_accepted)
            got = run_task(eng, p, a.tokens)
            sp = got["speculation"] or {}
            # passes whose draft came from a one-token match (where a verify pass is free, fixed
            # shapes: lookup.WEAK_NGRAM), from the engine's tally: apart, so that the 2-5-token
            # matches' acceptance stays visible beside them
            weak_passes = eng.core.spec.weak_passes - weak_before[0]
            weak_accepted = eng.core.spec.weak_accepted - weak_before[1]
            if tracer is not None:
                ended = eng.tokenizer.stop_ids if got["finish_reason"] == "stop" else frozenset()
                passes = tracer.trace(list(p) + list(got["tokens"]), ended)
                if sum(acc for _, acc in passes) != sp.get("accepted", 0):
                    raise SystemExit(f"--trace-out: {name}'s trace accepts {sum(acc for _, acc in passes)} tokens, "
                                     f"the engine counted {sp.get('accepted', 0)}")
                traces.setdefault(texts[name][0], []).extend(passes)
            row = {"task": texts[name][0], "text": name, "drafter": kind, "width": width or "auto",
                   "draft_tokens": a.draft_tokens, "verify_passes": sp.get("verify_passes", 0),
                   "drafted": sp.get("drafted", 0), "accepted": sp.get("accepted", 0),
                   "acceptance_length": sp.get("accepted_per_pass", 0.0),
                   "weak_verify_passes": weak_passes, "weak_accepted": weak_accepted,
                   "acceptance_rate": sp.get("acceptance_rate", 0.0), "generated": len(got["tokens"]),
                   "decode_passes": got["decode_passes"], "tokens_per_decode_pass": got["tokens_per_decode_pass"],
                   "plain_decode_passes": want[name]["decode_passes"], "identical": got["tokens"] == want[name]["tokens"],
                   "seconds": got["seconds"], "plain_seconds": want[name]["seconds"]}
            mine.append(row)
            print(f"  {kind}:{width or 'auto':<4} {name:>18}: acceptance length {row['acceptance_length']:.2f} over "
                  f"{row['verify_passes']} verify passes ({row['acceptance_rate']:.0%} of {row['drafted']} drafted); "
                  f"{row['tokens_per_decode_pass']} tokens a decode pass ({row['decode_passes']} passes against "
                  f"{row['plain_decode_passes']}); greedy {'identical' if row['identical'] else 'DIFFERENT'}; "
                  f"{row['seconds']:.1f} s against {row['plain_seconds']:.1f} s", flush=True)
        for task in dict.fromkeys(r["task"] for r in mine):
            pool = {"task": task, "drafter": kind, "width": width or "auto",
                    **pooled([r for r in mine if r["task"] == task])}
            pools.append(pool)
            strong = (f" ({pool['strong_acceptance_length']:.2f} over the {pool['strong_verify_passes']} drafted from "
                      f"2-5-token matches)" if pool["strong_verify_passes"] != pool["verify_passes"] else "")
            print(f"  {kind}:{width or 'auto':<4} {task + ' (pooled)':>18}: acceptance length "
                  f"{pool['acceptance_length']:.2f} over {pool['verify_passes']} verify passes of {pool['texts']} "
                  f"texts{strong}; {pool['tokens_per_decode_pass']} tokens a decode pass ({pool['decode_passes']} "
                  f"passes against {pool['plain_decode_passes']})", flush=True)
        rows += mine
        for task, passes in traces.items():
            out = Path(a.trace_out) / f"trace-{kind}-{task}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            pool = next(q for q in pools if q["task"] == task and q["drafter"] == kind and q["width"] == width)
            out.write_text(json.dumps({
                "label": f"{kind} {task}", "model": Path(model).name, "backend": a.backend,
                "draft_tokens": a.draft_tokens, "acceptance_length": pool["acceptance_length"],
                "tokens_per_decode_pass": pool["tokens_per_decode_pass"], "trace": passes}))
            print(f"  trace of {kind} on {task}: {len(passes)} passes -> {out}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": model, "backend": a.backend, "tokens": a.tokens,
                                            "self_draft_layers": a.self_draft,
                                            "prompt_tokens": {k: len(p) for k, p in prompts.items()},
                                            "runs": rows, "pooled": pools}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
