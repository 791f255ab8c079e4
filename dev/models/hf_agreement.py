#!/usr/bin/env python3
"""ntx's CPU backend against Hugging Face transformers on a real GGUF (a Qwen2 or Llama that
transformers can read from GGUF): the same prompt tokens, the same logits, the same greedy text.

Why: a new architecture (Qwen2: q, k, v biases, each head's halves rotated) needs an outside
reference. transformers reads the GGUF itself (its own tokenizer from the file's vocabulary, its
own dequantization to float32, its own Qwen2 code, PyTorch on the CPU), so nothing of ntx's
reading is shared. It runs in another Python (``--hf-python``: a venv with torch, transformers
and gguf; none of them is an ntx dependency) and hands back, per task prompt of
scripts/draft_tasks (chat template applied by each side), the prompt's tokens, each position's
top token, log-normaliser and the logit of the prompt's next token, the last position's whole
row, and its greedy continuation.

ntx then runs the same prompts on its float32 reference (``cpu-quantized=off``: float32 weights as
transformers has them, so only float32 rounding differs) and on its default int8 kernels, and
reports per task: prompt tokens equal, top-1 agreement over the prompt's positions, the prompt's
mean negative log-likelihood beside transformers', the last row's max |difference| / max |logit|,
and how many greedy tokens agree before the first difference.

    python dev/models/hf_agreement.py MODEL.gguf --hf-python /path/to/venv/bin/python [--tokens 48]
        [--kinds summarise edit chat] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from draft_acceptance import run_task, tasks  # noqa: E402

from ntx.ctl.local import build_local_engine  # noqa: E402
from ntx.daemons.compute.batch import SeqChunk, StepBatch  # noqa: E402
from ntx.shared.config import EngineOptions  # noqa: E402

# Runs in --hf-python: argv = model, tasks json (name -> messages), tokens, out folder
HF_WORKER = r'''
import json, pathlib, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_path, tasks_json, n, out = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32).eval()
for name, messages in json.loads(pathlib.Path(tasks_json).read_text()).items():
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        z = model(ids).logits[0].double().numpy()  # [T, V]
        g = model.generate(ids, max_new_tokens=n, do_sample=False)
    p = ids[0].tolist()
    lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
    np.savez(out / f"{name}.npz", prompt=np.array(p), top1=z.argmax(axis=1), lse=lse,
             next_logit=z[np.arange(len(p) - 1), p[1:]], last=z[-1].astype(np.float32),
             greedy=np.array(g[0, len(p):].tolist()))
    print(name, flush=True)
'''


def prompt_logits(engine, prompt: list[int]) -> np.ndarray:
    """Every prompt position's logits [T, V] in one pass of a fresh sequence."""
    m = engine.core.model
    m.backend.alloc_sequence(77, len(prompt) + 8)
    try:
        return m.forward(StepBatch([SeqChunk(77, 0, tuple(prompt), all_logits=True)])).astype(np.float64)
    finally:
        m.backend.free_sequence(77)


def compare(z: np.ndarray, ref: dict, prompt: list[int]) -> dict:
    lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
    nll = float(np.mean(lse[:-1] - z[np.arange(len(prompt) - 1), prompt[1:]]))
    nll_hf = float(np.mean(ref["lse"][:-1] - ref["next_logit"]))
    return {"top1_agree": round(float(np.mean(z.argmax(axis=1) == ref["top1"])), 4),
            "prompt_nll": round(nll, 5), "prompt_nll_hf": round(nll_hf, 5),
            "last_row_rel_err": float(np.abs(z[-1] - ref["last"]).max() / np.abs(ref["last"]).max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--hf-python", required=True, help="a Python with torch, transformers and gguf")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens a task")
    ap.add_argument("--kinds", nargs="+", default=["summarise", "edit", "chat"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    chosen = {n: msgs for n, (kind, msgs) in tasks().items() if kind in a.kinds}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        (pathlib.Path(tmp) / "tasks.json").write_text(json.dumps(chosen))
        r = subprocess.run([a.hf_python, "-c", HF_WORKER, str(pathlib.Path(a.model).resolve()),
                            str(pathlib.Path(tmp) / "tasks.json"), str(a.tokens), tmp])
        if r.returncode:
            raise SystemExit("hf_agreement: the transformers run failed (above)")
        hf = {n: dict(np.load(pathlib.Path(tmp) / f"{n}.npz")) for n in chosen}
        print(f"transformers: {time.monotonic() - t0:.0f} s", flush=True)
    engines = {k: build_local_engine(a.model, "cpu", options=EngineOptions(max_batch=1, ctx=2048, kernels=k))
               for k in ("cpu-quantized=off", "")}
    rows = []
    for name, msgs in chosen.items():
        ref = hf[name]
        row: dict = {"text": name}
        for label, eng in (("float32", engines["cpu-quantized=off"]), ("int8", engines[""])):
            prompt = eng.prompt_tokens(messages=msgs)
            row["prompt_tokens"] = len(prompt)
            row["prompt_equal"] = prompt == ref["prompt"].tolist()
            row[label] = compare(prompt_logits(eng, prompt), ref, prompt)
            out = run_task(eng, prompt, a.tokens)["tokens"]
            want = ref["greedy"].tolist()
            row[label]["greedy_agree"] = next((i for i, (x, y) in enumerate(zip(out, want)) if x != y),
                                              min(len(out), len(want)))
            row[label]["greedy_tokens"] = len(want)
        rows.append(row)
        f, q = row["float32"], row["int8"]
        print(f"{name:>18}: prompt {row['prompt_tokens']} tokens, equal {row['prompt_equal']}; float32 top-1 "
              f"{f['top1_agree']:.3f}, nll {f['prompt_nll']:.4f} vs {f['prompt_nll_hf']:.4f}, last row "
              f"{f['last_row_rel_err']:.1e}, greedy {f['greedy_agree']}/{f['greedy_tokens']}; int8 top-1 "
              f"{q['top1_agree']:.3f}, nll {q['prompt_nll']:.4f}, last row {q['last_row_rel_err']:.1e}, greedy "
              f"{q['greedy_agree']}/{q['greedy_tokens']}", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"model": pathlib.Path(a.model).name, "reference": "transformers",
                                                    "tokens": a.tokens, "texts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
