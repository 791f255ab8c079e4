"""Tokenizer and chat template tests: the real SmolLM2 vocab plus small synthetic vocabs."""

from __future__ import annotations

import time

import pytest

from ntx.ctl.chat import ChatTemplate
from ntx.ctl.tokenizer import IncrementalDecoder, Tokenizer, TokenType
from ntx.shared.bytelevel import bytes_to_unicode
from ntx.shared.errors import NtxError


def _read_metadata(path) -> dict:
    """GGUF metadata as plain Python values (the shared index if present, else gguf-py)."""
    try:
        from ntx.shared.gguf_index import open_model
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(str(path))
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return dict(open_model(path).metadata)


@pytest.fixture(scope="module")
def smol_md(smollm2_path) -> dict:
    return _read_metadata(smollm2_path)


@pytest.fixture(scope="module")
def smol(smol_md) -> Tokenizer:
    return Tokenizer.from_metadata(smol_md)


# --- SmolLM2 (byte-level BPE, pre "smollm") -------------------------------------------------------

# Expected ids computed by the HF tokenizer of SmolLM2-135M-Instruct / llama.cpp.
SMOL_CASES = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Hello, we can use": [19556, 28, 392, 416, 722],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],  # digits one by one
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
    "\n": [198],
}


def test_smollm2_known_ids(smol):
    assert smol.model == "gpt2" and smol.pre == "smollm"
    assert smol.add_bos is False
    for text, ids in SMOL_CASES.items():
        assert smol.encode(text) == ids, text


def test_smollm2_build_is_fast(smol_md):
    t0 = time.perf_counter()
    Tokenizer.from_metadata(smol_md)
    assert time.perf_counter() - t0 < 2.0


def test_smollm2_bos_and_specials(smol):
    assert smol.vocab_size == 49152
    assert smol.eos_id == 2 and smol.vocab_piece(2) == "<|im_end|>"
    assert 2 in smol.stop_ids and 0 in smol.stop_ids  # <|im_end|>, <|endoftext|>
    # add_bos=True adds the file's BOS id once
    assert smol.encode("hi", add_bos=True)[0] == smol.bos_id
    assert smol.encode("hi", add_bos=True)[1:] == smol.encode("hi")


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "Ünïcödé: naïve café, straße, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
        "emoji: 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 ✨",
        "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n",
        "   leading and trailing   \n\n\t\t  \r\n mixed\u00a0nbsp  ",
        "numbers 1234567890 3.14159 -42 1e-9",
        "",
    ],
)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_special_tokens_single_ids(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2] == 2
    assert smol.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert smol.decode(ids, skip_special=True) == "user\nhi\n"
    # parse_special=False: the same text is plain characters, never the control ids
    plain = smol.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain and len(plain) > 2
    assert smol.decode(plain) == "<|im_start|>user"
    # the toggle does not leak into the next call
    assert smol.encode("<|im_start|>")[0] == 1


@pytest.mark.parametrize("text", ["日本語のテキスト", "😀👍🏽🇫🇷 ok", "naïve 👨‍👩‍👧‍👦 ✨ 한국어"])
def test_smollm2_incremental_decode_never_breaks_chars(smol, text):
    ids = smol.encode(text)
    # at least one token must be a partial character for this test to mean something
    assert any("\ufffd" in smol.token_text(i) for i in ids)
    dec = IncrementalDecoder(smol)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_incremental_decode_flush_reports_dangling_bytes(smol):
    ids = smol.encode("😀")
    dec = IncrementalDecoder(smol)
    out = "".join(dec.push(i) for i in ids[:-1])
    assert out == ""  # nothing complete yet
    assert dec.flush() == "\ufffd"


# --- errors --------------------------------------------------------------------------------------


def _byte_level_md(pre: str, extra_tokens=(), merges=()) -> dict:
    """A tiny byte-level BPE vocab: the 256 byte chars, merged tokens, and two control tokens."""
    byte_chars = list(bytes_to_unicode().values())
    tokens = ["<|begin_of_text|>", "<|eot_id|>", *byte_chars, *extra_tokens]
    types = [TokenType.CONTROL, TokenType.CONTROL] + [TokenType.NORMAL] * (len(tokens) - 2)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }


