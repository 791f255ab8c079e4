"""OpenAI's request and response shapes, mapped to and from ntx's wire protocol.

A request body becomes one ``generate`` map (docs/PROTOCOL.md); the pipeline's ``token`` and
``done`` replies become a response object, or server-sent-event chunks. Only fields a client
gives travel: an absent ``temperature`` gets the pipeline's default, as with llama-server.
Fields that would change the answer and that ntx does not do (``n`` > 1, tools, ``echo``, …)
are refused with OpenAI's error schema rather than silently ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


from ntx.ctl.gateway.limits import RETRY_AFTER_S
from ntx.shared.sampling_fields import MAX_LOGPROBS

# OpenAI name -> ntx wire name; the values are checked by the pipeline (shared/sampling_fields).
SAMPLING_MAP = {
    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    # llama-server's extensions, same meaning
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
}
# Fields that ask for something ntx does not do: refused while they hold anything but these.
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
}


class ApiError(Exception):
    """An error answered in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}  # Retry-After on a refusal for load; Connection: close on 413

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# pipeline error code -> (HTTP status, OpenAI error type, whether trying again later may work).
# 503 with Retry-After: the instance as a whole cannot take the request now (overloaded,
# restarting, stopping, the connection to it lost); a client's own share used up is 429 (the
# gateway's, app.py). 500: the pipeline failed on this request alone, or a frame the gateway
# built was refused (a bug here). Unknown codes are 500 too.
_WIRE_ERRORS_BY_ANSWER = {
    (400, "invalid_request_error", False): ("bad_request", "bad_frame", "context_overflow"),
    (503, "service_unavailable", True): ("overloaded", "shutdown", "pipeline_lost"),
    (503, "server_error", True): ("pipeline_failure", "layer_unavailable", "client_too_slow"),
    (503, "server_error", False): ("model_changed",),
    (500, "server_error", False): ("numerical_error", "internal_error"),
    (504, "server_error", True): ("reply_timeout",),
}
WIRE_ERRORS = {code: answer for answer, codes in _WIRE_ERRORS_BY_ANSWER.items() for code in codes}


def retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def wire_error(ev: dict) -> ApiError:
    """The pipeline's ``error`` reply as an ApiError."""
    code = str(ev.get("code", "error"))
    status, type_, retry = WIRE_ERRORS.get(code, (500, "server_error", False))
    if code == "context_overflow":
        code = "context_length_exceeded"  # OpenAI's code for the same thing
    return ApiError(status, str(ev.get("message", code)), type_, code=code, headers=retry_after() if retry else None)


def _refuse_unsupported(body: dict) -> None:
    for key, allowed in UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            raise ApiError(400, f"{key}={body[key]!r:.60} is not supported by ntx", param=key, code="unsupported")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported by ntx", param="response_format",
                       code="unsupported")


# Integers travel as msgpack's, at most 64 bits; the pipeline checks each field's own range.
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1


