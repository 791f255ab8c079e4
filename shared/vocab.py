"""What the engine needs of a model's vocabulary without its text side: which token ids end a
generation (``end_of_generation_ids``), and the GGUF token types that rule says it by.

The tokenizer (``ctl/tokenizer.py``, held by the supervisor's front) reads the same
metadata for text; the engine core only stops on these ids, so the compute daemon reads them
here, from the metadata alone, and never builds a tokenizer.
"""

from __future__ import annotations

from typing import Any


class TokenType:
    """GGUF ``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# end-of-generation token texts llama.cpp recognises (llama-vocab.cpp, special_eog_ids)
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<|return|>",
    "<|call|>",
)


def special_token_id(metadata: dict[str, Any], key: str) -> int | None:
    """``tokenizer.ggml.<key>_token_id`` when it names a token of the vocabulary, else None."""
    v = metadata.get(f"tokenizer.ggml.{key}_token_id")
    n_vocab = len(metadata.get("tokenizer.ggml.tokens") or ())
    return v if v is not None and 0 <= v < n_vocab else None


def end_of_generation_ids(metadata: dict[str, Any]) -> frozenset[int]:
    """The ids that end a generation, as llama.cpp finds them: the file's EOS, EOT and EOM ids,
    and every control, user-defined or undefined token whose text is one of ``EOG_TEXTS``.
    (Metadata of checked types: ``gguf_index.metadata_problem``.)"""
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    types = metadata.get("tokenizer.ggml.token_type")
    stop = {i for i in (special_token_id(metadata, k) for k in ("eos", "eot", "eom")) if i is not None}
    eog = set(EOG_TEXTS)
    for i, t in enumerate(tokens):
        if t in eog and (types[i] if types is not None else TokenType.NORMAL) in (
                TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNDEFINED):
            stop.add(i)
    return frozenset(stop)
