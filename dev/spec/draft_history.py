"""Does a history of the model's other summaries help prompt lookup on summarising? (issue 28)

SmolLM2-135M's summaries of the repo's six documents (scripts/draft_tasks) paraphrase, so a
lookup in the request's own text drafts little there (1.77 tokens a decode pass with fixed
chains of 8, one-token matches on; docs/PERFORMANCE.md). SuffixDecoding drafts from earlier
outputs too, where tasks repeat. This measures what such a history could give: the model first
summarises held-out documents (docstrings of Python's standard library, 700-1600 characters, no
doctests; 172 of them on Python 3.11), greedily, 96 tokens each, with the same instruction; then
the six documents' greedy summaries are replayed offline, pass by pass, through drafters that
also search that history:

  - ``own``: the sequence's own text only (``--draft ngram`` with one-token matches, as on a
    streamed model); its replay gives the engine's own count (322 decode passes);
  - ``suffix`` with the history as ``RecentText`` (prompts and outputs, or outputs only);
  - one index of all the history's outputs (frequencies pooled across them), asked after the
    own text's 2-5-token matches, or before its one-token matches, or as the longest match.

Greedy replay is exact: a verify pass accepts the draft's longest prefix that the greedy text
continues with, and yields one token more. ``python dev/spec/draft_history.py`` (about 2.5 min on
the 2-core VM).

``--orders`` asks instead how ``--draft suffix`` should rank the recent text's matches against
the sequence's own: the nine texts' greedy outputs replayed in the script's order, twice (the
second round finds the first in the recent text, as a repeated task or an agent loop would),
with the engine's rule (the longest match first, the own text's among equals) and three others.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

from ntx.ctl.local import build_local_engine
from ntx.ctl.models import ensure_default_model
from ntx.daemons.compute.lookup import (MAX_NGRAM, MIN_NGRAM, WEAK_NGRAM, LookupDrafter, NgramIndex, RecentText,
                                        tree_of_paths)
from ntx.daemons.compute.speculation import DraftRequest, DraftTree
from ntx.shared.config import EngineOptions
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from draft_acceptance import SUMMARISE, tasks  # noqa: E402

TOKENS, DEPTH = 96, 8


def held_out_documents(seed: int = 7) -> list[str]:
    """Docstrings of the standard library that read as a short document, shuffled."""
    docs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "idlelib", "site-packages"} & set(f.parts):
            continue
        try:
            tree = ast.parse(f.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in [tree] + [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]:
            d = ast.get_docstring(node)
            if d and 700 <= len(d) <= 1600 and ">>>" not in d and len(re.findall(r"[A-Za-z]+", d)) > 100:
                docs.append(d)
    random.Random(seed).shuffle(docs)
    return docs


def generate(eng, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of ``prompts``, batched."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.submit(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=TOKENS)))
    while eng.has_work:
        for ev in eng.step():
            if ev["type"] == "done":
                out[ev["id"]] = list(ev["tokens"])
            elif ev["type"] == "error":
                raise SystemExit(ev["message"])
    return [out[f"r{i}"] for i in range(len(prompts))]


def replay(drafter, prompt: list[int], output: list[int]) -> tuple[int, int, int, int]:
    """(decode passes, tokens they yielded, verify passes, accepted drafted tokens) of a greedy
    ``output`` drafted by ``drafter`` with chains of ``DEPTH``, one-token matches allowed."""
    full = list(prompt) + list(output)
    pos = len(prompt) + 1  # the first token comes from the prompt's pass
    passes = verify = accepted = 0
    while pos < len(full):
        tree = drafter.propose([DraftRequest(1, full[:pos], DEPTH, 1, 1 << 20, weak=True)])[0]
        acc = 0
        while acc < len(tree) and pos + acc < len(full) and tree.tokens[acc] == full[pos + acc]:
            acc += 1
        verify += len(tree) > 0
        accepted += acc
        passes += 1
        pos += acc + 1
    drafter.forget(1)
    return passes, len(output) - 1, verify, accepted


class PooledHistory(LookupDrafter):
    """The own text's lookup with one index of the history's outputs beside it (frequencies
    pooled across them, matches of ``min_n`` tokens or more), asked in ``order``."""

    def __init__(self, history: NgramIndex, min_n: int, order: str) -> None:
        super().__init__("ngram")
        self.history, self.min_n, self.order = history, min_n, order

    def _propose(self, r: DraftRequest) -> DraftTree:
        idx = self.own.setdefault(r.seq_id, NgramIndex(min_n=WEAK_NGRAM))
        idx.extend(r.tokens, len(r.tokens) - 1)
        seq, out = list(r.tokens[-MAX_NGRAM:]), []
        while len(out) < r.depth:
            own, hist, weak = idx.best(seq, MIN_NGRAM), self.history.best(seq, self.min_n), idx.best(seq, WEAK_NGRAM)
            if self.order == "after own":
                hit = own or hist or weak
            elif self.order == "longest":
                hit = max((h for h in (own, hist) if h), key=lambda h: h[0], default=None) or weak
            else:  # after own's one-token matches too
                hit = own or weak or hist
            if hit is None or hit[1] < 0:
                break
            out.append(hit[1])
            seq.append(hit[1])
        tree = DraftTree()
        for i, tok in enumerate(out):
            tree.tokens.append(tok)
            tree.parents.append(i - 1)
        return tree


class RankedSuffix(LookupDrafter):
    """``--draft suffix`` with the recent text's matches ranked against the own text's by
    ``rule``: "own first" (all of the own text's, one-token ones included, then the recent
    text's), "own strong first" (the own text's 2-5-token matches, the recent text's, then the
    own one-token ones), "recent if 2 longer" (a recent match 2 tokens longer than the own
    text's longest goes first)."""

    def __init__(self, rule: str) -> None:
        super().__init__("suffix")
        self.rule = rule

    def _propose(self, r: DraftRequest) -> DraftTree:
        idx = self.own.setdefault(r.seq_id, NgramIndex(min_n=WEAK_NGRAM))
        idx.extend(r.tokens, len(r.tokens) - 1)
        tail = r.tokens[max(0, len(r.tokens) - MAX_NGRAM):]
        min_n = WEAK_NGRAM if r.weak else MIN_NGRAM
        own = [(n, idx.walk(tail, tok, r.depth, min_n)) for n, tok in idx.candidates(tail, min_n)[: r.width]]
        recent = sorted(self.recent.continuations(tail, r.depth, r.width), key=lambda f: -f[0])
        if self.rule == "own first":
            found = own + recent
        elif self.rule == "own strong first":
            found = [f for f in own if f[0] >= MIN_NGRAM] + recent + [f for f in own if f[0] < MIN_NGRAM]
        else:
            longest = max((f[0] for f in own), default=0)
            found = [f for f in recent if f[0] >= longest + 2] + own + [f for f in recent if f[0] < longest + 2]
        paths: list[list[int]] = []
        for _, path in found:
            if path not in paths:
                paths.append(path)
        return tree_of_paths(paths[: r.width], r.depth * r.width)


def orders(eng) -> None:
    texts = {name: (kind, eng.prompt_tokens(messages=msgs)) for name, (kind, msgs) in tasks().items()}
    outputs = dict(zip(texts, generate(eng, [p for _, p in texts.values()])))
    rules = {"longest first (the engine's)": lambda: LookupDrafter("suffix")}
    rules.update({rule: (lambda r=rule: RankedSuffix(r)) for rule in ("own first", "own strong first",
                                                                      "recent if 2 longer")})
    print(f"the nine texts twice, chains of {DEPTH}, one-token matches on (tokens a decode pass by kind):")
    for label, make in rules.items():
        drafter, line = make(), []
        for rnd in (1, 2):
            pooled: dict[str, list[int]] = {}
            for name, (kind, p) in texts.items():
                n, t, _, _ = replay(drafter, p, outputs[name])
                pooled.setdefault(kind, [0, 0])
                pooled[kind][0] += n
                pooled[kind][1] += t
            line.append(f"round {rnd}: " + ", ".join(f"{k} {t / n:.3f}" for k, (n, t) in pooled.items()))
        print(f"  {label:<30} " + "; ".join(line))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=0, help="held-out documents (0: all)")
    ap.add_argument("--orders", action="store_true", help="rank --draft suffix's matches by other rules (above)")
    a = ap.parse_args()
    eng = build_local_engine(str(ensure_default_model()), "cpu", options=EngineOptions(max_batch=8, ctx=2048))
    if a.orders:
        orders(eng)
        return 0
    docs = held_out_documents()
    docs = docs[: a.docs] if a.docs else docs
    t0 = time.monotonic()
    hist_prompts = [eng.prompt_tokens(messages=[{"role": "user", "content": f"{d}\n{SUMMARISE}"}]) for d in docs]
    hist_outputs = generate(eng, hist_prompts)
    print(f"history: {len(docs)} summaries, {sum(map(len, hist_outputs))} tokens, {time.monotonic() - t0:.0f} s")
    texts = {name: eng.prompt_tokens(messages=msgs) for name, (kind, msgs) in tasks().items() if kind == "summarise"}
    outputs = dict(zip(texts, generate(eng, list(texts.values()))))

    both, outs = RecentText(), RecentText()
    pooled = NgramIndex()
    for p, o in zip(hist_prompts, hist_outputs):
        both.add(list(p) + o)
        outs.add(o)
        pooled_tokens = pooled.tokens + o + [-1] * MAX_NGRAM  # -1: no n-gram crosses two outputs
        pooled.extend(pooled_tokens, len(pooled_tokens))
    drafters = {"own text": lambda: LookupDrafter("ngram"),
                "suffix, history of prompts and outputs": lambda: LookupDrafter("suffix", recent=both),
                "suffix, history of outputs": lambda: LookupDrafter("suffix", recent=outs)}
    for min_n in (2, 3):
        for order in ("after own", "longest", "after own's one-token"):
            drafters[f"pooled outputs, {min_n}+ tokens, {order}"] = (
                lambda m=min_n, o=order: PooledHistory(pooled, m, o))
    print(f"the six summaries, chains of {DEPTH}, one-token matches on (tokens a decode pass, accepted a verify pass):")
    for label, make in drafters.items():
        passes = tokens = verify = accepted = 0
        for name, p in texts.items():
            n, t, v, acc = replay(make(), p, outputs[name])
            passes, tokens, verify, accepted = passes + n, tokens + t, verify + v, accepted + acc
        print(f"  {label:<52} {tokens / passes:.3f} ({passes} passes), {accepted / max(verify, 1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