def _in_wire_range(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or INT64_MIN <= value <= UINT64_MAX


def _sampling(body: dict) -> dict:
    out: dict[str, Any] = {}
    for key, wire in SAMPLING_MAP.items():
        if body.get(key) is not None:
            if not _in_wire_range(body[key]):
                raise ApiError(400, f"{key} is out of range (an integer of at most 64 bits)", param=key)
            out[wire] = body[key]
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        out["stop"] = stop
    return out


@dataclass
class Parsed:
    """A checked request: what goes on the wire, and how the answer is shaped."""

    wire: dict
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs asked; else how many alternatives per token


def _logprobs_k(n: Any, param: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be an integer from 0 to {MAX_LOGPROBS}", param=param)
    return n


def _common(body: dict, wire: dict, top_logprobs: int | None) -> Parsed:
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object, like {\"include_usage\": true}", param="stream_options")
    if not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "stream_options.include_usage must be true or false", param="stream_options.include_usage")
    wire.update(_sampling(body))
    speculative = body.get("speculative")  # ntx's own field, as on the wire (docs/PROTOCOL.md)
    if speculative is not None:
        if not isinstance(speculative, bool):
            raise ApiError(400, "speculative must be true or false (false: no drafts for this request, one token "
                                "a pass)", param="speculative")
        wire["speculative"] = speculative
    wire["stream"] = True  # the gateway reads tokens as they come either way (time to first token)
    if top_logprobs is not None:
        wire["logprobs"] = max(1, top_logprobs)  # k >= 1 carries the chosen token's own logprob
    return Parsed(wire, stream, bool(opts.get("include_usage", False)), top_logprobs)


def _text_content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (images and audio are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def parse_chat(body: dict) -> Parsed:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", param="messages")
    wire_messages = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
        wire_messages.append({"role": msg["role"], "content": _text_content(msg.get("content"), i)})
    top = None
    if body.get("logprobs"):
        top = _logprobs_k(body.get("top_logprobs") or 0, "top_logprobs")
    return _common(body, {"messages": wire_messages}, top)


def parse_completion(body: dict) -> Parsed:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        wire: dict = {"prompt": prompt, "raw": True}
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(map(_in_wire_range, prompt)):
            raise ApiError(400, "prompt token ids must be integers of at most 64 bits (and in the vocabulary)",
                           param="prompt")
        wire = {"tokens": prompt}
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of one of them", param="prompt")
    top = None if body.get("logprobs") is None else _logprobs_k(body["logprobs"], "logprobs")
    return _common(body, wire, top)


# -- responses ---------------------------------------------------------------------------------

def usage(done: dict) -> dict:
    u = done.get("usage", {})
    p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def finish_reason(done: dict) -> str:
    """OpenAI's reasons are stop and length; a cancelled request (pipeline stopping) reads as
    stop with ``ntx_finish_reason`` saying what happened."""
    r = done.get("finish_reason", "stop")
    return r if r in ("stop", "length") else "stop"


class LogprobsBuilder:
    """Token logprobs in the shape of either endpoint. A token reply with logprobs carries the
    bytes of its token and of each alternative (docs/PROTOCOL.md), so their strings need no
    vocabulary here: the bytes decoded, a partial UTF-8 character as U+FFFD."""

    def __init__(self, top: int) -> None:
        self.top = top

    @staticmethod
    def _text(token_bytes: bytes) -> str:
        return token_bytes.decode("utf-8", errors="replace")

    def _tops(self, ev: dict) -> list[tuple[bytes, float]]:
        return [(b, lp) for b, (_, lp) in zip(ev.get("top_bytes", []), ev.get("logprobs", []))][: self.top]

    def chat_entry(self, ev: dict) -> dict:
        def one(token_bytes: bytes, lp: float) -> dict:
            return {"token": self._text(token_bytes), "logprob": lp, "bytes": list(token_bytes)}

        return {**one(ev["token_bytes"], ev["logprob"]), "top_logprobs": [one(b, lp) for b, lp in self._tops(ev)]}

    def completion_part(self, events: list[dict], text_offset_start: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        offset = text_offset_start
        for ev in events:
            tokens.append(self._text(ev["token_bytes"]))
            lps.append(ev["logprob"])
            tops.append({self._text(b): lp for b, lp in self._tops(ev)})
            offsets.append(offset)
            offset += len(ev.get("text", ""))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def ntx_extra(done: dict) -> dict:
    """What ntx adds to a response (clients ignore unknown keys): its own finish reason and
    timings, what speculation got out of this request's passes when it drafted, and in a cluster
    the replica that answered."""
    extra = {"finish_reason": done.get("finish_reason"), "timings": done.get("timings", {})}
    if "speculation" in done:
        extra["speculation"] = done["speculation"]
    if "replica" in done:
        extra["replica"] = done["replica"]
    return {"ntx": extra}


def chat_response(rid: str, model: str, done: dict, logprobs: list[dict] | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": done.get("text", "")},
              "finish_reason": finish_reason(done), "logprobs": {"content": logprobs} if logprobs is not None else None}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(done), **ntx_extra(done)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None,
               logprobs: list[dict] | None = None, usage_: dict | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish,
              "logprobs": {"content": logprobs} if logprobs is not None else None}
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def completion_response(rid: str, model: str, done: dict, logprobs: dict | None) -> dict:
    choice = {"index": 0, "text": done.get("text", ""), "finish_reason": finish_reason(done), "logprobs": logprobs}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(done), **ntx_extra(done)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     logprobs: dict | None = None, usage_: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
    if usage_ is not None:
        out["usage"] = usage_
    return out
