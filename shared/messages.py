"""Every message that crosses a process boundary, in one place: one typed record per message,
its encoder (``Message.encode``) and the decoder of each channel (``Channel.decode``).

Senders build records, never dict literals; receivers decode a frame on the channel it came in
on, which refuses a malformed internal message (not msgpack, an unknown or misplaced type, a
missing, unknown or wrongly typed field) with one clear ``MessageError`` line. Internally a
frame is a msgpack map: ``{"t": <type>, <field>: <value>, ...}`` with the record's fields by
name. Layer bytes never travel here: only tokens that name slots. docs/ARCHITECTURE.md draws
the sequences; the channels (ipc:// sockets in the instance's run folder):

* **control** — each daemon's DEALER (identity ``<name>-g<gen>``, which says who sends, so no
  message repeats it) to the supervisor's ROUTER: ``Hello`` → (supervisor) ``Config`` →
  ``Ready`` | ``Fatal``; then ``Stats`` every ``STATS_INTERVAL_S``; ``Shutdown`` from the
  supervisor. Compute also receives ``Request`` / ``Cancel`` / ``Drain`` and sends ``Events``
  (client replies) and ``Drained``. ntxctl (identity ``ctl-…``) sends ``CtlStatus`` (answered
  by ``StatusReport``) or ``CtlStop`` (answered by ``Stopped`` once everything is down).
* **host ring** — dma (PAIR, binds) ⇄ reader (PAIR): ``Read`` (dma hands a FREE host slot with
  a job), ``Filled`` / ``ReadError`` (the reader answers).
* **device ring** — compute (PAIR, binds) ⇄ dma (PAIR): ``Want`` (compute asks for a pass's
  streamed layers), ``SlotReady`` (a device slot holds a layer), ``SlotFree`` (compute ran it),
  ``LayerError`` (the layer could not be delivered).
* **activity** — compute → dma → reader: ``Activity``, so a stage waiting while nobody has
  work counts as idle, not as starved or blocked.

The client protocol (docs/PROTOCOL.md) stays plain msgpack maps, unchanged for clients; it is
validated here too (``decode_client_frame``), so the supervisor refuses a bad frame with one
error line before anything reaches the engine. Its sampling fields come from
``ntx.shared.sampling_fields``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Union

import msgpack

from ntx.shared.errors import NtxError
from ntx.shared.sampling_fields import SAMPLING_BY_NAME

STATS_INTERVAL_S = 0.5


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


class MessageError(NtxError):
    """A frame on an internal channel that is not one of the channel's messages (a bug, or a
    stray process on the socket): ``str()`` names the channel and the problem."""


# ---------------------------------------------------------------------------------------------
# Records


def _value_check(hint: Any) -> tuple[Callable[[Any], bool], str]:
    """A check of a decoded msgpack value against a field's type hint, and its description."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return (lambda v: True), "anything"
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported message field type {hint!r}")
        check, what = _value_check(inner[0])
        return (lambda v: v is None or check(v)), f"{what} or nil"
    if hint is bool:
        return (lambda v: isinstance(v, bool)), "true or false"
    if hint is int:
        return (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer"
    if hint is float:
        return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    if hint is str:
        return (lambda v: isinstance(v, str)), "a string"
    if hint is dict or origin is dict:
        return (lambda v: isinstance(v, dict)), "a map"
    if origin is list:
        check, what = _value_check(args[0])
        return (lambda v: isinstance(v, list) and all(check(x) for x in v)), f"a list (items: {what})"
    raise TypeError(f"unsupported message field type {hint!r}")


@dataclass(frozen=True)
class Message:
    """Base of every internal message record: ``T`` is its type tag on the wire."""

    T: ClassVar[str] = ""
    _fields: ClassVar[tuple[tuple[str, Callable[[Any], bool], str, bool], ...]] = ()  # name, check, what, required

    def encode(self) -> bytes:
        return pack({"t": self.T, **{name: getattr(self, name) for name, *_ in self._fields}})


_BY_TAG: dict[str, type[Message]] = {}


def _record(tag: str):
    """Register a message record under its wire tag and precompute its field checks."""

    def register(cls: type[Message]) -> type[Message]:
        cls = dataclass(frozen=True)(cls)
        if tag in _BY_TAG:
            raise TypeError(f"message tag {tag!r} is taken by {_BY_TAG[tag].__name__}")
        hints = typing.get_type_hints(cls)
        cls.T = tag
        cls._fields = tuple(
            (f.name, *_value_check(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
            for f in fields(cls)
        )
        _BY_TAG[tag] = cls
        return cls

    return register


class Channel:
    """One direction of one socket and the messages that may travel on it."""

    def __init__(self, name: str, *kinds: type[Message]) -> None:
        self.name = name
        self.kinds = {k.T: k for k in kinds}

    def decode(self, frame: bytes) -> Message:
        """The record a frame holds; MessageError if it is not one of this channel's messages."""
        try:
            msg = unpack(frame)
        except Exception as e:  # msgpack raises several types for garbage
            raise MessageError(f"{self.name}: frame is not valid msgpack ({type(e).__name__})") from None
        if not isinstance(msg, dict):
            raise MessageError(f"{self.name}: frame must be a msgpack map, got {type(msg).__name__}")
        tag = msg.pop("t", None)
        kind = self.kinds.get(tag)
        if kind is None:
            raise MessageError(f"{self.name}: unexpected message type {tag!r} (expected one of {', '.join(self.kinds)})")
        for name, check, what, required in kind._fields:
            if name not in msg:
                if required:
                    raise MessageError(f"{self.name}: {tag} lacks field {name!r}")
            elif not check(msg[name]):
                raise MessageError(f"{self.name}: {tag} field {name!r} must be {what}, got {msg[name]!r:.80}")
        extra = set(msg) - {name for name, *_ in kind._fields}
        if extra:
            raise MessageError(f"{self.name}: {tag} has unknown field(s) {', '.join(map(repr, sorted(extra)))}")
        return kind(**msg)


# -- control channel: daemon -> supervisor ---------------------------------------------------------


@_record("hello")
class Hello(Message):
    """A daemon is up and asks for its configuration."""


@_record("ready")
class Ready(Message):
    """``setup`` is done; what the next daemon needs from this one (compute: its device slots'
    shared-memory names or CUDA IPC handles; dma: its host slots' names)."""

    device_slots: list[Any] = field(default_factory=list)
    host_slots: list[str] = field(default_factory=list)


@_record("fatal")
class Fatal(Message):
    """The daemon cannot go on; ``message`` is the one line ``ntxctl start`` prints."""

    message: str


@_record("stats")
class Stats(Message):
    """The daemon's StageClock snapshot and counters, every STATS_INTERVAL_S."""

    stats: dict[str, Any]


@_record("events")
class Events(Message):
    """Client replies (docs/PROTOCOL.md ``token``/``done``/``error`` maps) under internal ids."""

    events: list[dict[str, Any]]


@_record("drained")
class Drained(Message):
    """Compute finished (or cancelled at the deadline) every request after a ``Drain``."""


# -- control channel: supervisor -> daemon --------------------------------------------------------


@_record("config")
class Config(Message):
    """The answer to ``Hello``: the instance, the plan, names of segments and sockets of this
    generation, and what the daemons started before this one made."""

    instance: dict[str, Any]
    plan: dict[str, Any]
    shm_names: dict[str, str]
    host_ring: str
    device_ring: str
    device_slots: list[Any] = field(default_factory=list)  # to dma: compute's Ready.device_slots
    host_slots: list[str] = field(default_factory=list)  # to the reader: dma's Ready.host_slots


@_record("shutdown")
class Shutdown(Message):
    """Stop serving and exit (segments are unlinked by their owner)."""


@_record("request")
class Request(Message):
    """A client's checked generate map, under the supervisor's internal request id ``rid``."""

    rid: str
    generate: dict[str, Any]


@_record("cancel")
class Cancel(Message):
    rid: str


@_record("drain")
class Drain(Message):
    """Finish the requests in flight within ``timeout_s``, cancel the rest, answer ``Drained``."""

    timeout_s: float


# -- ntxctl <-> supervisor (same ROUTER, identity ctl-…) ---------------------------------------------


@_record("ctl_status")
class CtlStatus(Message):
    """``ntxctl status``: answered by ``StatusReport``."""


@_record("status_report")
class StatusReport(Message):
    status: dict[str, Any]


@_record("ctl_stop")
class CtlStop(Message):
    """``ntxctl stop``: answered by ``Stopped`` when daemons, segments and sockets are gone."""

    force: bool = False


@_record("stopped")
class Stopped(Message):
    reason: str | None = None


# -- host ring ------------------------------------------------------------------------------------


@_record("read")
class Read(Message):
    """dma -> reader: read ``layer`` (for pass ``pass_id``) into the FREE host slot ``slot``.
    ``backlog`` (storage layers still waiting for a host slot) and ``active`` tell the reader
    what its wait for the next job means (blocked, starved or idle)."""

    slot: int
    layer: int
    pass_id: int
    backlog: int
    active: bool


@_record("filled")
class Filled(Message):
    """reader -> dma: host slot ``slot`` holds ``layer`` for pass ``pass_id``."""

    slot: int
    layer: int
    pass_id: int


@_record("read_error")
class ReadError(Message):
    """reader -> dma: the read failed; the slot is the dma's again, unfilled."""

    slot: int
    layer: int
    pass_id: int
    message: str


# -- device ring ----------------------------------------------------------------------------------


@_record("want")
class Want(Message):
    """compute -> dma: the streamed ``layers`` of pass ``pass_id``, in the order they will run."""

    pass_id: int
    layers: list[int]


@_record("slot_ready")
class SlotReady(Message):
    """dma -> compute: device slot ``slot`` holds ``layer`` for pass ``pass_id``."""

    slot: int
    layer: int
    pass_id: int


@_record("slot_free")
class SlotFree(Message):
    """compute -> dma: compute is done with the device slot (it names the layer and pass it got
    the slot for, so dma can check the token came back the way it went out)."""

    slot: int
    layer: int
    pass_id: int


@_record("layer_error")
class LayerError(Message):
    """dma -> compute: ``layer`` of pass ``pass_id`` cannot be delivered (its read failed)."""

    layer: int
    pass_id: int
    message: str


@_record("standby")
class Standby(Message):
    """dma -> compute: these resident layers now also sit in dma's pinned RAM (their standby
    copies, loaded in the background after ready), so compute may demote them to streamed: a
    ``Want`` naming one is served from that copy like a RAM-tier layer (docs/ARCHITECTURE.md,
    "KV memory")."""

    layers: list[int]


@_record("activity")
class Activity(Message):
    """compute -> dma -> reader: compute has (or no longer has) requests in flight."""

    active: bool


# -- channels -------------------------------------------------------------------------------------

DAEMON_TO_SUPERVISOR = Channel("control (daemon -> supervisor)", Hello, Ready, Fatal, Stats, Events, Drained)
SUPERVISOR_TO_DAEMON = Channel("control (supervisor -> daemon)", Config, Shutdown, Request, Cancel, Drain)
CTL_TO_SUPERVISOR = Channel("control (ntxctl -> supervisor)", CtlStatus, CtlStop)
SUPERVISOR_TO_CTL = Channel("control (supervisor -> ntxctl)", StatusReport, Stopped)
DMA_TO_READER = Channel("host ring (dma -> reader)", Read, Activity)
READER_TO_DMA = Channel("host ring (reader -> dma)", Filled, ReadError)
COMPUTE_TO_DMA = Channel("device ring (compute -> dma)", Want, SlotFree, Activity)
DMA_TO_COMPUTE = Channel("device ring (dma -> compute)", SlotReady, LayerError, Standby)


# ---------------------------------------------------------------------------------------------
# Client protocol: requests


class ProtocolError(ValueError):
    """A client frame that cannot be served; ``code`` and ``str()`` go into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


# Bounds of a client frame that hold whatever the instance (docs/PROTOCOL.md, "Limits"); the
# ones that depend on the instance's context (prompt size, max_tokens) are in ctl/request_limits.py.
MAX_FRAME_BYTES = 1 << 20  # a 128k-token prompt as text or as token ids fits with room to spare
MAX_NESTING_DEPTH = 8  # a valid request nests 3 deep (map > messages list > entry map)
MAX_MAP_ENTRIES = 64  # generate has 20 fields
MAX_ARRAY_ITEMS = 1 << 18  # token ids of the largest context (2 x 128k)
MAX_ID_CHARS = 256

# field -> (accepted python types, description for the error line); sampling fields: their table
_GENERATE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "id": ((str,), "a string"),
    "prompt": ((str,), "a string"),
    "messages": ((list,), "a list of {role, content} maps"),
    "tokens": ((list,), "a list of token ids"),
    "raw": ((bool,), "true or false"),
    "stream": ((bool,), "true or false"),
    "speculative": ((bool,), "true or false"),
    "logprobs": ((int,), "an integer"),
    "prompt_logprobs": ((int,), "an integer"),
    **{name: f.wire_types for name, f in SAMPLING_BY_NAME.items()},
}
_MESSAGE_ENTRY_FIELDS = ("role", "content")
# the fields each op may carry: anything else is refused, so nothing unchecked travels on
_OP_FIELDS = {"generate": set(_GENERATE_FIELDS) | {"op"}, "cancel": {"op", "id"}, "status": {"op", "id"}}
OPS = tuple(_OP_FIELDS)


def _nesting_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether maps and lists nest deeper than ``limit`` in ``value``; a walk with its own stack,
    so a frame nested a thousand levels deep cannot exhaust the interpreter's recursion limit
    (msgpack unpacks up to 1,024 levels; re-packing or printing such a value raises)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return False


def unpack_client_frame(frame: bytes) -> Any:
    """A client frame's msgpack value within the frame bounds (size, nesting, map and array
    lengths; map keys must be strings); raises ProtocolError ``bad_frame``."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("bad_frame", f"frame of {len(frame)} bytes is larger than the limit of {MAX_FRAME_BYTES} bytes")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_map_len=MAX_MAP_ENTRIES,
                              max_array_len=MAX_ARRAY_ITEMS)
    except Exception as e:  # msgpack raises several types for garbage and for the limits
        raise ProtocolError("bad_frame", f"frame is not valid msgpack within the limits ({type(e).__name__}: "
                                         f"{str(e)[:80]})") from None
    if _nesting_depth_exceeds(msg, MAX_NESTING_DEPTH):
        raise ProtocolError("bad_frame", f"frame nests maps and lists deeper than {MAX_NESTING_DEPTH} levels")
    return msg


def client_frame_id(frame: bytes) -> str | None:
    """The request id of a refused frame, for its error reply, if one can be read safely."""
    try:
        msg = unpack_client_frame(frame)
    except ProtocolError:
        return None
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else None


def decode_client_frame(frame: bytes) -> dict[str, Any]:
    """Parse and check a client frame's shape; raises ProtocolError naming the problem."""
    msg = unpack_client_frame(frame)
    if not isinstance(msg, dict):
        raise ProtocolError("bad_frame", f"frame must be a msgpack map, got {type(msg).__name__}")
    op = msg.get("op")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op!r:.40} (expected one of {', '.join(OPS)})")
    rid = msg.get("id")
    if op in ("generate", "cancel") and (not isinstance(rid, str) or not rid):
        raise ProtocolError("bad_request", "field 'id' must be a non-empty string")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("bad_request", "field 'id' must be a string")
    if rid is not None and len(rid) > MAX_ID_CHARS:
        raise ProtocolError("bad_request", f"field 'id' is longer than {MAX_ID_CHARS} characters")
    extra = set(msg) - _OP_FIELDS[op]
    if extra:
        raise ProtocolError("bad_request", f"unknown field(s) {', '.join(sorted(repr(k)[:40] for k in extra))}")
    if op == "generate":
        check_generate(msg)
    return msg


def check_generate(msg: dict[str, Any]) -> None:
    """Types and presence of a generate request's fields, and the sampling fields' values (the
    prompt's tokens and the context are checked by the engine)."""
    for key, value in msg.items():
        if key == "op":
            continue
        spec = _GENERATE_FIELDS.get(key)
        if spec is None:
            raise ProtocolError("bad_request", f"unknown field {key!r:.40}")
        types_, what = spec
        sampling = SAMPLING_BY_NAME.get(key)
        if value is None and sampling is not None and sampling.nullable:
            continue
        if not isinstance(value, types_) or (isinstance(value, bool) and bool not in types_):
            raise ProtocolError("bad_request", f"field {key!r} must be {what}, got {type(value).__name__}")
        reason = sampling.check(value) if sampling is not None else None
        if reason:
            raise ProtocolError("bad_request", reason)
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
            extra = set(m) - set(_MESSAGE_ENTRY_FIELDS)
            if extra:
                raise ProtocolError("bad_request", f"messages[{i}] has unknown field(s) "
                                                   f"{', '.join(sorted(repr(k)[:40] for k in extra))}")


def error_reply(rid: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "type": "error", "code": code, "message": message}
