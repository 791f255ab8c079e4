#!/usr/bin/env python3
"""How exact the grid form of the fixed form (dev/cuda/fx_grid.py's stand-ins; built in
dev/cuda/grid_form.patch) would be, on a real model's activations: numpy, no GPU.

The grid form rounds each 256-column block value v of a row's product (a K-quant block; here 192
where the rows have no 256, as SmolLM2's 576 columns) to a multiple of a unit
u = 2^(e_w + e_x) and sums the multiples as int32, exact in any order. For the FADD that rounds
it (1.5 * 2^23 added) |v| / u must stay under 2^22, and for the int32 sum the row's total under
2^31. With e_w = ceil(log2(max over the weight row's blocks of |w_b|)) and e_x =
ceil(log2(max over the x row's blocks of |x_b|)) - 21, Cauchy-Schwarz (|v_b| <= |w_b| |x_b|)
keeps |v| / u <= 2^21 and the total under n_blocks * 2^21. Both exponents depend on one row
alone, so a row's result does not depend on the rows beside it, which is the mode's promise.

This runs a prompt through the cpu backend's float32 reference path (the model's own weights
dequantized), records every matrix product's x and W, and reports per kind of matrix how far the
grid form's result is from the exact (float64) product, against how far the float32 product the
default computes is, and how far the product of x as the GPU quantizes it (15-bit, every form's
error) is: the median and 99th percentile of |error| / rms(row's outputs).

    python3 dev/cuda/grid_precision.py [MODEL.gguf] [--text scripts/draft_tasks/summarise.txt] [--tokens 128]
        [--header-bound] [--x-group-bound] [--step 32 [--chain]]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[2]
BLOCKS = (256, 192, 128, 64, 32)  # columns a block value covers: a K-quant's 256 where K allows
MAGIC_BITS = 21  # |v| / u <= 2^21: the FADD's 2^22, with a factor of two for the steps' own rounding


def block_of(K: int) -> int:
    """The block the grid form would take for rows of K columns (SmolLM2's 576 has no 256)."""
    return next(b for b in BLOCKS if K % b == 0)


def block_norms(a: np.ndarray, b: int = 0) -> np.ndarray:
    """[R, K] -> [R, K / b]: each row's b-column blocks' Euclidean norms (float64; b = 0: the block)."""
    R, K = a.shape
    b = b or block_of(K)
    return np.sqrt((a.astype(np.float64).reshape(R, K // b, b) ** 2).sum(-1))


def i16_activations(x: np.ndarray) -> np.ndarray:
    """x as the GPU's products see it (common.cuh quant2_group, in float64: groups of 32, an
    int8 plane at d = max|x| / 127 and one of the rest at d / 254): the error every form shares."""
    T, K = x.shape
    g = x.astype(np.float64).reshape(T, K // 32, 32)
    d = np.abs(g).max(-1, keepdims=True) / 127
    safe = np.where(d > 0, d, 1)
    q = np.rint(g / safe)
    r = np.clip(np.rint((g - d * q) / (safe / 254)), -127, 127)
    return (d * q + d / 254 * r).reshape(T, K)


def header_block_bounds(w: np.ndarray, b: int = 0) -> np.ndarray:
    """[N, K] -> [N, K / b]: a bound on each b-column block's norm (b = 0: the block) from its
    32-column sub-blocks' largest |w| alone (16 where b is 16), as a K-quant block's header gives
    one (scale and min of each sub-block: |w| <= max(d sc 15 - dmin m, dmin m)); no kernel has to
    read the block's quants for it."""
    N, K = w.shape
    b = b or block_of(K)
    g = min(32, b)
    sub = np.abs(w.astype(np.float64)).reshape(N, K // b, b // g, g).max(-1)
    return np.sqrt((g * sub ** 2).sum(-1))


def plane_block_bounds(x: np.ndarray) -> np.ndarray:
    """[T, K] -> [T, K / b]: each block's norm as the quantized x's first plane gives it, in
    float32 and in one fixed order, so that any kernel holding the planes gets the same bits:
    n_g = fl(fl(d_g d_g) S_g) for each 32-column group (d_g its scale, S_g the sum of its int8
    q squared: an integer, exact in any order), then the block's groups added as a fixed tree
    (pairs, then pairs of pairs: what xor-shuffles across the group's lanes give), then sqrt.
    |x_g| <= |d_g q_g| + d_g sqrt(32) / 2 and |d_g q_g| >= 127 d_g where d_g > 0, so the bound
    is under the exact norm by at most 2.3%: the grid's factor of two covers it."""
    T, K = x.shape
    b = block_of(K)
    g = x.astype(np.float32).reshape(T, K // 32, 32)
    d = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)  # [T, K / 32]: quant2_group's d
    amax = np.abs(g).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(g * inv[..., None])  # quant2_group's q = rint(x * 127 / max|x|)
    S = (q.astype(np.int64) ** 2).sum(-1).astype(np.float32)  # [T, K / 32], exact integers (< 2^19)
    n = ((d * d).astype(np.float32) * S).astype(np.float32).reshape(T, K // b, b // 32)
    while n.shape[-1] > 1:  # the fixed tree: (n0 + n1) + (n2 + n3), ... in float32 (an odd last one waits)
        m = n.shape[-1] // 2 * 2
        n = np.concatenate([(n[..., 0:m:2] + n[..., 1:m:2]).astype(np.float32), n[..., m:]], -1)
    return np.sqrt(n[..., 0].astype(np.float64))


def grid_product(w: np.ndarray, x: np.ndarray, header_bound: bool = False,
                 x_group_bound: bool = False, step: int = 0,
                 chain: bool = False, x_plane_bound: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid form, float64 exact, float32 sequential-by-block, by piece with ``step``) of x @ w.T.
    w: [N, K], x: [T, K];
    ``header_bound``: the weight rows' exponents from header_block_bounds, not the exact norms;
    ``x_group_bound``: the x rows' likewise from their 32-column groups' largest |x| (what the
    quantized x's group scales give, d = max|x| / 127: no pass over x's values for it);
    ``step``: round each ``step``-column piece's value (a sub-block's step of the chain) to the
    grid instead of each block's, with the exponents from the pieces' norms: one integer sum an
    entry and no block value to chain (0: the block);
    ``chain``: with ``step``, the exponents from the blocks' norms, not the pieces': what a block
    value chained from 1.5 * 2^23 units gives, each step's FFMA rounding to the grid (the partial
    sums of a block stay under its bound), one IADD3 a block and no FADD;
    ``x_plane_bound``: the x rows' exponents from plane_block_bounds (the blocks' norms as the
    quantized first plane gives them, in one fixed order: what a consumer of the planes can
    compute itself, so that no producer of x has to)."""
    N, K = w.shape
    blk = step or block_of(K)
    nb = K // blk
    ebk = block_of(K) if chain else blk  # the columns the exponents' norms are taken over
    wb = w.astype(np.float64).reshape(N, nb, blk)
    xb = x.astype(np.float64).reshape(x.shape[0], nb, blk)
    v = np.einsum("nbk,tbk->tnb", wb, xb)  # [T, N, nb]: the block values (exact here)
    e_w = np.ceil(np.log2(np.maximum((header_block_bounds(w, ebk) if header_bound else block_norms(w, ebk)).max(1),
                                     1e-30)))  # [N]
    x_bounds = (plane_block_bounds(x) if x_plane_bound else header_block_bounds(x, ebk) if x_group_bound
                else block_norms(x, ebk))
    e_x = np.ceil(np.log2(np.maximum(x_bounds.max(1), 1e-30))) - MAGIC_BITS  # [T]
    u = np.exp2(e_x[:, None] + e_w[None, :])  # [T, N]
    q = np.rint(v / u[:, :, None])
    assert np.abs(q).max() < 2 ** 22, "the bound failed"  # Cauchy-Schwarz says it cannot
    assert np.abs(q.sum(-1)).max() < 2 ** 31, "a row's sum left int32"
    grid = q.sum(-1) * u
    exact = v.sum(-1)
    f32 = np.zeros(exact.shape, np.float32)
    for b in range(nb):  # the default's f32 chain, block by block (its own steps are finer still)
        f32 += v[:, :, b].astype(np.float32)
    return grid, exact, f32.astype(np.float64)


def record_products(model_path: str, text: str, n_tokens: int) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{matrix kind: [(W, x)]} of one prefill of ``text``'s first ``n_tokens`` tokens on the cpu
    backend's float32 path."""
    from ntx.ctl.tokenizer import Tokenizer
    from ntx.daemons.compute.backend import make_backend
    from ntx.daemons.compute.batch import SeqChunk, StepBatch
    from ntx.daemons.compute.model import LlamaModel
    from ntx.shared.gguf_index import open_model
    from ntx.shared.kernel_options import KernelOptions

    index = open_model(model_path)
    tokens = Tokenizer.from_metadata(index.metadata).encode(text)[:n_tokens]
    backend = make_backend("cpu", index, max_seqs=1, max_ctx=len(tokens) + 1,
                           kernels=KernelOptions(cpu_quantized=False))
    model = LlamaModel(index, backend)
    recorded: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    inner = backend.matmul

    def matmul(w, x, out):
        recorded[f"{w.n_rows}x{w.n_cols}"].append((w.data, np.array(x, np.float32)))
        return inner(w, x, out)

    backend.matmul = matmul
    backend.alloc_sequence(0, len(tokens) + 1)
    model.forward(StepBatch([SeqChunk(0, 0, tuple(tokens))]))
    return recorded


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--text", default=str(_ROOT / "scripts" / "draft_tasks" / "summarise.txt"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--header-bound", action="store_true",
                    help="the weight rows' exponents from the sub-blocks' extremes (what a header gives)")
    ap.add_argument("--step", type=int, default=0,
                    help="round each STEP-column piece's value (32: a K-quant's sub-block) instead of each block's")
    ap.add_argument("--chain", action="store_true",
                    help="with --step: the exponents from the blocks' norms (a block value chained from the FADD's constant)")
    ap.add_argument("--x-group-bound", action="store_true",
                    help="the x rows' exponents from their 32-column groups' extremes (what x's group scales give)")
    ap.add_argument("--x-plane-bound", action="store_true",
                    help="the x rows' exponents from the quantized first plane's block norms, in one fixed order")
    a = ap.parse_args()
    if a.x_plane_bound and (a.step or a.x_group_bound):
        ap.error("--x-plane-bound takes the blocks' norms: not with --step or --x-group-bound")
    if a.chain and not a.step:
        ap.error("--chain rounds each step: give --step (32: a K-quant's sub-block)")
    if a.model is None:
        from ntx.ctl import models
        a.model = str(models.ensure_default_model())
    recorded = record_products(a.model, Path(a.text).read_text(), a.tokens)
    print(f"{a.model}: {a.tokens} tokens; weight exponents from {'the sub-blocks extremes' if a.header_bound else 'exact block norms'}; "
          f"x exponents from {'the first plane' if a.x_plane_bound else 'the groups extremes' if a.x_group_bound else 'exact block norms'}; "
          f"values rounded a {a.step or 'block'}-column piece{' (exponents a block: the chain)' if a.chain else ''}; "
          "|error| / rms(row's outputs), median and 99th percentile")
    print(f"{'matrix (N x K)':18} {'block':>5} {'products':>8} {'grid p50':>10} {'grid p99':>10} {'f32 p50':>10} {'f32 p99':>10} {'i16 x p50':>10} {'i16 x p99':>10}")
    for kind, pairs in sorted(recorded.items()):
        g_err, f_err, x_err = [], [], []
        for w, x in pairs:
            grid, exact, f32 = grid_product(w, x, a.header_bound, a.x_group_bound, a.step, a.chain, a.x_plane_bound)
            rms = np.sqrt((exact ** 2).mean(1, keepdims=True)) + 1e-30
            g_err.append((np.abs(grid - exact) / rms).ravel())
            f_err.append((np.abs(f32 - exact) / rms).ravel())
            x_err.append((np.abs(i16_activations(x) @ w.astype(np.float64).T - exact) / rms).ravel())
        g, f, xe = np.concatenate(g_err), np.concatenate(f_err), np.concatenate(x_err)
        print(f"{kind:18} {a.step or block_of(pairs[0][0].shape[1]):5d} {len(pairs):8d} {np.median(g):10.2e} {np.quantile(g, 0.99):10.2e} "
              f"{np.median(f):10.2e} {np.quantile(f, 0.99):10.2e} {np.median(xe):10.2e} {np.quantile(xe, 0.99):10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
