"""The front's side of every request: one check at the edge, text in, text out.

The engine core works on token ids (``messages.EngineRequest`` in, ``EngineOutput`` out); what a
client reads and writes as text is done here, in the supervisor, with the one tokenizer of the
instance (loaded once from the GGUF), as vLLM's front end does with its input and output
processors:

* **One check** (``RequestFront.parse``): a client's generate map (its frame already bounded and
  its op, id and field names checked, ``messages.decode_client_frame``) becomes a
  ``GenerateRequest``: each field's type and value (the sampling fields by their table,
  ``shared/sampling_fields.py``), exactly one prompt source, and the instance's bounds (prompt
  size before tokenizing, ``max_tokens``; ``ctl/request_limits.py``). One ``RequestError`` per
  request, naming the first bad field.
* **Input** (``RequestFront.start``): the prompt as token ids (the chat template unless ``raw``;
  a template that fails in any way is this request's ``bad_request``, never the supervisor's
  exception), the ids' own rule (``messages.check_prompt_tokens``: not empty, in the vocabulary,
  room in the context), a seed drawn when the client gave none (so whoever ends the request
  reports the same seed): an ``EngineRequest``, and the request's ``OutputProcessor``.
* **Output** (``OutputProcessor``): the engine's outputs of one request as its client's replies:
  incremental detokenizing (never a split UTF-8 character), stop strings (``StopMatcher``: on a
  match the request ends for its client at once and its owner cancels it in the engine; tokens
  the engine made after the match are dropped), log-probabilities with their tokens' bytes, and
  the ``done`` reply with its timings, seed and speculation counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ntx.ctl.request_limits import RequestLimits
from ntx.ctl.chat import ChatTemplate
from ntx.ctl.tokenizer import IncrementalDecoder, Tokenizer
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import ModelIndex
from ntx.shared.messages import (GENERATE_FIELDS, MAX_LOGPROBS, MESSAGE_ENTRY_FIELDS, DoneReply, EngineOutput,
                                 EngineRequest, ErrorReply, Reply, RequestError, SpecCounts, Timings, TokenReply,
                                 check_prompt_tokens)
from ntx.shared.sampling_fields import SAMPLING_BY_NAME, SamplingParams, draw_seed, from_wire

PROMPT_SOURCES = ("prompt", "messages", "tokens")


@dataclass(frozen=True)
class GenerateRequest:
    """A client's generate request once checked: the prompt (exactly one of ``prompt``,
    ``messages``, ``tokens``), the sampling parameters, and how the client wants its replies."""

    client_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    tokens: list[int] | None = None
    raw: bool = False
    stream: bool = True
    speculative: bool = True
    logprobs: int = 0
    prompt_logprobs: int = 0


def parse_generate(msg: dict[str, Any], limits: RequestLimits) -> GenerateRequest:
    """The one check of a generate map (docs/PROTOCOL.md, generate and Limits); raises
    RequestError with the code and line the client gets."""
    for key, value in msg.items():
        if key == "op":
            continue
        spec = GENERATE_FIELDS.get(key)
        if spec is None:
            raise RequestError("bad_request", f"unknown field {key!r:.40}")
        types_, what = spec
        sampling = SAMPLING_BY_NAME.get(key)
        if value is None and sampling is not None and sampling.nullable:
            continue
        if not isinstance(value, types_) or (isinstance(value, bool) and bool not in types_):
            raise RequestError("bad_request", f"field {key!r} must be {what}, got {type(value).__name__}")
        reason = sampling.check(value) if sampling is not None else None
        if reason:
            raise RequestError("bad_request", reason)
        if key in ("logprobs", "prompt_logprobs") and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError("bad_request", f"logprobs and prompt_logprobs must be between 0 and {MAX_LOGPROBS}")
    sources = [k for k in PROMPT_SOURCES if k in msg]
    if len(sources) != 1:
        raise RequestError("bad_request", "give exactly one of 'prompt', 'messages' or 'tokens'")
    if "prompt" in msg and not msg["prompt"]:
        raise RequestError("bad_request", "empty prompt")
    if "tokens" in msg:
        if not msg["tokens"]:
            raise RequestError("bad_request", "empty tokens list")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in msg["tokens"]):
            raise RequestError("bad_request", "field 'tokens' must hold integers only")
    if "messages" in msg:
        if not msg["messages"]:
            raise RequestError("bad_request", "empty messages list")
        for i, m in enumerate(msg["messages"]):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("bad_request", f"messages[{i}] must be a map with string 'role' and 'content'")
            extra = set(m) - set(MESSAGE_ENTRY_FIELDS)
            if extra:
                raise RequestError("bad_request", f"messages[{i}] has unknown field(s) "
                                                  f"{', '.join(sorted(repr(k)[:40] for k in extra))}")
    _check_size(msg, limits)
    return GenerateRequest(
        client_id=msg["id"], params=SamplingParams(**from_wire(msg)), prompt=msg.get("prompt"),
        messages=msg.get("messages"), tokens=msg.get("tokens"), raw=msg.get("raw", False),
        stream=msg.get("stream", True), speculative=msg.get("speculative", True),
        logprobs=msg.get("logprobs", 0), prompt_logprobs=msg.get("prompt_logprobs", 0),
    )


def _check_size(msg: dict[str, Any], limits: RequestLimits) -> None:
    """What the instance's context bounds before anything is tokenized: ``max_tokens``, the
    number of token ids or messages, the prompt's bytes (a prompt that cannot fit is refused by
    its size: tokenizing 10 MiB once held the pipeline for 7.8 s)."""
    ctx = limits.max_context
    if msg.get("max_tokens", 0) > ctx:
        raise RequestError("bad_request", f"max_tokens {msg['max_tokens']} exceeds the context of {ctx} tokens")
    if "tokens" in msg and len(msg["tokens"]) > ctx:
        raise RequestError("context_overflow", f"{len(msg['tokens'])} prompt tokens do not fit in the context "
                                               f"of {ctx} tokens")
    if "prompt" in msg:
        n_bytes = len(msg["prompt"].encode("utf-8", "surrogatepass"))
    elif "messages" in msg:
        if len(msg["messages"]) > ctx:
            raise RequestError("context_overflow", f"{len(msg['messages'])} messages do not fit in the context "
                                                   f"of {ctx} tokens")
        n_bytes = sum(len(e["role"].encode("utf-8", "surrogatepass")) + len(e["content"].encode("utf-8", "surrogatepass"))
                      for e in msg["messages"])
    else:
        return
    if n_bytes > limits.max_prompt_bytes:
        raise RequestError("context_overflow", f"a prompt of {n_bytes} bytes cannot fit in the context of {ctx} "
                                               f"tokens (at most {limits.max_prompt_bytes} bytes are tokenized)")


def _chat_template(metadata: dict[str, Any], tokenizer: Tokenizer) -> ChatTemplate | None:
    """The file's chat template with its BOS and EOS texts; None when the file has none (a request
    that needs one is then refused: send raw)."""
    source = metadata.get("tokenizer.chat_template")
    if not source:
        return None
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return ChatTemplate(source, bos, eos)


class RequestFront:
    """Every request's way through the front: ``parse`` (the one check), ``start`` (the engine's
    request and the output processor), with the model's tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate | None, n_vocab: int, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.n_vocab = n_vocab
        self.limits = limits

    @classmethod
    def for_model(cls, index: ModelIndex, limits: RequestLimits) -> RequestFront:
        """The front of ``index``'s model (its tokenizer built once from the file's vocabulary);
        NtxError with one line when the vocabulary cannot be used."""
        tokenizer = Tokenizer.from_metadata(index.metadata)
        return cls(tokenizer, _chat_template(index.metadata, tokenizer), index.hparams.n_vocab, limits)

    def parse(self, msg: dict[str, Any]) -> GenerateRequest:
        return parse_generate(msg, self.limits)

    def prompt_tokens(self, prompt: str | None = None, messages: list[dict] | None = None,
                      tokens: list[int] | None = None, raw: bool = False) -> list[int]:
        """The token ids a prompt stands for (the chat template unless ``raw`` or ``tokens``),
        checked by ``check_prompt_tokens``; RequestError otherwise."""
        if tokens is not None:
            ids = list(tokens)
        elif messages is None and raw:
            ids = self._encode(prompt or "", add_bos=None)
        else:
            if self.chat is None:
                raise RequestError("bad_request", "this model has no chat template: send raw=true")
            try:
                text = self.chat.render(messages if messages is not None else [{"role": "user", "content": prompt or ""}],
                                        add_generation_prompt=True)
            except NtxError as e:  # every failure of a template is one line (chat.py)
                raise RequestError("bad_request", str(e)) from None
            ids = self._encode(text, add_bos=None)
            # A template that writes the BOS text itself must not get a second BOS.
            bos = self.tokenizer.bos_id
            if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
        check_prompt_tokens(ids, self.n_vocab, self.limits.max_context)
        return ids

    def _encode(self, text: str, add_bos: bool | None) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_bos=add_bos)
        except NtxError as e:
            raise RequestError("bad_request", str(e)) from None

    def start(self, rid: str, req: GenerateRequest) -> tuple[EngineRequest, OutputProcessor]:
        """The engine's request for ``req`` (internal id ``rid``) and the processor of its outputs;
        RequestError when its prompt cannot be served."""
        ids = self.prompt_tokens(req.prompt, req.messages, req.tokens, req.raw)
        engine_req = EngineRequest(id=rid, prompt_tokens=ids, params=req.params, logprobs=req.logprobs,
                                   prompt_logprobs=req.prompt_logprobs, speculative=req.speculative)
        return self.prepare(engine_req, req.client_id, req.stream)

    def prepare(self, req: EngineRequest, client_id: str, stream: bool = True) -> tuple[EngineRequest, OutputProcessor]:
        """``req`` as the engine gets it (the seed fixed here, stop strings kept here) and the
        processor that turns its outputs into ``client_id``'s replies."""
        params = req.params
        seed = params.seed if params.seed is not None else draw_seed()
        engine_req = dataclasses.replace(req, params=dataclasses.replace(params, seed=seed, stop=[]))
        return engine_req, OutputProcessor(client_id, engine_req, self.tokenizer, params.stop, stream)


