"""The front's side of a request (ctl/requests.py), in this process with a tiny synthetic model's
real tokenizer: the one check of a generate map, the prompt as token ids (a chat template that
fails in any way is one request error), and the engine's outputs as the client's replies — stop
strings across tokens and outputs, the text held back and flushed, log-probabilities with their
bytes, timings, seed and speculation from the engine's figures."""

from __future__ import annotations

import resource
import time

import pytest
from gguf import GGUFValueType as VT

from ntx.ctl.local import LocalEngine
from ntx.ctl.request_limits import RequestLimits
from ntx.ctl.requests import RequestFront, parse_generate
from ntx.ctl import chat
from ntx.ctl.chat import ChatTemplate
from ntx.daemons.compute.factory import build_engine
from ntx.shared.config import EngineOptions
from ntx.shared.gguf_index import open_model
from ntx.shared.messages import DoneReply, EngineOutput, EngineRequest, RequestError, TokenReply
from ntx.shared.sampling_fields import SamplingParams

try:
    from .gguf_mutate import HOSTILE_CHAT_TEMPLATE as HOSTILE, GGUFParts
    from .synth_models import write_tiny
except ImportError:  # tests/ is not a package
    from gguf_mutate import HOSTILE_CHAT_TEMPLATE as HOSTILE, GGUFParts
    from synth_models import write_tiny

CTX = 64
LIMITS = RequestLimits(max_context=CTX, max_batch=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("front"), type="Q8_0")


@pytest.fixture(scope="module")
def front(tiny) -> RequestFront:
    return RequestFront.for_model(open_model(tiny), LIMITS)


def processor(front: RequestFront, stop=(), stream=True, logprobs=0, seed=7):
    req = EngineRequest("r0", [1, 2, 3], SamplingParams(seed=seed, stop=list(stop)), logprobs=logprobs)
    return front.prepare(req, "client-id", stream)


@pytest.mark.parametrize(
    "fields, code, needle",
    [
        ({"prompt": "hi", "logprobs": 21}, "bad_request", "logprobs and prompt_logprobs must be between 0 and 20"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "bad_request", "logprobs and prompt_logprobs must be between"),
        ({"prompt": "hi", "max_tokens": CTX + 1}, "bad_request", f"max_tokens {CTX + 1} exceeds the context of {CTX}"),
        ({"prompt": "hi", "tokens": [1]}, "bad_request", "give exactly one of 'prompt', 'messages' or 'tokens'"),
        ({"prompt": ""}, "bad_request", "empty prompt"),
        ({"tokens": []}, "bad_request", "empty tokens list"),
        ({"tokens": [1, True]}, "bad_request", "field 'tokens' must hold integers only"),
        ({"messages": []}, "bad_request", "empty messages list"),
        ({"messages": [{"role": "user"}]}, "bad_request", "messages[0] must be a map with string 'role' and 'content'"),
        ({"tokens": [1] * (CTX + 1)}, "context_overflow", f"{CTX + 1} prompt tokens do not fit"),
        ({"prompt": "x" * (32 * CTX + 1)}, "context_overflow", "cannot fit in the context"),
        ({"prompt": "hi", "raw": 1}, "bad_request", "field 'raw' must be true or false, got int"),
    ],
)
def test_the_one_check_refuses_with_one_line(fields, code, needle):
    with pytest.raises(RequestError) as err:
        parse_generate({"op": "generate", "id": "q", **fields}, LIMITS)
    assert err.value.code == code and needle in str(err.value) and "\n" not in str(err.value)


def test_a_checked_request_keeps_what_the_client_asked():
    req = parse_generate({"op": "generate", "id": "q", "prompt": "hi", "raw": True, "stream": False, "top_k": 3,
                          "stop": ["\n"], "logprobs": 2, "speculative": False}, LIMITS)
    assert (req.client_id, req.prompt, req.raw, req.stream, req.speculative, req.logprobs) == ("q", "hi", True, False,
                                                                                              False, 2)
    assert req.params == SamplingParams(top_k=3, stop=["\n"])


