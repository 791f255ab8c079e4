"""The cuda backend's device memory as a layout of named regions, computed without a GPU or cupy.

One function of a backend configuration, ``backend_layout``, lists every region the backend
keeps in its arena (``arena.py``): the pass workspace the row buckets share (their CUDA graphs
point into it), the kernels' scratch for passes of up to the largest bucket, the head's buffers and
the f16 copy of a matrix the cuBLAS path multiplies. ``eager_layout`` lists a pass above the
buckets (a prompt chunk): its own arena, made per pass. The backend carves its arenas from
these lists and the planner (``cuda_memory_costs``) sums the same lists, so the two cannot
drift. The size of each scratch purpose is the function the launchers call for it
(``i16_planes_bytes``, ``mm_scratch_bytes``, ...), evaluated for every matrix shape of the
model at every row count the layout covers.

Outside the arena, and so in ``ALLOCATOR_SLACK_BYTES``: cuBLAS's workspace, the loaded kernel
modules, the memory CUDA graphs keep, cupy's pool rounding, and the head's small selection
buffers (top-k candidates, gathered rows). The KV cache and the device slots are planned apart
(``MemoryCosts.kv_bytes_per_token``, the plan's slots). A paged KV cache would take fixed-size
pages from the arena's block pool (``Layout.block_bytes``, ``arena.Arena.blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ntx.daemons.compute.backend import Workspace
from ntx.daemons.compute.cuda import tuning
from ntx.daemons.compute.cuda.buckets import MAX_GRAPH_ROWS, bucket_sizes
from ntx.shared.gguf_index import HParams, ModelIndex
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.plan import MemoryCosts
from ntx.shared.quant_types import QuantType, quant_type

__all__ = ["Region", "Layout", "ALIGN_BYTES", "KV_ELEMENT_BYTES", "ALLOCATOR_SLACK_BYTES", "ROW_FIELDS",
           "attention_splits", "attention_rows", "dequant_chunk_rows", "gemm_path", "invariant_path", "gemm_scratch_bytes", "pass_regions", "scratch_regions", "backend_layout", "eager_layout",
           "i16_plane_bytes", "i16_planes_bytes", "mmq_planes_bytes", "mm_scratch_bytes", "mmq_scratch_bytes", "fx_scratch_bytes",
           "tree_mask_words", "matrix_shapes", "backend_tuning", "cuda_memory_costs", "BUCKET_PREFIX",
           "bucket_regions"]

ALIGN_BYTES = 256  # every region starts on this boundary (the i16 planes need 256, vector loads 16)
KV_ELEMENT_BYTES = 2  # the KV cache is f16 (norm_rope_kv.alloc_kv_cache)
# What the arena does not hold: cuBLAS's workspace, loaded modules, graph memory, cupy's pool
# rounding, the head's selection buffers (top-k candidates: B x chunks x k entries)
ALLOCATOR_SLACK_BYTES = 256 << 20
# the kept arena's pass workspace, which every row bucket's passes share (``bucket_regions``)
BUCKET_PREFIX = "buckets/"
# the int32 row fields of a pass, one device array [len, rows] (buckets.PassRows)
ROW_FIELDS = ("tokens", "positions", "cache_positions", "slots", "kv_lens", "tree_base")


@dataclass(frozen=True)
class Region:
    """A named piece of an arena: ``nbytes`` of device memory at an ``ALIGN_BYTES`` boundary,
    zeroed when the arena is made if ``zero`` (the matmuls' tile counters)."""

    name: str
    nbytes: int
    zero: bool = False

    @property
    def padded_bytes(self) -> int:
        return -(-max(self.nbytes, 1) // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Layout:
    """An arena's regions in order, and its block pool: ``n_blocks`` of ``block_bytes`` after
    them (none today; the next step's paged KV cache takes its pages there)."""

    regions: tuple[Region, ...]
    block_bytes: int = 0
    n_blocks: int = 0
    offsets: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        offsets, at = {}, 0
        for r in self.regions:
            if r.name in offsets:
                raise ValueError(f"two regions named {r.name!r}")
            offsets[r.name] = at
            at += r.padded_bytes
        object.__setattr__(self, "offsets", offsets)

    @property
    def blocks_offset(self) -> int:
        return sum(r.padded_bytes for r in self.regions)

    @property
    def total_bytes(self) -> int:
        return self.blocks_offset + self.block_bytes * self.n_blocks

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)


# ------------------------------------------------------------------------------ sizes the launchers use
def attention_splits(T: int, n_kv: int, max_ctx: int, t: tuning.KernelTuning = tuning.DEFAULT) -> int:
    """The key splits attention uses for T query rows on ``t``'s table (as
    ``attention.attention_splits`` takes it on the current device)."""
    return t.attn_splits(T, n_kv, max_ctx)


def attention_rows(rows: int, t: tuning.KernelTuning = tuning.DEFAULT) -> int:
    """Query rows one attention launch takes in a pass of ``rows`` rows: all of them, or in the
    batch-invariant mode at most MAX_GRAPH_ROWS (its key splits do not shrink as rows grow, so a
    wider pass runs attention in launches of that many rows over one workspace of that size:
    ``attention.attention`` cuts the rows to fit its workspace)."""
    return min(rows, tuning.MAX_GRAPH_ROWS) if t.batch_invariant else rows


def tree_mask_words(n_rows: int) -> int:
    """u32 words per row of a tree mask over trees of up to n_rows rows."""
    return max(1, -(-n_rows // 32))


def i16_plane_bytes(B: int, n_cols: int) -> int:
    """One plane of the i16 activations of x [B, n_cols]: int8 x [B, n_cols] (rounded up to 256
    bytes), then f32 (d, d * sum) pairs [B, n_cols / 32], rounded up to 256 bytes."""
    plane = -(-B * n_cols // 256) * 256 + B * (n_cols // 32) * 8
    return -(-plane // 256) * 256


def i16_planes_bytes(B: int, n_cols: int) -> int:
    """Both planes of the i16 activations (matvec.i16_planes): plane 2 after plane 1."""
    return 2 * i16_plane_bytes(B, n_cols)


def mmq_planes_bytes(B: int, n_cols: int) -> int:
    """mmq's activations of x [B, n_cols]: the rows padded to Bp = 8 * ceil(B / 8); both int8
    planes (2 bytes per element) and (d2, sum) per group of 32 (8 bytes)."""
    bp = 8 * -(-B // 8)
    return bp * n_cols * 2 + bp * (n_cols // 32) * 8


def stage_row_bytes(q: QuantType) -> int:
    """Shared memory a staged block takes (quant_traits.cuh MmStage::SROW): the block plus its
    misalignment (Q6_K's 2-byte-aligned blocks), in words, rounded up to 16 bytes."""
    mis = 0 if q.block_bytes % 4 == 0 else 2
    return -(-(-(-(q.block_bytes + mis) // 4) * 4) // 16) * 16


def mmqx_smem_bytes(q: QuantType, nt: int, wr: int, ns: int, sum_bytes: int = 4) -> int:
    """mmqx_kernel's dynamic shared memory (mmq.cu MmqxStage): NS stages of the weights' 16 WR
    rows and x's block for 8 NT rows (its planes and (d2, sum) per group), or the epilogue's
    reduction (WR warps x 16 rows x 8 NT sums of ``sum_bytes``: 8 for fixed point)."""
    bp = 8 * nt
    return max(ns * (16 * wr * stage_row_bytes(q) + 8 * bp * 64 + 8 * bp * 8), wr * 16 * 8 * nt * sum_bytes)


def mm_scratch_bytes(n_rows: int, n_cols: int, B: int, ks: int, tiles: int) -> dict[str, int]:
    """The f16 tensor-core matmul's scratch for x [B, n_cols] against n_rows rows with KS
    splits of ``tiles`` row tiles: x split into f16 halves, and with split-K the partial sums
    and the tile counters."""
    out = {"mm x halves": B * n_cols * 4}
    if ks > 1:
        out.update({"split-k partials": ks * B * n_rows * 4, "split-k counters": tiles * 4})
    return out


def mmq_scratch_bytes(n_rows: int, n_cols: int, B: int, ks: int, tiles: int) -> dict[str, int]:
    """The int8 tensor-core matmul's scratch: x's planes, and with split-K as ``mm``."""
    out = {"mmq x planes": mmq_planes_bytes(B, n_cols)}
    if ks > 1:
        out.update({"split-k partials": ks * B * n_rows * 4, "split-k counters": tiles * 4})
    return out


def mm_cut(q: QuantType, n_cols: int) -> tuple[str, int] | None:
    """(cut, quad steps per row) the tensor-core matmul takes for rows of n_cols columns of q:
    its first cut (QuantType.mm_cuts) whose block divides the row into whole quad steps (4
    pieces); None when there is none."""
    for cut, epb, lpb in q.mm_cuts:
        if n_cols % epb == 0 and (n_cols // epb * lpb) % 4 == 0:
            return cut, n_cols // epb * lpb // 4
    return None


def invariant_path(q: QuantType, n_cols: int, T: int, rows: bool = False, fixed_rows: int = 0) -> str:
    """The batch-invariant mode's path for T rows of x against rows of n_cols of type q, where a
    row's bits do not depend on T. The form in use: one path at every T, "mmq" for the
    K-quants, "mm" for the other types mm decodes at this row length (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, F16), "matvec" for the rest (F32, BF16, an F16 row mm cannot cut), beyond MAX_MM_ROWS
    (MAX_MATVEC_B for the matvec) in chunks of that many rows. ``rows``
    (``KernelOptions.invariant_rows``; bitwise on the GPU, cheap at one row only): the
    block-quantized types take the i16 matvec up to MAX_MATVEC_B rows ("i16", one warps-per-CTA
    per type at every B) and "rows" past that (``matvec.matvec_rows``: the matvec's f32 steps in
    its order), F16 and the float types as above. Never cuBLAS: its kernel and split of K change
    with the shape, and it rounds x to f16. ``fixed_rows`` (``KernelOptions.invariant_fixed``:
    the table's fx_matvec_rows, 0 off): the K-quants' sums in 64-bit fixed point, the same bits
    in any order (fixed_point.py), "fxmv" (the fixed-point matvec) up to that many rows and
    "fxmmq" (fixed-point mmq) past them; the other types as in the form in use. Why the forms:
    docs/ARCHITECTURE.md, "Batch-invariant mode"."""
    if rows and q.dp4a:
        return "i16" if T <= tuning.MAX_MATVEC_B else "rows"
    if q.mm_staged and n_cols % 256 == 0:
        if fixed_rows:
            return "fxmv" if T <= min(fixed_rows, tuning.MAX_MATVEC_B) else "fxmmq"
        return "mmq"
    if mm_cut(q, n_cols) is not None:
        return "mm"
    return "matvec"


def gemm_path(q: QuantType, n_cols: int, T: int, t: tuning.KernelTuning) -> str:
    """Which path gemm takes for T rows of x against rows of n_cols of type q: "dequant"
    (beyond MAX_MM_ROWS: an f16 copy and cuBLAS), "mmq" (the K-quants from mmq_min_rows rows),
    "mm" (the other types mm decodes, from mm_min_rows rows), "i16" (one i16 matvec launch, up
    to 8 rows of the block-quantized types), or "matvec" (the matvec in chunks of 8 rows). On a
    batch-invariant table (``tuning.batch_invariant``) ``invariant_path``: one path per format
    (or, in its rows form, "i16" then "rows" for the block-quantized types; in its fixed form
    "fxmv" then "fxmmq" for the K-quants)."""
    if t.batch_invariant:
        return invariant_path(q, n_cols, T, t.invariant_rows, t.fx_matvec_rows if t.invariant_fixed else 0)
    if T > tuning.MAX_MM_ROWS:
        return "dequant"
    if q.mm_staged and n_cols % 256 == 0:  # the K-quants (mm.MMQ_TYPES)
        if T >= t.mmq_min_rows:
            return "mmq"
    elif T >= t.mm_min_rows and mm_cut(q, n_cols) is not None:
        return "mm"
    if T <= tuning.MAX_MATVEC_B and q.dp4a:
        return "i16"
    return "matvec"


def gemm_scratch_bytes(q: QuantType, n_rows: int, n_cols: int, T: int, t: tuning.KernelTuning) -> dict[str, int]:
    """The scratch gemm takes for T rows of x against W [n_rows, n_cols] of type q, by purpose
    (the i16 planes of one quantization; the chunked matvec's are per chunk of 8 rows; the
    batch-invariant mode's matmuls and matvec_rows are per chunk of MAX_MM_ROWS rows)."""
    path = gemm_path(q, n_cols, T, t)
    if t.batch_invariant:
        T = min(T, tuning.MAX_MM_ROWS)
    if path in ("mmq", "fxmmq"):  # mm.mmq / fixed_point.fx_mmq: mmqx's launch where it runs, else mmq's
        c = t.mmq_choice(q.qtype, T, n_rows, n_cols // 256)
        tiles = -(-n_rows // (16 * c.wr))
        if path == "mmq":
            return mmq_scratch_bytes(n_rows, n_cols, T, c.ks, tiles)
        return fx_scratch_bytes(n_rows, T, c.ks, tiles, {"mmq x planes": mmq_planes_bytes(T, n_cols)})
    if path == "mm":
        cut = mm_cut(q, n_cols)
        wr, wk, ks = t.mm_launch(T, n_rows, cut[1])
        return mm_scratch_bytes(n_rows, n_cols, T, ks, -(-n_rows // (16 * wr)))
    if path == "fxmv":  # fixed_point.fx_matvec on the i16 planes (pieces, split-K staged, or direct)
        planes = {"i16 planes": i16_planes_bytes(T, n_cols)}
        if t.fx_matvec_kernel != "staged":
            return planes
        _, ks = t.fx_mvs_launch(n_rows, n_cols // 256)
        return fx_scratch_bytes(n_rows, T, ks, -(-n_rows // 32), planes)
    if path == "rows":  # the planes of one launch's rows (gemm runs it MAX_MM_ROWS rows at a time)
        return {"i16 planes": i16_planes_bytes(T, n_cols)}
    if path in ("i16", "matvec") and q.dp4a:
        return {"i16 planes": i16_planes_bytes(min(T, tuning.MAX_MATVEC_B), n_cols)}
    return {}


def fx_scratch_bytes(n_rows: int, B: int, ks: int, tiles: int, planes: dict[str, int]) -> dict[str, int]:
    """A fixed-point product's scratch (fixed_point.py): x's planes, and with split-K its 64-bit
    partial sums [ks, B, n_rows] and the tile counters (mmq's and mm's: each launch resets its own)."""
    out = dict(planes)
    if ks > 1:
        out.update({"fx split-k partials": ks * B * n_rows * 8, "split-k counters": tiles * 4})
    return out


def dequant_chunk_rows(n_rows: int, n_cols: int) -> int:
    """Rows of W [n_rows, n_cols] the cuBLAS path (``gemm.gemm_dequant``) copies to f16 and
    multiplies at a time: all of them where their f16 copy fits in ``tuning.DEQUANT_W16_BYTES``,
    else as many as fit, a multiple of 256 (at least 256)."""
    fit = tuning.DEQUANT_W16_BYTES // (2 * n_cols)
    if fit >= n_rows:
        return n_rows
    return max(256, fit // 256 * 256)


def matrix_shapes(index: ModelIndex) -> set[tuple[int, int, int]]:
    """(type, rows, columns) of every matrix the backend multiplies: the layers' and the head."""
    shapes = {(int(t.ggml_type), t.shape[0], t.shape[1]) for layer in index.layers
              for t in layer.tensors.values() if len(t.shape) == 2}
    g = index.globals
    head = g.get("output", g["token_embd"])
    shapes.add((int(head.ggml_type), head.shape[0], head.shape[1]))
    return shapes


# ------------------------------------------------------------------------------ the layouts
def pass_regions(hp: HParams, rows: int, max_ctx: int, prefix: str = "",
                 t: tuning.KernelTuning = tuning.DEFAULT) -> list[Region]:
    """A pass of ``rows`` rows (``backend._Work``): the int32 row fields [6, rows], the tree mask
    (u32 [rows, tree_mask_words(rows)]), the block's f32 buffers (``Workspace.allocate``) and
    attention's split partials (its splits for ``rows`` rows at ``max_ctx`` on ``t``, for the
    rows one attention launch takes: ``attention_rows``)."""
    S = attention_splits(rows, hp.n_head_kv, max_ctx, t)
    attn_rows = attention_rows(rows, t)
    regions = [Region("row fields", len(ROW_FIELDS) * rows * 4), Region("tree mask", rows * tree_mask_words(rows) * 4)]
    for name, width in Workspace.buffer_widths(hp):
        regions.append(Region(name, rows * width * 4))
    regions += [Region("attention ml", attn_rows * hp.n_head * S * 2 * 4),
                Region("attention acc", attn_rows * hp.n_head * S * hp.head_dim * 4)]
    return [Region(prefix + r.name, r.nbytes, r.zero) for r in regions]


def bucket_regions(hp: HParams, max_graph_rows: int, max_ctx: int,
                   t: tuning.KernelTuning = tuning.DEFAULT) -> list[Region]:
    """The pass workspace every row bucket up to ``max_graph_rows`` runs in (``BUCKET_PREFIX``):
    each of ``pass_regions``'s regions as large as the largest bucket needs it (attention's
    partials are not monotone in the rows: its splits shrink as they grow). A bucket's pass
    views the first bytes of each. One workspace serves them all because passes run one after
    another on the backend's one stream and a pass writes every region before it reads it (the
    row fields and, with trees, the tree mask are copied in by ``begin_pass``; the buffers are
    the block's, written by their layer). Kept apart, the 70B's fifteen buckets took 279.6 MiB,
    the largest 41.8 MiB: the difference is about half a 70B layer (docs/PERFORMANCE.md)."""
    need: dict[str, int] = {}
    for rows in bucket_sizes(max_graph_rows):
        for r in pass_regions(hp, rows, max_ctx, t=t):
            need[r.name] = max(need.get(r.name, 0), r.nbytes)
    return [Region(BUCKET_PREFIX + name, nbytes) for name, nbytes in need.items()]


def head_regions(hp: HParams, rows: int) -> list[Region]:
    """The head of up to ``rows`` logit rows: the final norm [rows, D] and the logits [rows, V]."""
    return [Region("head h", rows * hp.n_embd * 4), Region("logits", rows * hp.n_vocab * 4)]


def scratch_regions(shapes, max_rows: int, model_width: int, t: tuning.KernelTuning = tuning.DEFAULT) -> list[Region]:
    """The kernels' scratch for every product of up to ``max_rows`` rows of x (a size's needs
    grow with its rows, so the buckets up to it cover every row count) over matrices of
    ``shapes`` (type, rows, columns): per purpose the most any product takes
    (``gemm_scratch_bytes``), the split-K tile counters zeroed, and gemm(accumulate)'s product
    off the i16 path ([rows, model_width]: the down matrix adds into x). One region per purpose
    serves every product: the products of one stream run one after another, and each
    quantization's products run before the next quantization writes the planes again."""
    need: dict[str, int] = {}
    for qtype, n_rows, n_cols in sorted(shapes):
        q = quant_type(qtype)
        for T in bucket_sizes(max_rows):
            for purpose, nbytes in gemm_scratch_bytes(q, n_rows, n_cols, T, t).items():
                need[purpose] = max(need.get(purpose, 0), nbytes)
    need["gemm accumulate"] = max_rows * model_width * 4
    return [Region(name, nbytes, zero=name == "split-k counters") for name, nbytes in sorted(need.items())]


def backend_layout(index: ModelIndex, max_ctx: int, max_graph_rows: int = MAX_GRAPH_ROWS,
                   t: tuning.KernelTuning = tuning.DEFAULT) -> Layout:
    """Everything the cuda backend keeps for ``index`` with a KV cache of ``max_ctx`` positions:
    the pass workspace the row buckets share (``bucket_regions``) and the head's buffers for the largest
    bucket (``max_graph_rows``: 0 without graphs), the kernels' scratch for every product of up
    to MAX_MM_ROWS rows (the head multiplies in chunks of that many), and the f16 copy of a
    layer matrix's rows (``dequant w16``, the most rows ``dequant_chunk_rows`` takes at once:
    the cuBLAS path of eager passes; none in the batch-invariant mode, which never takes it)."""
    hp = index.hparams
    regions: list[Region] = []
    regions += bucket_regions(hp, max_graph_rows, max_ctx, t)
    if max_graph_rows:
        regions += head_regions(hp, max_graph_rows)
    regions += scratch_regions(matrix_shapes(index), tuning.MAX_MM_ROWS, hp.n_embd, t)
    if t.batch_invariant:
        return Layout(tuple(regions))
    largest = max(dequant_chunk_rows(m.shape[0], m.shape[1]) * m.shape[1]
                  for layer in index.layers for m in layer.tensors.values() if len(m.shape) == 2)
    regions.append(Region("dequant w16", largest * 2))
    return Layout(tuple(regions))


def eager_layout(hp: HParams, rows: int, max_ctx: int, t: tuning.KernelTuning = tuning.DEFAULT,
                 own_head: bool = False) -> Layout:
    """A pass above the buckets (made per pass, freed after): its workspace, the f16 copy of x
    the cuBLAS path multiplies (``dequant x16``, the widest row multiplied; not in the
    batch-invariant mode) and gemm(accumulate)'s product (the down matrix's [rows, D]). Its
    head runs MAX_GRAPH_ROWS rows at a time in the kept arena's head buffers (the backend's
    ``_head_chunks``: [512, V] logits of their own took 250 MiB of a 128k vocabulary's VRAM), or,
    without graphs (``own_head``: the kept arena holds no head), in buffers of its own for that
    many rows."""
    widest = max(hp.n_embd, hp.q_dim, hp.n_ff)
    dequant = [] if t.batch_invariant else [Region("dequant x16", rows * widest * 2)]
    head = head_regions(hp, min(rows, MAX_GRAPH_ROWS)) if own_head else []
    return Layout(tuple(pass_regions(hp, rows, max_ctx, t=t) + head
                        + dequant + [Region("gemm accumulate", rows * hp.n_embd * 4)]))


def backend_tuning(kernels: KernelOptions | None, t: tuning.KernelTuning = tuning.DEFAULT) -> tuning.KernelTuning:
    """The table the cuda backend launches from under ``kernels``: ``t``, or its batch-invariant
    form (``tuning.batch_invariant``) when the switch asks for it."""
    if kernels is None or not kernels.batch_invariant:
        return t
    return tuning.batch_invariant(t, rows=kernels.invariant_rows, fixed=kernels.invariant_fixed)


def cuda_memory_costs(index: ModelIndex, *, max_seqs: int, max_ctx: int, max_pass_rows: int,
                      kernels: KernelOptions | None = None) -> MemoryCosts:
    """Resident layers as their GGUF bytes; the globals, of which the token embedding may stay in
    host memory (``host_globals_bytes``, where the head is a tensor of its own); the KV cache of
    ``max_seqs`` sequences at full context, reserved up front; the workspace: the backend's
    arena (``backend_layout``), the arena of the largest eager pass (``eager_layout`` of
    ``max_pass_rows`` rows, when that is above the buckets: ``EngineOptions.largest_pass_rows``,
    a prompt chunk beside every other sequence's decode row and draft tree) and
    ``ALLOCATOR_SLACK_BYTES``, on the table
    ``kernels`` makes (``backend_tuning``: the batch-invariant mode's attention partials are
    larger, it keeps no f16 copy for cuBLAS)."""
    hp = index.hparams
    ctx = min(max_ctx, hp.n_ctx_train)
    t = backend_tuning(kernels)
    eager = eager_layout(hp, max_pass_rows, ctx, t).total_bytes if max_pass_rows > MAX_GRAPH_ROWS else 0
    return MemoryCosts(
        memory_name="VRAM",
        layer_bytes=tuple(layer.nbytes for layer in index.layers),
        globals_bytes=index.global_bytes_total,
        kv_bytes_per_token=2 * hp.n_layers * hp.kv_dim * KV_ELEMENT_BYTES,
        kv_tokens=ctx * max_seqs,
        workspace_bytes=ALLOCATOR_SLACK_BYTES + backend_layout(index, ctx, t=t).total_bytes + eager,
        # the embedding, when the head is its own tensor: a pass gathers a few rows of it, which
        # the get_rows kernel reads as well from mapped host memory (CudaBackend.load_globals)
        host_globals_bytes=index.globals["token_embd"].nbytes if "output" in index.globals else 0,
    )
