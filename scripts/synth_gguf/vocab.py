"""Tokenizer metadata for a synthetic model: a small byte-level BPE vocabulary of any size, or
the ``tokenizer.*`` pairs of a real model copied verbatim."""

from __future__ import annotations

import os

from gguf import GGUFValueType as VT

from ntx.shared.bytelevel import bytes_to_unicode
from ntx.shared.errors import ConfigError, ModelError
from ntx.shared.gguf_index import read_header

from .gguf_file import encode_kv

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def minimal_tokenizer_kvs(vocab_size: int) -> list[bytes]:
    """A small but usable byte-level BPE tokenizer (``gpt2`` model) of exactly ``vocab_size``
    tokens: the 256 byte tokens, merges of common letter pairs, Llama-3-style specials, then
    ``<|reserved_special_token_N|>`` padding."""
    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ConfigError(f"vocab_size {vocab_size} is too small for the built-in byte-level "
                          f"tokenizer (needs >= {n_min}); use a larger vocab or --tokenizer-from")
    bu = bytes_to_unicode()
    tokens = [bu[b] for b in range(256)]
    types = [1] * 256  # NORMAL (llama.cpp's gpt2 vocab marks byte tokens normal)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    space = bu[ord(" ")]
    pairs = [(space, c) for c in letters] + [(a, b) for a in letters for b in letters]
    room = vocab_size - n_min
    merges = []
    for a, b in pairs[:room]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    specials_at = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    types.extend([3] * len(SPECIAL_TOKENS))  # CONTROL
    i = 0
    while len(tokens) < vocab_size:
        tokens.append(f"<|reserved_special_token_{i}|>")
        types.append(3)
        i += 1
    sid = {t: specials_at + j for j, t in enumerate(SPECIAL_TOKENS)}
    return [
        encode_kv("tokenizer.ggml.model", VT.STRING, "gpt2"),
        encode_kv("tokenizer.ggml.pre", VT.STRING, "default"),
        encode_kv("tokenizer.ggml.tokens", VT.ARRAY, tokens, VT.STRING),
        encode_kv("tokenizer.ggml.token_type", VT.ARRAY, types, VT.INT32),
        encode_kv("tokenizer.ggml.merges", VT.ARRAY, merges, VT.STRING),
        encode_kv("tokenizer.ggml.bos_token_id", VT.UINT32, sid["<|begin_of_text|>"]),
        encode_kv("tokenizer.ggml.eos_token_id", VT.UINT32, sid["<|eot_id|>"]),
        encode_kv("tokenizer.ggml.eot_token_id", VT.UINT32, sid["<|eot_id|>"]),
        encode_kv("tokenizer.ggml.padding_token_id", VT.UINT32, sid["<|end_of_text|>"]),
        encode_kv("tokenizer.ggml.add_bos_token", VT.BOOL, True),
        encode_kv("tokenizer.ggml.add_space_prefix", VT.BOOL, False),
        encode_kv("tokenizer.chat_template", VT.STRING, CHAT_TEMPLATE),
    ]


def tokenizer_kvs_from(path: str | os.PathLike) -> tuple[list[bytes], int]:
    """All ``tokenizer.*`` pairs of an existing GGUF (raw), and its vocabulary size."""
    header = read_header(path)
    toks = header.kv("tokenizer.ggml.tokens")
    if toks is None:
        raise ModelError(path, "has no tokenizer.ggml.tokens; cannot copy its tokenizer")
    return [kv.raw for kv in header.kvs if kv.key.startswith("tokenizer.")], len(toks.value)
