"""The one table of GGUF tensor types ntx reads, keyed by gguf's ``GGMLQuantizationType``.

Block sizes come from gguf's own ``GGML_QUANT_SIZES`` (never restated here); what this table
adds is what ntx needs beyond the file format: which types it supports, what a GPU kernel needs
of a row (its length a multiple of ``kernel_col_multiple``, its start aligned to
``kernel_align_bytes`` for the kernel's vector loads) and which *layout cuts* the kernels' decoders
have for the type (daemons/compute/cuda/quant_traits.cuh QTraits). A cut is a way of dividing a
block among a warp's lanes: ``"v1"`` (every type has it) and ``"v2"`` (the lane-contiguous cut,
whose activation loads cover whole cache lines). A cut is its own field, never an offset added to
the type id. ``mm_cuts``: the cuts the f16 tensor-core matmul decodes the type through (its
exact-integer decoder, MmTraits), in order of preference, with the (columns, pieces) of that
cut's block.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

__all__ = ["QuantType", "QUANT_TYPES", "SUPPORTED_TYPES", "quant_type", "tensor_nbytes", "row_nbytes"]


@dataclass(frozen=True)
class QuantType:
    """One supported tensor type: its block (from gguf) and what the kernels need of it."""

    qtype: QT
    kernel_col_multiple: int  # n_cols must be a multiple of this for the GPU kernels
    kernel_align_bytes: int  # base address and row length alignment the kernels' loads need
    cuts: tuple[str, ...] = ("v1",)  # layout cuts that exist for this type (QTraits)
    dp4a: bool = False  # integer dot products exist for this type (QDTraits): its matvec is the i16 one
    # f16 tensor-core matmul: cut -> (columns, pieces) of its block (QTraits EPB, LPB)
    mm_cuts: tuple[tuple[str, int, int], ...] = ()
    mm_staged: bool = False  # its blocks go through the staged kernels' shared memory (MmStage): mmq decodes it

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block_elems(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def quantized(self) -> bool:
        """Block-quantized (not a plain float type)."""
        return self.block_elems > 1


QUANT_TYPES: dict[QT, QuantType] = {
    q.qtype: q
    for q in (
        QuantType(QT.F32, 8, 16),
        QuantType(QT.F16, 8, 16, mm_cuts=(("v1", 8, 1),)),
        QuantType(QT.BF16, 8, 16),
        QuantType(QT.Q4_0, 32, 2, dp4a=True, mm_cuts=(("v1", 32, 4),)),
        QuantType(QT.Q4_1, 32, 4, dp4a=True, mm_cuts=(("v1", 32, 4),)),
        QuantType(QT.Q5_0, 32, 2, dp4a=True, mm_cuts=(("v1", 32, 4),)),
        QuantType(QT.Q5_1, 32, 4, dp4a=True, mm_cuts=(("v1", 32, 4),)),
        # Q8_0's v2 block is a pair of blocks: rows of an odd number of blocks take v1
        QuantType(QT.Q8_0, 32, 2, cuts=("v1", "v2"), dp4a=True, mm_cuts=(("v2", 64, 8), ("v1", 32, 4))),
        QuantType(QT.Q4_K, 256, 16, cuts=("v1", "v2"), dp4a=True, mm_cuts=(("v2", 256, 32),), mm_staged=True),
        QuantType(QT.Q5_K, 256, 16, cuts=("v1", "v2"), dp4a=True, mm_cuts=(("v2", 256, 32),), mm_staged=True),
        QuantType(QT.Q6_K, 256, 2, cuts=("v1", "v2"), dp4a=True, mm_cuts=(("v2", 256, 32),), mm_staged=True),
    )
}
SUPPORTED_TYPES = frozenset(QUANT_TYPES)
_BY_ID: dict[int, QuantType] = {int(k): v for k, v in QUANT_TYPES.items()}  # kernels look types up per call


def quant_type(qtype: int | QT) -> QuantType:
    """The table entry of a type id; ``KeyError`` names the type when ntx does not read it."""
    q = _BY_ID.get(int(qtype))
    if q is None:
        known = int(qtype) in QT._value2member_map_
        raise KeyError(f"tensor type {QT(int(qtype)).name if known else f'id {int(qtype)}'} is not supported")
    return q


def row_nbytes(qtype: int | QT, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` elements; ``ValueError`` when n_cols is not whole blocks."""
    q = quant_type(qtype)
    if n_cols % q.block_elems:
        raise ValueError(f"n_cols={n_cols} is not a multiple of the {q.name} block size {q.block_elems}")
    return n_cols // q.block_elems * q.block_bytes


def tensor_nbytes(qtype: int | QT, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (numpy order: rows first) stored as ``qtype``."""
    n = 1
    for d in shape:
        n *= int(d)
    block_elems, block_bytes = GGML_QUANT_SIZES[QT(int(qtype))]
    return n // block_elems * block_bytes
