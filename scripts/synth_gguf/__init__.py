"""Synthetic Llama GGUF files: any shape, any supported tensor type, random but valid blocks.

What it is for: exercising the loader, the planner and the streaming pipeline on models of the
real sizes (8B, 70B) without downloading them, and producing deliberately broken files for the
loader's error paths. The weights are random, so the text is gibberish, but every block is a
valid block of its type and activations stay finite and well scaled through all layers.

Test and benchmark tooling, not part of the runtime: nothing under ``ntx`` imports it. It lives
in ``scripts/``, which is on ``sys.path`` when a script there runs (``python3
scripts/make_gguf.py``) and which ``tests/conftest.py`` puts on it for the tests. It reads GGUF
headers through ``ntx.shared.gguf_index.read_header`` and takes block sizes and the supported
types from ``ntx.shared.quant_types``; it states neither itself.

One module per seam:

``config``     ``SynthConfig``, the presets and the deliberate breakages
``plan``       every tensor's name, shape, type (llama.cpp's mixes and fallbacks) and file order
``blocks``     random valid blocks, one encoder per quant type, in checked pools
``vocab``      tokenizer pairs: a small byte-level BPE vocabulary, or a real model's copied
``gguf_file``  GGUF encoding and file writing, gguf-split sets (``split_gguf``)
``model``      ``write_llama_gguf``: a whole model from a config
"""

from .blocks import llama31_rope_factors, make_blocks
from .config import (ALL_TYPES, ARCHS, BREAKAGES, MATRIX_TYPES, MIXES, ORDERS, PRESETS, Breakage,
                     SynthConfig, preset_config)
from .gguf_file import encode_kv, split_gguf
from .model import WriteStats, write_llama_gguf
from .plan import TensorSpec, choose_type, tensor_plan, tensor_types, use_more_bits
from .vocab import minimal_tokenizer_kvs, tokenizer_kvs_from

__all__ = [
    "ALL_TYPES", "ARCHS", "BREAKAGES", "Breakage", "MATRIX_TYPES", "MIXES", "ORDERS", "PRESETS",
    "SynthConfig", "TensorSpec", "WriteStats", "choose_type", "encode_kv", "llama31_rope_factors",
    "make_blocks", "minimal_tokenizer_kvs", "preset_config", "split_gguf", "tensor_plan",
    "tensor_types", "tokenizer_kvs_from", "use_more_bits", "write_llama_gguf",
]