def test_unknown_pre_tokenizer_is_one_line_error():
    with pytest.raises(NtxError) as err:
        Tokenizer.from_metadata(_byte_level_md("no-such-pre", merges=["a b"], extra_tokens=["ab"]))
    msg = str(err.value)
    assert "no-such-pre" in msg and "\n" not in msg


def test_unsupported_model_and_missing_vocab():
    with pytest.raises(NtxError, match="bert"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(NtxError, match="no tokenizer"):
        Tokenizer.from_metadata({})


# --- Llama 3 regex on a synthetic byte-level vocab ----------------------------------------------


def _llama3_tok() -> Tokenizer:
    # With these merges, unsplit "12345" would become 12|34|5; the regex's 1-3 digit groups
    # give 123|45 instead. Contractions: "'m", "'t" are their own pre-tokens.
    merges = ["1 2", "3 4", "12 3", "4 5", "' m", "' t", "' s", "d o", "do n", "I 'm", "Ġ d", "Ġd o"]
    extra = ["12", "34", "123", "45", "'m", "'t", "'s", "do", "don", "I'm", "Ġd", "Ġdo"]
    return Tokenizer.from_metadata(_byte_level_md("llama-bpe", extra, merges))


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.token_text(i) for i in tok.encode(text, add_bos=False)]


def test_llama3_regex_digit_groups_and_contractions():
    tok = _llama3_tok()
    assert tok.add_bos is True  # llama-bpe defaults to BOS, like llama.cpp
    assert _pieces(tok, "12345") == ["123", "45"]
    assert _pieces(tok, "1234567") == ["123", "45", "6", "7"]  # groups 123|456|7
    # "I'm" would merge whole without the regex; with it: "I" + "'m"
    assert _pieces(tok, "I'm") == ["I", "'m"]
    assert _pieces(tok, "don't") == ["don", "'t"]
    assert _pieces(tok, " do") == [" do"]
    assert tok.encode("12345")[0] == tok.bos_id
    assert tok.encode("<|begin_of_text|>12345") == tok.encode("12345")  # no double BOS
    assert tok.stop_ids == {1}


def test_gpt2_regex_keeps_digit_runs():
    merges = ["1 2", "3 4", "12 3", "4 5", "12 34"]
    tok = Tokenizer.from_metadata(_byte_level_md("gpt2", ["12", "34", "123", "45", "1234"], merges))
    assert _pieces(tok, "12345") == ["1234", "5"]  # gpt2 regex: one digit run, plain BPE


# --- SentencePiece (Llama 1/2 style) on a synthetic vocab ---------------------------------------

SPM_WORDS = {
    # piece: score (higher merges first)
    "▁": -1.0, "▁h": -2.0, "▁he": -3.0, "▁hel": -4.0, "▁hell": -5.0, "▁hello": -6.0,
    "▁w": -7.0, "▁wo": -8.0, "▁wor": -9.0, "▁worl": -10.0, "▁world": -11.0,
    "l": -20.0, "o": -20.5, "r": -21.0, "d": -21.5, "h": -22.0, "e": -22.5, "w": -23.0,
    "ll": -12.0, "lo": -13.0, "or": -14.0, "ld": -15.0, "el": -16.0, "he": -17.0, "wo": -18.0,
    "é": -24.0,
}