class OutputProcessor:
    """One request's engine outputs as its client's replies (see the module's docstring): token
    replies (when streamed), then one ``done`` or ``error``. ``finished`` is set by the reply that
    ends the request; when a stop string ended it, the engine has not (``needs_cancel``)."""

    def __init__(self, client_id: str, req: EngineRequest, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 stream: bool = True) -> None:
        self.client_id = client_id
        self.req = req
        self.tokenizer = tokenizer
        self.stream = stream
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopMatcher(stop)
        self.tokens: list[int] = []
        self.text_parts: list[str] = []
        self.prompt_logprobs: list | None = [] if req.prompt_logprobs else None
        self.times_s = (0.0, 0.0, 0.0)  # queued, prefill, decode: the engine's, as of its last output
        self.spec = SpecCounts()
        self.finished = False
        self.needs_cancel = False  # ended here (a stop string) while the engine still runs it

    def process(self, out: EngineOutput) -> list[Reply]:
        """The replies one engine output of this request makes."""
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.times_s = (out.queued_s, out.prefill_s, out.decode_s)
        if out.drafted:
            self.spec.add(out.drafted, out.accepted)
        replies: list[Reply] = []
        for i, tok in enumerate(out.tokens):
            self.tokens.append(tok)
            emit, stopped = self.stopper.push(self.decoder.push(tok))
            self.text_parts.append(emit)
            if self.stream:
                replies.append(self._token_reply(tok, emit, out, i))
            if stopped:  # the rest of this output, and whatever the engine makes until it cancels, is dropped
                self.needs_cancel = out.finish_reason is None
                replies.append(self._done("stop", flush=False))
                return replies
        if out.finish_reason is not None:
            replies.append(self._done(out.finish_reason))
        return replies

    def _token_reply(self, tok: int, text: str, out: EngineOutput, i: int) -> TokenReply:
        if out.logprobs is None:
            return TokenReply(self.client_id, tok, text)
        top = out.logprobs[i]
        token_bytes = self.tokenizer.token_bytes
        return TokenReply(self.client_id, tok, text, logprobs=top, logprob=out.token_logprobs[i],
                          token_bytes=token_bytes(tok), top_bytes=[token_bytes(t) for t, _ in top])

    def _done(self, reason: str, flush: bool = True) -> DoneReply:
        """The ``done`` reply; ``flush``: the text held back (a partial character, a possible stop
        string) is the end of the text, sent as ``tail`` to a streaming client."""
        tail = self.stopper.push(self.decoder.flush())[0] + self.stopper.flush() if flush else ""
        self.text_parts.append(tail)
        self.finished = True
        return DoneReply(
            self.client_id, reason, "".join(self.text_parts), list(self.tokens), list(self.req.prompt_tokens),
            Timings.of(*self.times_s, len(self.tokens)), self.req.params.seed,
            tail=tail if self.stream and tail else None, prompt_logprobs=self.prompt_logprobs,
            speculation=self.spec if self.spec.passes else None,
        )

    def cancelled(self) -> DoneReply:
        """The ``done`` of a request cancelled before the engine had it."""
        return self._done("cancelled")

    def failed(self, code: str, message: str) -> ErrorReply:
        self.finished = True
        return ErrorReply(self.client_id, code, message)


class StopMatcher:
    """Cuts a text stream at the first stop string, for streaming.

    ``push(text)`` returns ``(emit, stopped)``: the text that is safe to send now. A tail that
    could be the start of a stop string is held back until the next push shows whether it is;
    on a match ``emit`` ends just before the stop string and ``stopped`` is True (later pushes
    return ``("", True)``); ``matched`` then names the stop string. ``flush()`` returns the held
    tail at the end of generation.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.matched: str | None = None
        self._buf = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        if not self.stop:
            return text, False
        buf = self._buf + text
        best = -1
        for s in self.stop:
            pos = buf.find(s)
            if pos != -1 and (best == -1 or pos < best):
                best, self.matched = pos, s
        if best != -1:
            self._stopped = True
            self._buf = ""
            return buf[:best], True
        hold = self._held_tail(buf)
        self._buf = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self._stopped else out
