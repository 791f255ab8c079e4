#!/usr/bin/env python3
"""ntx's CPU backend against llama.cpp's CPU build on a real GGUF: the same chat prompts, the
same greedy text.

Why: llama.cpp is the reference every side-by-side figure names (docs/PERFORMANCE.md), and its
CPU path rounds as ntx's default int8 path does (weights multiplied with activations quantized
to 8 bits), unlike transformers' float32 (dev/models/hf_agreement.py). Its `llama-simple`
(scripts/build_llama_cpp.sh builds it) decodes greedily from a prompt whose special tokens it
parses, so each task prompt of scripts/draft_tasks goes to it as ntx's chat template renders it,
and its continuation is held to ntx's greedy text for the same prompt: the characters they
share before the first difference, and the tokens (ntx's tokenizer on llama.cpp's text).

    python dev/models/llamacpp_agreement.py MODEL.gguf [--llama-bin DIR] [--tokens 48]
        [--kinds summarise edit chat] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from draft_acceptance import run_task, tasks  # noqa: E402

from ntx.ctl.local import build_local_engine  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402


def llama_bin_dir() -> pathlib.Path:
    """Where scripts/build_llama_cpp.sh puts its CPU build's tools."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_cpp.sh"), "--print-bin"], capture_output=True,
                         text=True, check=True)
    return pathlib.Path(out.stdout.strip())


def shared_prefix(a, b) -> int:
    """How many leading items (characters, token ids) a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-bin", default=None, help="folder of llama-simple (default: build_llama_cpp.sh's)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens a task")
    ap.add_argument("--kinds", nargs="+", default=["summarise", "edit", "chat"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    simple = (pathlib.Path(a.llama_bin) if a.llama_bin else llama_bin_dir()) / "llama-simple"
    if not simple.is_file():
        raise SystemExit(f"llamacpp_agreement: {simple} is not built; scripts/build_llama_cpp.sh builds it")
    eng = build_local_engine(a.model, "cpu", options=EngineOptions(max_batch=1, ctx=2048))
    tok = eng.tokenizer
    rows = []
    for name, (kind, msgs) in tasks().items():
        if kind not in a.kinds:
            continue
        prompt = eng.prompt_tokens(messages=msgs)
        text = tok.decode(prompt)
        t0 = time.monotonic()
        r = subprocess.run([str(simple), "-m", a.model, "-n", str(a.tokens), text], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"llamacpp_agreement: llama-simple failed on {name}:\n{r.stderr[-2000:]}")
        if not r.stdout.startswith(text):
            raise SystemExit(f"llamacpp_agreement: llama-simple did not echo {name}'s prompt as rendered")
        theirs = r.stdout[len(text):].removesuffix("\n")  # llama-simple ends its output with one newline
        llama_s = time.monotonic() - t0
        out = run_task(eng, prompt, a.tokens)["tokens"]
        ours = tok.decode(out, skip_special=True)  # llama-simple stops before printing its end token
        theirs_tokens = tok.encode(text + theirs, add_bos=False)[len(prompt):]
        agree = shared_prefix(out, theirs_tokens)
        row = {"text": name, "kind": kind, "prompt_tokens": len(prompt), "greedy_tokens": len(out),
               "tokens_agree": agree, "chars_agree": shared_prefix(ours, theirs), "equal": ours == theirs,
               "llama_s": round(llama_s, 1)}
        if not row["equal"]:
            at = row["chars_agree"]
            row["ntx_after"], row["llama_after"] = ours[at:at + 60], theirs[at:at + 60]
        rows.append(row)
        print(f"{name:>18}: prompt {len(prompt)} tokens; greedy {'equal' if row['equal'] else 'differ'}: "
              f"{agree}/{len(out)} tokens, {row['chars_agree']} characters alike"
              + ("" if row["equal"] else f"; then ntx {row['ntx_after']!r}, llama.cpp {row['llama_after']!r}"),
              flush=True)
    equal = sum(r["equal"] for r in rows)
    print(f"greedy text equal in {equal} of {len(rows)}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"model": pathlib.Path(a.model).name, "reference": "llama.cpp CPU "
                                                    "(llama-simple)", "tokens": a.tokens, "texts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
