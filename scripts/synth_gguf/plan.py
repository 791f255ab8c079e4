"""The tensor plan of a synthetic model: every tensor's name, shape, type and place in the file.

Tensor order is per-layer contiguous; three orders are offered (``SynthConfig.order``):

``"convert"`` (default)
    ``[rope_freqs]``, ``token_embd``, ``blk.0.*`` … ``blk.N-1.*`` (attn_norm, attn_q, attn_k,
    attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down), ``output_norm``, ``[output]``.
``"hf"``
    What ``convert_hf_to_gguf.py`` produces from HF safetensors, whose keys are sorted as strings:
    ``token_embd``, layers in *string* order (0, 1, 10, 11, …, 19, 2, 20, …), inside a layer
    attn_norm, ffn_down, ffn_gate, ffn_up, ffn_norm, attn_k, attn_output, attn_q, attn_v, then
    ``output_norm``, ``output`` (the real SmolLM2 GGUF looks like this).
``"quantize"``
    What ``llama-quantize`` writes (its ``weight_name_comparer``): the non-layer tensors first,
    sorted by name (``output``, ``output_norm``, ``rope_freqs``, ``token_embd``), then layers in
    numeric order, each layer's tensors sorted by name.

Type mixes ``Q4_K_M`` / ``Q5_K_M`` follow llama.cpp's ``llama_tensor_get_type`` (llama-quant.cpp):
base type Q4_K / Q5_K; ``attn_v`` and ``ffn_down`` get Q6_K where ``use_more_bits(i, n)``
(``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``); ``attn_v`` that is still Q4_K becomes Q5_K in a
"70B" model (80 layers with GQA); ``output`` (or ``token_embd`` when embeddings are tied) is Q6_K,
or Q8_0 when its row length is not a multiple of 256; an untied ``token_embd`` keeps the base
type. Any tensor whose row length does not fit the type's block falls back the way llama.cpp
does (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0, then F16). Single types are "pure": every matrix gets it
(with the same fallback). 1-D tensors (norms, rope_freqs) are always F32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ntx.shared.gguf_index import LAYER_TENSORS
from ntx.shared.quant_types import tensor_nbytes

from .config import MIXES, SynthConfig

# convert_hf_to_gguf order: HF names sorted as strings, mapped to GGUF names.
_HF_LAYER_ORDER = ("attn_norm", "ffn_down", "ffn_gate", "ffn_up", "ffn_norm",
                   "attn_k", "attn_output", "attn_q", "attn_v")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the plan: what the writer writes for it."""

    name: str
    shape: tuple[int, ...]   # GGUF order: ne[0] (row length, fan_in) first
    qtype: int               # a GGMLQuantizationType value
    std: float               # target std of a weight matrix; 0 for 1-D tensors
    layer: int | None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    @property
    def type_name(self) -> str:
        return QT(self.qtype).name


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in *_K_M mixes."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
             QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0}


def _fallback(qtype: QT, ncols: int) -> QT:
    """llama.cpp's tensor_type_fallback: a type whose block fits a row of ``ncols``."""
    blck = GGML_QUANT_SIZES[qtype][0]
    if ncols % blck == 0:
        return qtype
    alt = _FALLBACK.get(qtype, QT.F16)
    if ncols % GGML_QUANT_SIZES[alt][0]:
        alt = QT.F16
    return alt


def _is_70b(cfg: SynthConfig) -> bool:
    # llama-model.cpp: 80 layers -> 65B if n_head == n_head_kv, else 70B
    return cfg.n_layers == 80 and cfg.n_heads != cfg.n_kv_heads


