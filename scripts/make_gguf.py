#!/usr/bin/env python3
"""Write a synthetic Llama GGUF (random but valid blocks) of any shape and type.

    python scripts/make_gguf.py OUT.gguf --preset llama3-70b --type Q4_K_M \
        [--layers N] [--tokenizer-from X.gguf] [--seed S] [--split N]

A thin command line over the synth_gguf package next to this script (scripts/synth_gguf: see
its modules for the layout and the type rules). Ends with one line: the path(s), the size and
the write speed.
"""

from __future__ import annotations

import argparse
import sys

import synth_gguf as sg  # scripts/synth_gguf: this script's folder is first on sys.path
from ntx.shared.errors import NtxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make_gguf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output path (with --split N: NAME.gguf -> NAME-0000i-of-0000N.gguf)")
    p.add_argument("--preset", default="tiny", choices=sorted(sg.PRESETS))
    p.add_argument("--type", default="Q4_K_M", choices=sg.ALL_TYPES,
                   help="matrix type, or a llama.cpp mix (Q4_K_M, Q5_K_M); norms stay F32")
    p.add_argument("--layers", type=int, dest="n_layers")
    p.add_argument("--dim", "--d-model", type=int, dest="d_model")
    p.add_argument("--ff", "--d-ff", type=int, dest="d_ff")
    p.add_argument("--heads", type=int, dest="n_heads")
    p.add_argument("--kv-heads", type=int, dest="n_kv_heads")
    p.add_argument("--head-dim", type=int, dest="head_dim")
    p.add_argument("--vocab", type=int, dest="vocab_size")
    p.add_argument("--rope-base", type=float, dest="rope_base")
    p.add_argument("--rms-eps", type=float, dest="rms_eps")
    p.add_argument("--context", type=int, dest="context_length")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, dest="tied_embeddings",
                   help="tie output to token_embd (default: the preset's)")
    p.add_argument("--rope-freqs", action=argparse.BooleanOptionalAction, dest="rope_freqs",
                   help="write rope_freqs.weight (Llama 3.1 scaling)")
    p.add_argument("--output-type", choices=sg.MATRIX_TYPES)
    p.add_argument("--token-embd-type", choices=sg.MATRIX_TYPES)
    p.add_argument("--order", choices=sg.ORDERS, help="tensor order (default: convert)")
    p.add_argument("--arch", choices=sg.ARCHS, help="general.architecture (default: llama; qwen2 adds q, k, v "
                                                   "biases and rotates each head's halves)")
    p.add_argument("--alignment", type=int)
    p.add_argument("--name")
    p.add_argument("--tokenizer-from", metavar="GGUF",
                   help="copy tokenizer.* keys from this GGUF (vocab must match: see --vocab)")
    p.add_argument("--seed", type=int)
    p.add_argument("--split", type=int, default=1, metavar="N", help="write a gguf-split set of N shards")
    p.add_argument("--break", dest="breakage", choices=sorted(sg.BREAKAGES),
                   help="write a deliberately broken file (loader tests)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    fields = ("type", "n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim",
              "vocab_size", "rope_base", "rms_eps", "context_length", "tied_embeddings",
              "rope_freqs", "output_type", "token_embd_type", "order", "alignment", "name", "arch",
              "tokenizer_from", "seed")
    try:
        cfg = sg.preset_config(a.preset, **{f: getattr(a, f) for f in fields})
        stats: list[sg.WriteStats] = []
        sg.write_llama_gguf(a.out, cfg, breakage=a.breakage, split=a.split,
                            progress=not a.quiet, stats=stats)
    except NtxError as e:
        print(f"make_gguf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make_gguf: interrupted (the output is incomplete)", file=sys.stderr)
        return 130
    s = stats[0]
    where = str(s.paths[0]) if len(s.paths) == 1 else f"{s.paths[0]} (+{len(s.paths) - 1} shards)"
    print(f"wrote {where}: {s.bytes_written / 1e9:.2f} GB in {s.seconds:.1f} s "
          f"({s.gb_per_s:.2f} GB/s), {len(s.plan)} tensors, {cfg.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
