"""Text <-> token ids for Llama-family GGUF models, built from the vocab inside the GGUF file.

Why this shape:

- Encoding is done by the HF ``tokenizers`` library (Rust, fast), but the model is *constructed
  in code* from the GGUF metadata (``tokenizer.ggml.*``) so nothing is downloaded and the result
  matches what llama.cpp does with the same file:

  * ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The pre-tokenizer is the list of regexes
    llama.cpp uses for ``tokenizer.ggml.pre`` (llama-vocab.cpp, ``llm_tokenizer_bpe``), applied one
    after the other, each splitting the pieces the previous one left ("isolated" split), then the
    GPT-2 byte->unicode map. ``smollm`` is *not* plain GPT-2: llama.cpp first isolates every
    single digit (``\\p{N}``) and then applies the GPT-2 regex.
  * ``tokenizer.ggml.model == "llama"``: SentencePiece (Llama 1/2). llama.cpp's SPM tokenizer
    repeatedly merges the adjacent pair whose concatenation is the highest-*score* vocab piece,
    then falls back to ``<0xNN>`` byte tokens for anything not in the vocab. That is exactly a
    BPE whose merge ranks are the vocab scores (best score = rank 0), with ``byte_fallback``; we
    derive the merges from the scores at load time.

- Decoding does *not* go through the HF decoder: every id has a precomputed byte string (the
  inverse byte-level map for BPE, ``▁`` -> space and ``<0xNN>`` -> one byte for SPM), and text is
  the UTF-8 decode of the concatenation. That makes streaming decode (``IncrementalDecoder``)
  exact: it holds back an incomplete multi-byte character instead of emitting U+FFFD.

- Special tokens: control tokens (token_type 3) are matched as whole tokens only when
  ``parse_special=True``; user-defined tokens (type 4) are always matched, as in llama.cpp.

Differences from llama.cpp, on purpose: ``encode`` never adds a second BOS when the text already
starts with the BOS token (llama.cpp adds it and warns); decode never "cleans up" spaces, so
``decode(encode(s)) == s`` for BPE vocabs.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

from ntx.shared.bytelevel import bytes_to_unicode
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import TOKENIZER_ID_KEYS, metadata_problem
from ntx.shared.vocab import TokenType, end_of_generation_ids, special_token_id

__all__ = ["Tokenizer", "IncrementalDecoder", "TokenType", "PRE_TOKENIZER_REGEXES"]


# --- pre-tokenizer regexes (from llama.cpp llama-vocab.cpp, llm_tokenizer_bpe) -----------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

#: ``tokenizer.ggml.pre`` name -> regexes applied in order (llama.cpp's table, the common subset).
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": _DEFAULT,
    # Llama 3 family
    **{n: [_LLAMA3] for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    # GPT-2 family (llama.cpp spells it "gpt-2"; "gpt2" accepted too)
    **{n: [_GPT2] for n in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais")},
    # digits one by one, then GPT-2
    **{n: [r"\p{N}", _GPT2] for n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{n: [_QWEN2] for n in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez")},
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
}

# pre names for which llama.cpp sets ignore_merges (a word that is itself a token is used whole)
# and add_bos by default.
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})
_ADD_BOS_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})

_SPM_SPACE = "\u2581"  # ▁




_UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}


_BYTE_LEVEL_TABLE = {ord(c): b for c, b in _UNICODE_TO_BYTE.items()}


def _byte_level_bytes(text: str) -> bytes:
    """Inverse of the byte-level map; a char outside the map (rare) is kept as its UTF-8."""
    if all(ch in _UNICODE_TO_BYTE for ch in text):
        return text.translate(_BYTE_LEVEL_TABLE).encode("latin-1")
    out = bytearray()
    for ch in text:
        b = _UNICODE_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _spm_bytes(text: str, ttype: int) -> bytes:
    if ttype == TokenType.BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace(_SPM_SPACE, " ").encode("utf-8")


def _spm_merges(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's score-driven SPM merging.

    For every normal piece, each split into two pieces that are both in the vocab is a merge;
    merges are ranked by the merged piece's score (highest first), ties by the piece's id.
    """
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    ranked: list[tuple[float, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] not in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.USER_DEFINED) or len(piece) < 2:
            continue
        if ids.get(piece) != i:
            continue
        score = float(scores[i])
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _field(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    return metadata.get(key, default)


class Tokenizer:
    """Encoder/decoder for one GGUF vocab. Build with ``Tokenizer.from_metadata(metadata)``.

    Attributes: ``model`` ("gpt2" | "llama"), ``pre`` (pre-tokenizer name or None), ``bos_id``,
    ``eos_id``, ``eot_id``, ``pad_id``, ``unk_id`` (int or None), ``add_bos`` (file's flag),
    ``stop_ids`` (all end-of-generation ids), ``vocab_size``.
    """

    def __init__(
        self,
        *,
        hf: _HFTokenizer,
        model: str,
        pre: str | None,
        tokens: list[str],
        token_types: list[int],
        add_bos: bool,
        add_space_prefix: bool,
        special_ids: dict[str, int | None],
        stop_ids: frozenset[int],
    ) -> None:
        self._hf = hf
        self._lock = threading.Lock()  # guards the encode_special_tokens toggle
        self.model = model
        self.pre = pre
        self._tokens = tokens
        self._types = token_types
        # bytes per id, computed on first use (a 128k vocab would cost ~0.3 s up front)
        self._bytes: list[bytes | None] = [None] * len(tokens)
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        self.eot_id = special_ids.get("eot")
        self.pad_id = special_ids.get("pad")
        self.unk_id = special_ids.get("unk")
        self.stop_ids = stop_ids
        # ids decode skips when skip_special=True: control, unknown, unused
        self._special = frozenset(
            i for i, t in enumerate(token_types) if t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED)
        )

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> value, as ``gguf_index`` reads it or as plain Python
        lists). Raises NtxError on a vocab we cannot use (unsupported model, unknown
        pre-tokenizer, missing fields, a field of the wrong type)."""
        problem = metadata_problem(metadata)
        if problem:
            raise NtxError(f"the model's tokenizer cannot be used: {problem}")
        model = _field(metadata, "tokenizer.ggml.model")
        tokens = _field(metadata, "tokenizer.ggml.tokens")
        if not model or not tokens:
            raise NtxError("the model file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        tokens = list(tokens)
        n_vocab = len(tokens)
        types = _field(metadata, "tokenizer.ggml.token_type")
        types = list(types) if types is not None else [TokenType.NORMAL] * n_vocab

        special_ids = {k: special_token_id(metadata, k) for k in TOKENIZER_ID_KEYS}
        special_ids["unk"] = special_ids.pop("unknown")

        if model == "gpt2":
            pre = _field(metadata, "tokenizer.ggml.pre", "default") or "default"
            hf = _build_bpe(metadata, tokens, types, pre)
            add_bos_default = pre in _ADD_BOS_PRE
            add_space_prefix = False
        elif model == "llama":
            pre = None
            add_space_prefix = _field(metadata, "tokenizer.ggml.add_space_prefix", True)
            hf = _build_spm(metadata, tokens, types, special_ids["unk"], add_space_prefix)
            add_bos_default = True
        else:
            raise NtxError(f"unsupported tokenizer model {model!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")

        add_bos = _field(metadata, "tokenizer.ggml.add_bos_token", add_bos_default)
        if add_bos and special_ids["bos"] is None:
            add_bos = False

        return cls(
            hf=hf, model=model, pre=pre, tokens=tokens, token_types=types,
            add_bos=add_bos, add_space_prefix=add_space_prefix, special_ids=special_ids,
            stop_ids=end_of_generation_ids(metadata),
        )

    # --- encode / decode -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids for ``text``. ``add_bos=None`` follows the file's ``add_bos_token`` flag; a
        BOS is not added when the text already starts with the BOS token (parsed as special)."""
        if not isinstance(text, str):
            raise NtxError(f"text to tokenize must be a string, not {type(text).__name__}")
        if parse_special:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        else:
            with self._lock:
                self._hf.encode_special_tokens = True
                try:
                    ids = self._hf.encode(text, add_special_tokens=False).ids
                finally:
                    self._hf.encode_special_tokens = False
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids = [self.bos_id, *ids]
        return list(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (may be part of a multi-byte UTF-8 character)."""
        b = self._bytes[self._check_id(token_id)]
        if b is None:
            b = self._bytes[token_id] = self._piece_bytes(token_id)
        return b

    def _piece_bytes(self, token_id: int) -> bytes:
        text, ttype = self._tokens[token_id], self._types[token_id]
        if self.model == "llama":
            return _spm_bytes(text, ttype)
        if ttype in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.BYTE):
            return _byte_level_bytes(text)
        return text.encode("utf-8")  # control / user-defined tokens are stored as plain text

    def token_text(self, token_id: int) -> str:
        """A token as readable text (its bytes decoded, U+FFFD for a partial character); for the
        raw vocab string (e.g. ``Ġthe``, ``▁the``) use ``vocab_piece``."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def vocab_piece(self, token_id: int) -> str:
        return self._tokens[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """Control / unknown / unused token (what ``skip_special`` drops)."""
        return token_id in self._special

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        parts: list[bytes] = []
        for i in ids:
            i = self._check_id(int(i))
            if skip_special and i in self._special:
                continue
            parts.append(self.token_bytes(i))
        if self.model == "llama" and self.add_space_prefix and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]  # the space prefix encode added (llama.cpp strips it too)
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise NtxError(f"token id {token_id} is outside the vocab (0..{len(self._tokens) - 1})")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, add_bos={self.add_bos})"


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control tokens are 'special' (parsed only with parse_special); user-defined always."""
    out = []
    for t, ty in zip(tokens, types):
        if ty == TokenType.CONTROL and t:
            out.append(AddedToken(t, special=True, normalized=False))
        elif ty == TokenType.USER_DEFINED and t:
            out.append(AddedToken(t, special=False, normalized=False))
    return out


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # duplicates: the first id wins
    return vocab


def _build_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int], pre: str) -> _HFTokenizer:
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise NtxError(
            f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(PRE_TOKENIZER_REGEXES))}"
        )
    raw_merges = _field(metadata, "tokenizer.ggml.merges")
    if not raw_merges:
        raise NtxError("byte-level BPE vocab without tokenizer.ggml.merges")
    merges = []
    for m in raw_merges:
        left, sep, right = m.partition(" ")
        if sep:
            merges.append((left, right))
    vocab = _vocab_dict(tokens)
    try:
        bpe = BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    except Exception as exc:  # tokenizers raises a bare Exception on a bad merge list
        raise NtxError(f"cannot build the BPE tokenizer from the file's vocab: {exc}") from exc
    hf = _HFTokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.add_special_tokens(_added_tokens(tokens, types))
    return hf


def _build_spm(
    metadata: dict[str, Any], tokens: list[str], types: list[int], unk_id: int | None, add_space_prefix: bool
) -> _HFTokenizer:
    scores = _field(metadata, "tokenizer.ggml.scores")
    if scores is None:  # (its length, when present, was checked with the other fields' types)
        raise NtxError("SentencePiece vocab without a score for every token (tokenizer.ggml.scores)")
    vocab = _vocab_dict(tokens)
    merges = _spm_merges(tokens, types, scores)
    unk = tokens[unk_id] if unk_id is not None else None
    try:
        bpe = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as exc:
        raise NtxError(f"cannot build the SentencePiece tokenizer from the file's vocab: {exc}") from exc
    hf = _HFTokenizer(bpe)
    steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    steps.append(normalizers.Replace(" ", _SPM_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.add_special_tokens(_added_tokens(tokens, types))
    return hf


class IncrementalDecoder:
    """Streams text from token ids one at a time without ever splitting a UTF-8 character.

    ``push`` returns the newly completed text (possibly ""), holding back the bytes of a
    character that is not complete yet; ``flush`` returns what is left (an incomplete tail
    becomes U+FFFD). No space is stripped: a generated ``▁Paris`` after a prompt is `` Paris``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
