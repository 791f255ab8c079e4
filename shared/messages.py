"""Every message that crosses a process boundary, in one place, with its schema.

All messages are msgpack maps. Layer bytes never travel here: only tokens that name slots.

Internal channels (ipc:// sockets in the instance's run folder):

* **control** — each daemon's DEALER (identity ``<name>``) to the supervisor's ROUTER:
  ``hello`` → (supervisor) ``config`` → ``ready`` | ``fatal``; then ``stats`` every
  ``STATS_INTERVAL_S``; ``shutdown`` from the supervisor. The compute daemon also receives
  ``request`` / ``cancel`` / ``drain`` and sends ``events`` (client replies) on it.
* **host ring** — dma (PAIR, binds) ⇄ reader (PAIR): ``read`` (dma hands a FREE host slot with a
  job), ``filled`` / ``read_error`` (the reader answers).
* **device ring** — compute (PAIR, binds) ⇄ dma (PAIR): ``want`` (compute asks for a pass's
  streamed layers), ``ready`` (a device slot holds a layer), ``free`` (compute ran it),
  ``layer_error`` (the layer could not be delivered).
* **activity** — compute → dma → reader: ``{"active": bool}``, so a stage waiting while nobody has
  work counts as idle, not as starved or blocked.

The client protocol (docs/PROTOCOL.md) is validated here too, so the supervisor can refuse a
bad frame with one error line before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any

import msgpack

STATS_INTERVAL_S = 0.5

# control channel
HELLO, CONFIG, READY, FATAL, STATS, SHUTDOWN = "hello", "config", "ready", "fatal", "stats", "shutdown"
REQUEST, CANCEL, DRAIN, EVENTS = "request", "cancel", "drain", "events"
# host ring
READ, FILLED, READ_ERROR = "read", "filled", "read_error"
# device ring
WANT, SLOT_READY, SLOT_FREE, LAYER_ERROR = "want", "ready", "free", "layer_error"
# both rings: compute has (or no longer has) requests in flight, so waits are stalls, not idling
ACTIVITY = "activity"


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------------------------
# Client protocol: requests


class ProtocolError(ValueError):
    """A client frame that cannot be served; ``code`` and ``str()`` go into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


# field -> (accepted python types, description for the error line)
_GENERATE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "id": ((str,), "a string"),
    "prompt": ((str,), "a string"),
    "messages": ((list,), "a list of {role, content} maps"),
    "tokens": ((list,), "a list of token ids"),
    "max_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "top_p": ((int, float), "a number"),
    "min_p": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"),
    "seed": ((int,), "an integer"),
    "stop": ((list,), "a list of strings"),
    "raw": ((bool,), "true or false"),
    "stream": ((bool,), "true or false"),
    "logprobs": ((int,), "an integer"),
    "prompt_logprobs": ((int,), "an integer"),
}
OPS = ("generate", "cancel", "status")


def decode_client_frame(frame: bytes) -> dict[str, Any]:
    """Parse and check a client frame's shape; raises ProtocolError naming the problem."""
    try:
        msg = unpack(frame)
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError("bad_frame", f"frame is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_frame", f"frame must be a msgpack map, got {type(msg).__name__}")
    op = msg.get("op")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    if op in ("generate", "cancel"):
        rid = msg.get("id")
        if not isinstance(rid, str) or not rid:
            raise ProtocolError("bad_request", "field 'id' must be a non-empty string")
        if len(rid) > 256:
            raise ProtocolError("bad_request", "field 'id' is longer than 256 characters")
    if op == "generate":
        check_generate(msg)
    return msg


def check_generate(msg: dict[str, Any]) -> None:
    """Types and presence of a generate request's fields (values are checked by the engine)."""
    for key, value in msg.items():
        if key == "op":
            continue
        spec = _GENERATE_FIELDS.get(key)
        if spec is None:
            raise ProtocolError("bad_request", f"unknown field {key!r}")
        types, what = spec
        if value is None and key == "seed":
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError("bad_request", f"field {key!r} must be {what}, got {type(value).__name__}")
    sources = [k for k in ("prompt", "messages", "tokens") if k in msg]
    if len(sources) != 1:
        raise ProtocolError("bad_request", "give exactly one of 'prompt', 'messages' or 'tokens'")
    if "prompt" in msg and not msg["prompt"]:
        raise ProtocolError("bad_request", "empty prompt")
    if "tokens" in msg:
        if not msg["tokens"]:
            raise ProtocolError("bad_request", "empty tokens list")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in msg["tokens"]):
            raise ProtocolError("bad_request", "field 'tokens' must hold integers only")
    if "messages" in msg:
        if not msg["messages"]:
            raise ProtocolError("bad_request", "empty messages list")
        for i, m in enumerate(msg["messages"]):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ProtocolError("bad_request", f"messages[{i}] must be a map with string 'role' and 'content'")
    if "stop" in msg and not all(isinstance(s, str) and s for s in msg["stop"]):
        raise ProtocolError("bad_request", "field 'stop' must be a list of non-empty strings")


def error_reply(rid: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "type": "error", "code": code, "message": message}