def test_the_prompt_as_token_ids(front):
    tok = front.tokenizer
    raw = front.prompt_tokens(prompt="hello world", raw=True)
    assert tok.decode(raw, skip_special=True) == "hello world"
    chat = front.prompt_tokens(messages=[{"role": "user", "content": "hello"}])
    assert chat.count(tok.bos_id) == 1 and chat[0] == tok.bos_id  # the template writes the BOS, once
    assert front.prompt_tokens(tokens=[5, 6]) == [5, 6]
    for tokens, code, needle in (([5, 512], "bad_request", "token id 512 is outside the vocabulary (0..511)"),
                                 ([5] * CTX, "context_overflow", f"prompt has {CTX} tokens but the context holds {CTX}")):
        with pytest.raises(RequestError) as err:
            front.prompt_tokens(tokens=tokens)
        assert err.value.code == code and needle in str(err.value)
    no_chat = RequestFront(tok, None, front.n_vocab, LIMITS)
    with pytest.raises(RequestError, match="this model has no chat template: send raw=true"):
        no_chat.prompt_tokens(prompt="hello")


def test_a_template_that_fails_in_any_way_is_one_request_error(front):
    """The front renders templates in the supervisor: an overflow, a recursion without end or a
    division by zero in the file's template is the request's ``bad_request``, never an exception."""
    hostile = RequestFront(front.tokenizer, ChatTemplate(HOSTILE), front.n_vocab, LIMITS)
    for content, kind in (("overflow", "OverflowError"), ("recursion", "RecursionError"), ("zero", "ZeroDivisionError")):
        req = hostile.parse({"op": "generate", "id": content, "messages": [{"role": "user", "content": content}]})
        with pytest.raises(RequestError) as err:
            hostile.start("r", req)
        assert err.value.code == "bad_request" and f"chat template failed: {kind}" in str(err.value), err.value
        assert "\n" not in str(err.value)
    engine_req, _ = hostile.start("r", hostile.parse({"op": "generate", "id": "ok", "prompt": "fine"}))
    assert front.tokenizer.decode(engine_req.prompt_tokens, skip_special=True) == "user: fine\n"


def test_a_template_that_loops_eats_memory_or_writes_without_end_is_one_bounded_error(front):
    """Before: nested loops held the supervisor, ``'x' * 10**5 * 10**5`` took it to gigabytes or
    a MemoryError wherever it struck. Now the worker renders under a time, memory and output
    bound: each is the request's ``bad_request`` within the time limit (and a new worker's
    start), this process does not grow, and the next chat request renders."""
    hostile = RequestFront(front.tokenizer, ChatTemplate(HOSTILE), front.n_vocab, LIMITS)
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for content, needle in (("loop", f"did not finish within {chat.RENDER_TIME_LIMIT_S:g} s"),
                            ("memory", "MemoryError"), ("center", "MemoryError"), ("output", "wrote more than")):
        req = hostile.parse({"op": "generate", "id": content, "messages": [{"role": "user", "content": content}]})
        t0 = time.monotonic()
        with pytest.raises(RequestError) as err:
            hostile.start("r", req)
        assert err.value.code == "bad_request" and needle in str(err.value), err.value
        assert time.monotonic() - t0 < chat.RENDER_TIME_LIMIT_S + 5.0
        engine_req, _ = hostile.start("r", hostile.parse({"op": "generate", "id": "ok", "prompt": "fine"}))
        assert front.tokenizer.decode(engine_req.prompt_tokens, skip_special=True) == "user: fine\n"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kib < 64 << 10


def test_the_engine_gets_token_ids_a_fixed_seed_and_no_stop_strings(front):
    engine_req, out = front.start("r9", front.parse({"op": "generate", "id": "c", "prompt": "hi", "raw": True,
                                                     "stop": ["x"], "seed": None}))
    assert engine_req.id == "r9" and engine_req.params.stop == [] and engine_req.params.seed is not None
    assert out.client_id == "c" and out.stopper.stop == ["x"] and out.req.params.seed == engine_req.params.seed


def test_a_stop_string_across_tokens_ends_at_once_and_drops_the_rest(front):
    tok = front.tokenizer
    ids = tok.encode("one two. three four", add_bos=False)
    engine_req, out = processor(front, stop=["o. t"])
    first = out.process(EngineOutput("r0", ids[:2]))
    rest = out.process(EngineOutput("r0", ids[2:], decode_s=0.5, drafted=4, accepted=3))
    replies = first + rest
    done = replies[-1]
    assert isinstance(done, DoneReply) and done.finish_reason == "stop" and out.finished and out.needs_cancel
    assert done.text == "one tw" and done.tail is None  # the text before the stop string, nothing held back
    streamed = [r for r in replies if isinstance(r, TokenReply)]
    assert "".join(r.text for r in streamed) == done.text
    assert done.tokens == [r.token for r in streamed] and ids[len(done.tokens):]  # later tokens were dropped
    assert tok.decode(done.tokens).startswith("one two. t")  # the token that completed the match is counted
    assert done.seed == 7 and done.timings.decode_s == 0.5 and done.to_wire()["speculation"]["accepted"] == 3
    assert all(r.id == "client-id" for r in replies)