def choose_type(cfg: SynthConfig, name: str, shape: Sequence[int]) -> QT:
    """The type a tensor gets for ``cfg.type`` (see the module doc for the rules)."""
    if len(shape) < 2:
        return QT.F32
    layer = _layer_of(name)
    kind = name.split(".")[-2] if layer is not None else name.rsplit(".", 1)[0]
    is_output = kind == "output" or (cfg.tied_embeddings and kind == "token_embd")
    if cfg.type in MIXES:
        base = QT[MIXES[cfg.type]]
        t = base
        if is_output:
            t = QT.Q8_0 if shape[0] % GGML_QUANT_SIZES[base][0] else QT.Q6_K
        elif kind == "attn_v":
            if use_more_bits(layer, cfg.n_layers):
                t = QT.Q6_K
            if _is_70b(cfg) and t in (QT.Q3_K, QT.Q4_K):
                t = QT.Q5_K
        elif kind == "ffn_down":
            if use_more_bits(layer, cfg.n_layers):
                t = QT.Q6_K
    else:
        t = QT[cfg.type]
    if is_output and cfg.output_type:
        t = QT[cfg.output_type]
    elif kind == "token_embd" and cfg.token_embd_type:
        t = QT[cfg.token_embd_type]
    if t in (QT.F32, QT.F16, QT.BF16):
        return t
    return _fallback(t, shape[0])


def _layer_of(name: str) -> int | None:
    if name.startswith("blk."):
        return int(name.split(".")[1])
    return None


def _shapes(cfg: SynthConfig) -> dict[str, tuple[int, ...]]:
    d, ff, hd, v = cfg.d_model, cfg.d_ff, cfg.hd, cfg.vocab_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layer = {"attn_norm": (d,), "attn_q": (d, q), "attn_k": (d, kv), "attn_v": (d, kv),
             "attn_output": (q, d), "ffn_norm": (d,), "ffn_gate": (d, ff), "ffn_up": (d, ff),
             "ffn_down": (ff, d)}
    out: dict[str, tuple[int, ...]] = {}
    if cfg.rope_freqs:
        out["rope_freqs.weight"] = (hd // 2,)
    out["token_embd.weight"] = (d, v)
    for i in range(cfg.n_layers):
        for k in LAYER_TENSORS:
            out[f"blk.{i}.{k}.weight"] = layer[k]
        if cfg.arch == "qwen2":  # llama.cpp's converter writes each bias after its weight's layer
            out |= {f"blk.{i}.attn_q.bias": (q,), f"blk.{i}.attn_k.bias": (kv,), f"blk.{i}.attn_v.bias": (kv,)}
    out["output_norm.weight"] = (d,)
    if not cfg.tied_embeddings:
        out["output.weight"] = (d, v)
    return out


def _ordered_names(cfg: SynthConfig, names: Iterable[str]) -> list[str]:
    names = list(names)
    if cfg.order == "convert":
        return names  # _shapes already builds them in this order
    if cfg.order == "quantize":
        def key(n: str):
            lay = _layer_of(n)
            return (-1 if lay is None else lay, n)
        return sorted(names, key=key)
    # "hf": HF safetensors keys sorted as strings (model.embed_tokens < model.layers.* <
    # model.norm), layers in string order; output (lm_head) last, as single-file exports put it.
    present = set(names)
    head = [n for n in ("rope_freqs.weight", "token_embd.weight") if n in present]
    body = [f"blk.{i}.{k}.{kind}" for i in sorted(range(cfg.n_layers), key=str)
            for k in _HF_LAYER_ORDER for kind in ("bias", "weight")]
    tail = [n for n in ("output_norm.weight", "output.weight") if n in present]
    return head + [n for n in body if n in present] + tail


def tensor_plan(cfg: SynthConfig) -> list[TensorSpec]:
    """Every tensor of the model, in file order, with its type and target std."""
    cfg.validate()
    shapes = _shapes(cfg)
    plan = []
    for name in _ordered_names(cfg, shapes):
        shape = shapes[name]
        qtype = choose_type(cfg, name, shape)
        std = 1.0 / math.sqrt(shape[0]) if len(shape) >= 2 else 0.0
        plan.append(TensorSpec(name, shape, int(qtype), std, _layer_of(name)))
    return plan


def tensor_types(cfg: SynthConfig) -> dict[str, str]:
    """name -> type name for every tensor of ``cfg`` (handy for checking mixes)."""
    return {t.name: t.type_name for t in tensor_plan(cfg)}