def _spm_md(add_space_prefix: bool | None = None) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_WORDS)
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(SPM_WORDS)
    scores = [0.0] * 259 + list(SPM_WORDS.values())
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if add_space_prefix is not None:
        md["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return md


def _llama_cpp_spm_reference(md: dict, text: str, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM algorithm, slowly: merge the adjacent pair whose concatenation is the
    best-scoring vocab piece (leftmost on ties) until none; unknown pieces -> byte tokens."""
    tokens, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    text = (" " + text if add_space_prefix else text).replace(" ", "▁")
    syms = list(text)
    while True:
        best = None
        for j in range(len(syms) - 1):
            cat = syms[j] + syms[j + 1]
            if cat in ids and (best is None or scores[ids[cat]] > best[0]):
                best = (scores[ids[cat]], j)
        if best is None:
            break
        j = best[1]
        syms[j : j + 2] = [syms[j] + syms[j + 1]]
    out = []
    for s in syms:
        if s in ids:
            out.append(ids[s])
        else:
            out += [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def test_spm_words_and_bos():
    md = _spm_md()
    tok = Tokenizer.from_metadata(md)
    assert tok.model == "llama" and tok.add_bos is True and tok.bos_id == 1
    ids = tok.encode("hello world")
    assert ids[0] == 1
    assert [tok.vocab_piece(i) for i in ids[1:]] == ["▁hello", "▁world"]
    assert tok.decode(ids, skip_special=True) == "hello world"
    assert tok.decode(ids) == "<s> hello world"  # like llama.cpp: only the first piece is stripped


def test_spm_byte_fallback():
    tok = Tokenizer.from_metadata(_spm_md())
    text = "hello ☃ wörld\n"
    ids = tok.encode(text, add_bos=False)
    pieces = [tok.vocab_piece(i) for i in ids]
    assert ["<0xE2>", "<0x98>", "<0x83>"] == pieces[2:5]  # ☃ is not in the vocab
    assert "<0xC3>" in pieces and "<0x0A>" in pieces  # ö, newline
    assert tok.decode(ids) == text
    # streaming the bytes of ☃ never shows a broken char
    dec = IncrementalDecoder(tok)
    out = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in out)
    assert "".join(out) == " " + text  # no prefix stripping when streaming


@pytest.mark.parametrize("text", ["hello world", "hellohello wor ld", "lol held old he", "wéllo", "  hello  "])
def test_spm_matches_llama_cpp_algorithm(text):
    md = _spm_md()
    tok = Tokenizer.from_metadata(md)
    assert tok.encode(text, add_bos=False) == _llama_cpp_spm_reference(md, text)
    assert tok.decode(tok.encode(text)[1:]) == text


def test_spm_add_space_prefix_false_and_specials():
    md = _spm_md(add_space_prefix=False)
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("hello", add_bos=False) == _llama_cpp_spm_reference(md, "hello", add_space_prefix=False)
    assert tok.vocab_piece(tok.encode("hello", add_bos=False)[0]) != "▁hello"
    tok2 = Tokenizer.from_metadata(_spm_md())
    ids = tok2.encode("hello</s>world", add_bos=False)
    # the space prefix is added again after a special token, as in llama.cpp
    assert [tok2.vocab_piece(i) for i in ids] == ["▁hello", "</s>", "▁world"]
    assert 2 in tok2.stop_ids


# --- chat templates ------------------------------------------------------------------------------


def test_smollm2_chat_template(smol_md, smol):
    tmpl = ChatTemplate.from_metadata(smol_md, smol)
    assert not tmpl.is_fallback
    text = tmpl.render([{"role": "user", "content": "What is 2+2?"}])
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system prompt
    assert text.endswith("<|im_start|>assistant\n")
    ids = smol.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2  # every marker is one id
    no_gen = tmpl.render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not no_gen.endswith("assistant\n")


def test_chatml_fallback():
    tmpl = ChatTemplate(None, "", "")
    assert tmpl.is_fallback
    assert tmpl.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_is_one_line_ntx_error():
    src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start\nwith user') }}{% endif %}ok"
    tmpl = ChatTemplate(src, "<s>", "</s>")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(NtxError) as err:
        tmpl.render([{"role": "assistant", "content": "x"}])
    assert "Conversation must start with user" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__subclasses__() }}",
        "{% set x = messages.append(1) %}",  # immutable sandbox
    ],
)
def test_sandbox_blocks_unsafe_access(src):
    tmpl = ChatTemplate(src, "", "")
    with pytest.raises(NtxError) as err:
        tmpl.render([{"role": "user", "content": "x"}])
    assert "\n" not in str(err.value)


def test_template_extras_and_errors():
    src = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}|{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    out = ChatTemplate(src, "<s>", "</s>").render([{"role": "user", "content": "<é>"}])
    assert out == '<s>{"role": "user", "content": "<é>"}|4|01'
    with pytest.raises(NtxError, match="does not parse"):
        ChatTemplate("{% for %}", "", "")
    with pytest.raises(NtxError, match="role"):
        ChatTemplate(None).render([{"content": "no role"}])


def test_a_program_that_ends_before_its_renderer_is_ready_leaves_no_traceback():
    """A template starts the renderer worker, which may be ready only after its program ended (a
    short ntxctl run): it finds nobody to answer and ends quietly (it shares the program's stderr)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from ntx.ctl.chat import ChatTemplate; ChatTemplate(None)"],
                       capture_output=True, text=True, timeout=60)  # (waits for the worker: it holds stderr)
    assert r.returncode == 0 and r.stderr == "", r.stderr