def test_the_engines_finish_flushes_what_was_held_back(front):
    tok = front.tokenizer
    ids = tok.encode("ab c", add_bos=False)
    _, out = processor(front, stop=["c!"])  # "c" could start the stop string: held back until the end
    replies = out.process(EngineOutput("r0", ids, finish_reason="length", queued_s=0.25, prefill_s=0.5,
                                       decode_s=1.0))
    done = replies[-1]
    assert done.finish_reason == "length" and not out.needs_cancel
    assert done.text == "ab c" and done.tail == "c" and "".join(r.text for r in replies[:-1]) == "ab "
    wire = done.to_wire()
    assert wire["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids)}
    assert wire["timings"] == {"queued_s": 0.25, "prefill_s": 0.5, "decode_s": 1.0,
                               "decode_tokens_per_s": round((len(ids) - 1) / 1.0, 3)}
    _, quiet = processor(front, stop=["c!"], stream=False)
    (done,) = quiet.process(EngineOutput("r0", ids, finish_reason="stop"))
    assert done.text == "ab c" and "tail" not in done.to_wire()


def test_token_replies_carry_the_bytes_of_their_log_probabilities(front):
    tok = front.tokenizer
    a, b = tok.encode("ab", add_bos=False)[:1] + tok.encode(" c", add_bos=False)[:1]
    _, out = processor(front, logprobs=2)
    (reply,) = out.process(EngineOutput("r0", [a], logprobs=[[[a, -0.1], [b, -2.5]]], token_logprobs=[-0.1]))
    wire = reply.to_wire()
    assert wire["logprobs"] == [[a, -0.1], [b, -2.5]] and wire["logprob"] == -0.1
    assert wire["token_bytes"] == tok.token_bytes(a) and wire["top_bytes"] == [tok.token_bytes(a), tok.token_bytes(b)]
    (plain,) = processor(front)[1].process(EngineOutput("r0", [a]))
    assert set(plain.to_wire()) == {"id", "type", "token", "text"}  # without logprobs, as before


def test_a_request_cancelled_before_the_engine_had_it(front):
    _, out = processor(front)
    done = out.cancelled().to_wire()
    assert done["finish_reason"] == "cancelled" and done["tokens"] == [] and done["text"] == ""
    assert done["prompt_tokens"] == [1, 2, 3] and done["seed"] == 7


def test_local_engine_takes_a_client_map_through_the_same_front(tiny):
    eng = LocalEngine(build_engine(tiny, options=EngineOptions(ctx=CTX, max_batch=2)))
    with pytest.raises(RequestError, match="exceeds the context"):
        eng.generate("a", {"prompt": "hi", "max_tokens": CTX + 1})
    eng.generate("b", {"prompt": "hello", "raw": True, "temperature": 0, "max_tokens": 4, "stream": False})
    replies = []
    while eng.has_work:
        replies += eng.step()
    assert [r["type"] for r in replies] == ["done"] and replies[0]["id"] == "b"
    assert replies[0]["prompt_tokens"] == eng.prompt_tokens(prompt="hello", raw=True)


def test_a_hostile_template_in_the_file_is_refused_per_request(tiny, tmp_path):
    """The file's own template, read once by the front: each failing chat request is refused, and
    the engine goes on serving the next."""
    path = GGUFParts.of(tiny).set_kv("tokenizer.chat_template", VT.STRING, HOSTILE).write(tmp_path / "hostile.gguf")
    eng = LocalEngine(build_engine(path, options=EngineOptions(ctx=CTX, max_batch=2)))
    for content in ("overflow", "recursion", "zero"):
        with pytest.raises(RequestError, match="chat template failed"):
            eng.generate(content, {"messages": [{"role": "user", "content": content}]})
    eng.generate("ok", {"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 2})
    replies = []
    while eng.has_work:
        replies += eng.step()
    assert replies[-1]["type"] == "done" and replies[-1]["id"] == "ok"
