"""What a synthetic model is: its shape and type (``SynthConfig``, the presets) and the deliberate
breakages that make a file the loader must reject."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import DEFAULT_ALIGNMENT
from ntx.shared.quant_types import QUANT_TYPES

#: Matrix types the generator writes valid random blocks for: every type ntx reads.
MATRIX_TYPES: tuple[str, ...] = tuple(q.name for q in QUANT_TYPES.values())
#: llama.cpp-style mixes: name -> base type.
MIXES: dict[str, str] = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
ALL_TYPES: tuple[str, ...] = MATRIX_TYPES + tuple(MIXES)
#: Tensor orders in the file (see ``plan``).
ORDERS = ("convert", "hf", "quantize")
#: Architectures written (general.architecture, the metadata keys' prefix).
ARCHS = ("llama", "qwen2")


@dataclass
class SynthConfig:
    """Shape and content of a synthetic Llama model.

    ``type`` is one of :data:`ALL_TYPES` (a single matrix type, or a mix like ``Q4_K_M``).
    ``vocab_size`` must equal the tokenizer's size when ``tokenizer_from`` is given.
    """

    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 4096
    tied_embeddings: bool = False
    head_dim: int | None = None          # default d_model // n_heads
    type: str = "Q4_K_M"
    output_type: str | None = None       # override the type of output (or tied token_embd)
    token_embd_type: str | None = None   # override the type of an untied token_embd
    rope_freqs: bool = False             # write rope_freqs.weight (Llama 3.1 scaling factors)
    seed: int = 0
    name: str = "synthetic-llama"
    tokenizer_from: str | os.PathLike | None = None
    order: str = "convert"               # one of ORDERS (see plan)
    alignment: int = DEFAULT_ALIGNMENT
    arch: str = "llama"                  # one of ARCHS: "qwen2" adds q, k, v biases and NEOX RoPE

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"synthetic model config: {msg}")

        for f in ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "vocab_size"):
            if int(getattr(self, f)) < 1:
                bad(f"{f} must be >= 1 (got {getattr(self, f)})")
        if self.head_dim is None and self.d_model % self.n_heads:
            bad(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.hd % 2:
            bad(f"head_dim {self.hd} must be even (RoPE)")
        if self.type not in ALL_TYPES:
            bad(f"type {self.type!r} is not one of {', '.join(ALL_TYPES)}")
        for f in ("output_type", "token_embd_type"):
            v = getattr(self, f)
            if v is not None and v not in MATRIX_TYPES:
                bad(f"{f} {v!r} is not one of {', '.join(MATRIX_TYPES)}")
        if self.arch not in ARCHS:
            bad(f"arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.order not in ORDERS:
            bad(f"order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.alignment < 1 or self.alignment & (self.alignment - 1) or self.alignment % 8:
            bad(f"alignment {self.alignment} must be a power of two and a multiple of 8")


PRESETS: dict[str, dict] = {
    "tiny": dict(n_layers=4, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab_size=512,
                 rope_base=10000.0, context_length=2048, tied_embeddings=False),
    "smollm2-135m": dict(n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3,
                         vocab_size=49152, rope_base=100000.0, context_length=8192,
                         tied_embeddings=True),
    # Llama-3.2-1B's shape: a draft model for the 70B (the same synthetic vocabulary, as the
    # vocabulary depends on vocab_size only; speculation.check_same_vocabulary compares it)
    "llama3-1b": dict(n_layers=16, d_model=2048, d_ff=8192, n_heads=32, n_kv_heads=8,
                      vocab_size=128256, rope_base=500000.0, context_length=8192,
                      tied_embeddings=True),
    # Qwen2.5-Coder-1.5B's shape (the real one: docs/QUALITY.md, "Qwen2"): q, k, v biases, halves rotated
    "qwen2.5-1.5b": dict(n_layers=28, d_model=1536, d_ff=8960, n_heads=12, n_kv_heads=2,
                         vocab_size=151936, rope_base=1000000.0, context_length=32768,
                         tied_embeddings=False, arch="qwen2", rms_eps=1e-6),
    "llama3-8b": dict(n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8,
                      vocab_size=128256, rope_base=500000.0, context_length=8192,
                      tied_embeddings=False),
    "llama3-70b": dict(n_layers=80, d_model=8192, d_ff=28672, n_heads=64, n_kv_heads=8,
                       vocab_size=128256, rope_base=500000.0, context_length=8192,
                       tied_embeddings=False),
}


def preset_config(preset: str, **overrides) -> SynthConfig:
    """A :class:`SynthConfig` from a preset name, with any field overridden (None = keep)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset], name=f"synthetic-{preset}")
    names = {f.name for f in dataclasses.fields(SynthConfig)}
    for k, v in overrides.items():
        if k not in names:
            raise ConfigError(f"unknown config field {k!r}")
        if v is not None:
            fields[k] = v
    return SynthConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Deliberate breakage (for loader tests)


@dataclass
class Breakage:
    """Ways to make a file the loader must reject. Every field left at None/False is intact."""

    drop_tensor: str | None = None           # omit this tensor entirely
    duplicate_tensor: str | None = None      # write this tensor twice under the same name
    wrong_shape: str | None = None           # halve this tensor's ne[1] (data size matches)
    arch: str | None = None                  # general.architecture value, e.g. "mamba"
    version: int | None = None               # GGUF header version, e.g. 1
    truncate: int | None = None              # cut this many bytes off the end (-1: half the last tensor)
    tensor_type: dict[str, str] | None = None  # force a type, e.g. {"blk.0.attn_q.weight": "Q2_K"}
    drop_key: str | None = None              # omit this metadata key, e.g. "llama.block_count"
    bad_magic: bool = False                  # b"GGUX" instead of b"GGUF"


#: Short names for ``write_llama_gguf``'s ``breakage=`` (a string or a :class:`Breakage`).
BREAKAGES: dict[str, Breakage] = {
    "drop_tensor": Breakage(drop_tensor="blk.0.attn_q.weight"),
    "duplicate_name": Breakage(duplicate_tensor="blk.0.attn_k.weight"),
    "wrong_shape": Breakage(wrong_shape="blk.0.ffn_up.weight"),
    "bad_arch": Breakage(arch="mamba"),
    "version1": Breakage(version=1),
    "truncate": Breakage(truncate=-1),
    "q2_k": Breakage(tensor_type={"blk.0.attn_q.weight": "Q2_K"}),
    "iq2_xxs": Breakage(tensor_type={"blk.0.ffn_gate.weight": "IQ2_XXS"}),
    "missing_key": Breakage(drop_key="llama.block_count"),
    "bad_magic": Breakage(bad_magic=True),
}


def resolve_breakage(b: Breakage | str | None) -> Breakage:
    """A :class:`Breakage` from itself, a key of :data:`BREAKAGES` or None (intact)."""
    if b is None:
        return Breakage()
    if isinstance(b, Breakage):
        return b
    if b in BREAKAGES:
        return dataclasses.replace(BREAKAGES[b])
    raise ConfigError(f"unknown breakage {b!r}; choose one of {', '.join(BREAKAGES)}")
