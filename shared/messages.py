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
  supervisor. Compute also receives ``EngineRequest`` / ``Cancel`` / ``Drain`` and sends
  ``EngineOutputs`` (token ids, log-probabilities, finishes, errors) and ``Drained``. ntxctl (identity ``ctl-…``) sends ``CtlStatus`` (answered
  by ``StatusReport``) or ``CtlStop`` (answered by ``Stopped`` once everything is down).
* **host ring** — dma (PAIR, binds) ⇄ reader (PAIR): ``Read`` (dma hands a FREE host slot with
  a job), ``Filled`` / ``ReadFailed`` (the reader answers).
* **device ring** — compute (PAIR, binds) ⇄ dma (PAIR): ``Want`` (compute asks for a pass's
  streamed layers), ``SlotReady`` (a device slot holds a layer), ``SlotFree`` (compute ran it),
  ``LayerError`` (the layer could not be delivered).
* **activity** — compute → dma → reader: ``Activity``, so a stage waiting while nobody has
  work counts as idle, not as starved or blocked.

The engine's records (``EngineRequest`` in, ``EngineOutput`` / ``EngineError`` out) are token
ids and numbers: the supervisor's front (ctl/requests.py) turns a client's text into the one and
the other into the client's replies.

The client protocol (docs/PROTOCOL.md) stays plain msgpack maps for clients in any language;
its frames are bounded and checked here (``decode_client_frame``), so the supervisor refuses a
bad frame with one error line, and its replies are typed here too (``TokenReply``,
``DoneReply``, ``ErrorReply``, ``StatusReply``; ``to_wire`` gives the map). Its sampling fields
come from ``ntx.shared.sampling_fields``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Union

import msgpack

from ntx.shared.errors import NtxError
from ntx.shared.sampling_fields import MAX_LOGPROBS, SAMPLING_BY_NAME, SamplingParams

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


@dataclass(frozen=True)
class _Codec:
    """How one field travels: ``check`` for a plain value (kept as msgpack gives it when the check
    holds), or ``decode``/``encode`` for a nested record (built from its map, and back)."""

    what: str  # for the error line: "an integer", "a list (items: a string)", ...
    check: Callable[[Any], bool] | None = None
    decode: Callable[[Any, str], Any] | None = None  # (value, where) -> field value; MessageError
    encode: Callable[[Any], Any] | None = None


def _plain(what: str, check: Callable[[Any], bool]) -> _Codec:
    return _Codec(what, check=check)


def _codec(hint: Any) -> _Codec:
    """The codec of a field of type ``hint``: plain msgpack values, lists and optionals of them,
    records (a ``Message`` subclass: a map with its tag; an unregistered base accepts any record
    derived from it) and plain dataclasses (a map of their fields)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _plain("anything", lambda v: True)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported message field type {hint!r}")
        c = _codec(inner[0])
        if c.check is not None:
            return _plain(f"{c.what} or nil", lambda v: v is None or c.check(v))
        return _Codec(f"{c.what} or nil", decode=lambda v, where: None if v is None else c.decode(v, where),
                      encode=lambda v: None if v is None else c.encode(v))
    if hint is bool:
        return _plain("true or false", lambda v: isinstance(v, bool))
    if hint is int:
        return _plain("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
    if hint is float:
        return _plain("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
    if hint is str:
        return _plain("a string", lambda v: isinstance(v, str))
    if hint is dict or origin is dict:
        return _plain("a map", lambda v: isinstance(v, dict))
    if origin is list:
        c = _codec(args[0])
        what = f"a list (items: {c.what})"
        if c.check is not None:
            return _plain(what, lambda v: isinstance(v, list) and all(c.check(x) for x in v))

        def decode_list(v: Any, where: str) -> list:
            if not isinstance(v, list):
                raise MessageError(f"{where} must be {what}, got {type(v).__name__}")
            return [c.decode(x, f"{where} item {i}") for i, x in enumerate(v)]

        return _Codec(what, decode=decode_list, encode=lambda v: [c.encode(x) for x in v])
    if isinstance(hint, type) and issubclass(hint, Message):
        return _Codec(f"a {hint.__name__} map", decode=lambda v, where: _decode_record(v, hint, where),
                      encode=lambda v: v.to_map())
    if isinstance(hint, type) and is_dataclass(hint):
        names_codecs = _field_codecs(hint)
        return _Codec(f"a {hint.__name__} map",
                      decode=lambda v, where: hint(**_decode_fields(names_codecs, v, f"{where} ({hint.__name__})")),
                      encode=lambda v: _encode_fields(names_codecs, v))
    raise TypeError(f"unsupported message field type {hint!r}")


_FieldCodecs = tuple[tuple[str, _Codec, bool], ...]  # name, codec, required


def _field_codecs(cls: type) -> _FieldCodecs:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _codec(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
                 for f in fields(cls))


def _decode_fields(codecs: _FieldCodecs, msg: Any, where: str) -> dict[str, Any]:
    """A record's fields from its decoded map (less the tag): every required field present, every
    value of its type, nothing else; MessageError naming ``where`` and the field otherwise."""
    if not isinstance(msg, dict):
        raise MessageError(f"{where} must be a map, got {type(msg).__name__}")
    for name, c, required in codecs:
        if name not in msg:
            if required:
                raise MessageError(f"{where} lacks field {name!r}")
        elif c.check is not None:
            if not c.check(msg[name]):
                raise MessageError(f"{where} field {name!r} must be {c.what}, got {msg[name]!r:.80}")
        else:
            msg[name] = c.decode(msg[name], f"{where} field {name!r}")
    extra = set(msg) - {name for name, *_ in codecs}
    if extra:
        raise MessageError(f"{where} has unknown field(s) {', '.join(map(repr, sorted(extra)))}")
    return msg


def _encode_fields(codecs: _FieldCodecs, obj: Any) -> dict[str, Any]:
    return {name: (getattr(obj, name) if c.encode is None else c.encode(getattr(obj, name))) for name, c, _ in codecs}


@dataclass(frozen=True)
class Message:
    """Base of every internal message record: ``T`` is its type tag on the wire. A base class
    without a tag (``EngineEvent``) names a family of records a field may hold any of."""

    T: ClassVar[str] = ""
    _codecs: ClassVar[_FieldCodecs] = ()

    def to_map(self) -> dict[str, Any]:
        """The msgpack map of this record: its tag and its fields by name."""
        return {"t": self.T, **_encode_fields(self._codecs, self)}

    def encode(self) -> bytes:
        return pack(self.to_map())


_BY_TAG: dict[str, type[Message]] = {}


def _record(tag: str):
    """Register a message record under its wire tag and precompute its field codecs."""

    def register(cls: type[Message]) -> type[Message]:
        cls = dataclass(frozen=True)(cls)
        if tag in _BY_TAG:
            raise TypeError(f"message tag {tag!r} is taken by {_BY_TAG[tag].__name__}")
        cls.T = tag
        cls._codecs = _field_codecs(cls)
        _BY_TAG[tag] = cls
        return cls

    return register


def _decode_record(msg: Any, family: type[Message], where: str) -> Message:
    """A nested record of ``family`` from its map (with its tag)."""
    if not isinstance(msg, dict):
        raise MessageError(f"{where} must be a map, got {type(msg).__name__}")
    msg = dict(msg)
    tag = msg.pop("t", None)
    kind = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if kind is None or not issubclass(kind, family):
        expected = ", ".join(t for t, k in _BY_TAG.items() if issubclass(k, family))
        raise MessageError(f"{where}: unexpected message type {tag!r:.40} (expected one of {expected})")
    return kind(**_decode_fields(kind._codecs, msg, f"{where} ({tag})"))


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
        return kind(**_decode_fields(kind._codecs, msg, f"{self.name}: {tag}"))


# -- the engine's requests and outputs (supervisor <-> compute, and in-process) ---------------------
# The engine core (daemons/compute/engine.py) takes and gives these records as they are, in the
# compute daemon and in ``ntxctl generate --local`` alike: token ids and numbers only; text is the
# front's (ctl/requests.py).


@_record("engine_request")
class EngineRequest(Message):
    """supervisor -> compute: a request as the engine core serves it: the prompt's token ids (after
    the chat template and BOS), the sampling parameters (the front fixed the seed; stop strings
    stay at the front), how many log-probability alternatives to report per generated token
    (``logprobs``) and per prompt position (``prompt_logprobs``), and whether it may be
    speculated. ``id`` is the supervisor's internal id (``r17``), not the client's."""

    id: str
    prompt_tokens: list[int]
    params: SamplingParams
    logprobs: int = 0
    prompt_logprobs: int = 0
    speculative: bool = True


class EngineEvent(Message):
    """An event of one request (its ``id``) from the engine: ``EngineOutput`` or ``EngineError``."""


@_record("engine_output")
class EngineOutput(EngineEvent):
    """One request's share of one pass: the tokens it gained, in order (a verify pass may yield
    several; a stop token is never among them), with, when the request asked for ``logprobs`` k,
    each token's top-k ``[id, log-probability]`` pairs (``logprobs``) and its own
    (``token_logprobs``). ``finish_reason`` is set when the engine ended the request: ``stop`` (a
    stop token), ``length`` (max_tokens or the context's end) or ``cancelled``; its KV cache is
    free then. ``prompt_logprobs`` (the request asked for them) comes once, with its first output.
    The timings are the request's as of this output (queued until admitted, prefill to the first
    token, decode since), so the front can end it at any output (a stop string) with the figures
    the engine would give at that token; ``drafted`` / ``accepted``: this pass's speculation for
    it (0 / 0 without a verify)."""

    id: str
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[Any] | None = None
    token_logprobs: list[float] | None = None
    prompt_logprobs: list[Any] | None = None
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0


@_record("engine_error")
class EngineError(EngineEvent):
    """A request the engine ended with an error (``layer_unavailable``, ``numerical_error``, or one
    it refused at submit): no further events for it. ``code`` and ``message`` go to its client."""

    id: str
    code: str
    message: str


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


@_record("engine_outputs")
class EngineOutputs(Message):
    """What the engine's passes produced since the last send: each request's ``EngineOutput`` or
    ``EngineError``, under the supervisor's internal request ids."""

    events: list[EngineEvent]


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


@_record("cancel")
class Cancel(Message):
    """Stop request ``rid``: compute answers with its last ``EngineOutput`` (``cancelled``)."""

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


@_record("read_failed")
class ReadFailed(Message):
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


@_record("drop")
class Drop(Message):
    """compute -> dma: passes ``first_pass`` to ``last_pass`` were given up (a failed pass, a
    demotion, a pass asked at the wrong width): copy none of their layers not yet started. A
    layer already read into a host slot, or being read, is still delivered (compute hands its
    slot straight back)."""

    first_pass: int
    last_pass: int


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


@_record("standby_wanted")
class StandbyWanted(Message):
    """compute -> dma: the KV cache ran short of pages and a layer to demote has no standby copy
    yet: load the rest of them now, even while compute is busy (until then dma loads them only
    while compute is idle, so that the reads never slow the copies a pass waits for)."""


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

DAEMON_TO_SUPERVISOR = Channel("control (daemon -> supervisor)", Hello, Ready, Fatal, Stats, EngineOutputs, Drained)
SUPERVISOR_TO_DAEMON = Channel("control (supervisor -> daemon)", Config, Shutdown, EngineRequest, Cancel, Drain)
CTL_TO_SUPERVISOR = Channel("control (ntxctl -> supervisor)", CtlStatus, CtlStop)
SUPERVISOR_TO_CTL = Channel("control (supervisor -> ntxctl)", StatusReport, Stopped)
DMA_TO_READER = Channel("host ring (dma -> reader)", Read, Activity)
READER_TO_DMA = Channel("host ring (reader -> dma)", Filled, ReadFailed)
COMPUTE_TO_DMA = Channel("device ring (compute -> dma)", Want, SlotFree, Activity, StandbyWanted, Drop)
DMA_TO_COMPUTE = Channel("device ring (dma -> compute)", SlotReady, LayerError, Standby)


# ---------------------------------------------------------------------------------------------
# Client protocol (docs/PROTOCOL.md): plain msgpack maps for clients in any language. The frame's
# bounds, its op, id and field names are checked here (``decode_client_frame``); a generate
# request's fields, once, by the front (``ctl/requests.py: parse_generate``), from this table.


class RequestError(NtxError):
    """A client request that cannot be served: ``code`` and ``str()`` go into its error reply."""

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
GENERATE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
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
MESSAGE_ENTRY_FIELDS = ("role", "content")
# the fields each op may carry: anything else is refused, so nothing unchecked travels on
_OP_FIELDS = {"generate": set(GENERATE_FIELDS) | {"op"}, "cancel": {"op", "id"}, "status": {"op", "id"}}
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
    lengths; map keys must be strings); raises RequestError ``bad_frame``."""
    if len(frame) > MAX_FRAME_BYTES:
        raise RequestError("bad_frame", f"frame of {len(frame)} bytes is larger than the limit of {MAX_FRAME_BYTES} bytes")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_map_len=MAX_MAP_ENTRIES,
                              max_array_len=MAX_ARRAY_ITEMS)
    except Exception as e:  # msgpack raises several types for garbage and for the limits
        raise RequestError("bad_frame", f"frame is not valid msgpack within the limits ({type(e).__name__}: "
                                        f"{str(e)[:80]})") from None
    if _nesting_depth_exceeds(msg, MAX_NESTING_DEPTH):
        raise RequestError("bad_frame", f"frame nests maps and lists deeper than {MAX_NESTING_DEPTH} levels")
    return msg


def client_frame_id(frame: bytes) -> str | None:
    """The request id of a refused frame, for its error reply, whenever one can be read: a frame
    over the bounds (its size, nesting, lengths), or cut short after its id, still names the
    request it was, so its client can end that request instead of waiting for ever. The
    top-level map's keys are read and every other value skipped, never built (a 16 MiB prompt
    costs no copy); the last ``id`` seen counts, as when the frame is unpacked whole."""
    reader = msgpack.Unpacker(raw=False, max_buffer_size=max(len(frame), 1), max_str_len=len(frame),
                              max_bin_len=len(frame), max_array_len=0, max_map_len=0, max_ext_len=0)
    reader.feed(frame)
    rid = None
    try:
        for _ in range(reader.read_map_header()):
            key = reader.unpack()  # a list or map as a key raises: that is no map of this protocol
            if key == "id":
                rid = reader.unpack()
            else:
                reader.skip()
    except Exception:  # noqa: BLE001 - garbage, a bound, the end of a cut frame: the id so far
        pass
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else None


def decode_client_frame(frame: bytes) -> dict[str, Any]:
    """Parse a client frame and check its shape (bounds, op, id, the op's field names); raises
    RequestError naming the problem. A generate request's values are the front's to check."""
    msg = unpack_client_frame(frame)
    if not isinstance(msg, dict):
        raise RequestError("bad_frame", f"frame must be a msgpack map, got {type(msg).__name__}")
    op = msg.get("op")
    if op not in OPS:
        raise RequestError("unknown_op", f"unknown op {op!r:.40} (expected one of {', '.join(OPS)})")
    rid = msg.get("id")
    if op in ("generate", "cancel") and (not isinstance(rid, str) or not rid):
        raise RequestError("bad_request", "field 'id' must be a non-empty string")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("bad_request", "field 'id' must be a string")
    if rid is not None and len(rid) > MAX_ID_CHARS:
        raise RequestError("bad_request", f"field 'id' is longer than {MAX_ID_CHARS} characters")
    extra = set(msg) - _OP_FIELDS[op]
    if extra:
        raise RequestError("bad_request", f"unknown field(s) {', '.join(sorted(repr(k)[:40] for k in extra))}")
    return msg


def check_prompt_tokens(ids: list[int], n_vocab: int, max_context: int) -> None:
    """The rule a prompt's token ids keep, whoever made them (the front after tokenizing, the
    engine before it admits a request): not empty, every id in the vocabulary (on the GPU an id
    outside it reads no embedding row: NaN, found only after it was scheduled) and room in the
    context for a generated token. Raises RequestError."""
    if not ids:
        raise RequestError("bad_request", "empty prompt")
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise RequestError("bad_request", f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
    if len(ids) >= max_context:
        raise RequestError("context_overflow", f"prompt has {len(ids)} tokens but the context holds {max_context}")


# -- replies ---------------------------------------------------------------------------------------


@dataclass
class SpecCounts:
    """Speculation's tally: verify passes, tokens drafted and drafted tokens accepted (one
    request's in its ``done`` reply, the engine's since start in status)."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    # of those, the passes whose tree came from a one-token match (``DraftTree.weak``; the
    # engine's tally only): what they drafted and had accepted
    weak_passes: int = 0
    weak_drafted: int = 0
    weak_accepted: int = 0

    def add(self, drafted: int, accepted: int, weak: bool = False) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if weak:
            self.weak_passes += 1
            self.weak_drafted += drafted
            self.weak_accepted += accepted

    def report(self) -> dict[str, Any]:
        """What speculation got out of each pass, as ``done`` and status carry it (status also
        the one-token matches' share, once there is one)."""
        out = {"verify_passes": self.passes, "drafted": self.drafted, "accepted": self.accepted,
               "accepted_per_pass": round(self.accepted / self.passes, 3) if self.passes else 0.0,
               "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0}
        if self.weak_passes:
            out.update(weak_verify_passes=self.weak_passes, weak_drafted=self.weak_drafted,
                       weak_accepted=self.weak_accepted)
        return out


class Reply:
    """A reply to a client: ``to_wire()`` is the map it receives (docs/PROTOCOL.md, Replies), with
    ``id`` (the client's request id) and ``type``."""

    id: str | None

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class TokenReply(Reply):
    """One generated token and the text it completes (empty while a multi-byte character or a
    possible stop string is held back); with log-probabilities, the top-k ``[id, logprob]`` pairs,
    the token's own, and the bytes of the token and of each pair's token (so a client shows them
    as text without the model's vocabulary)."""

    id: str
    token: int
    text: str
    logprobs: list[list] | None = None
    logprob: float | None = None
    token_bytes: bytes | None = None
    top_bytes: list[bytes] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "token", "token": self.token, "text": self.text}
        if self.logprobs is not None:
            out.update(logprobs=self.logprobs, logprob=self.logprob, token_bytes=self.token_bytes,
                       top_bytes=self.top_bytes)
        return out


@dataclass(frozen=True)
class Timings:
    """A request's time queued (until compute admitted it), in prefill (to its first token) and
    in decode (since), in seconds; decode tok/s over the tokens after the first."""

    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None

    @classmethod
    def of(cls, queued_s: float, prefill_s: float, decode_s: float, n_tokens: int) -> Timings:
        tps = round((n_tokens - 1) / decode_s, 3) if n_tokens > 1 and decode_s > 0 else None
        return cls(round(queued_s, 6), round(max(prefill_s, 0.0), 6), round(decode_s, 6), tps)

    def to_wire(self) -> dict[str, Any]:
        return {"queued_s": self.queued_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass(frozen=True)
class DoneReply(Reply):
    """The last reply of a request that ran (or was cancelled): why it ended, all its text and
    tokens, the prompt's tokens, timings and seed; ``tail`` (streamed requests: text held back
    at the end), ``prompt_logprobs`` (when asked for) and ``speculation`` (when it was
    speculated) only when set."""

    id: str
    finish_reason: str
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    timings: Timings
    seed: int
    tail: str | None = None
    prompt_logprobs: list | None = None
    speculation: SpecCounts | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "type": "done", "finish_reason": self.finish_reason, "text": self.text,
            "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "usage": {"prompt_tokens": len(self.prompt_tokens), "completion_tokens": len(self.tokens)},
            "timings": self.timings.to_wire(), "seed": self.seed,
        }
        if self.tail:
            out["tail"] = self.tail
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.speculation is not None and self.speculation.passes:
            out["speculation"] = self.speculation.report()
        return out


@dataclass(frozen=True)
class ErrorReply(Reply):
    """The request failed or was refused (``code``, one line naming the problem); no further
    replies for its id. ``id`` is nil for a frame whose id could not be read; such an error
    carries ``frame`` instead, the number of the frame it answers on its connection (1 for the
    connection's first), so the client that sent it can tell which of its requests it ends."""

    id: str | None
    code: str
    message: str
    frame: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out = {"id": self.id, "type": "error", "code": self.code, "message": self.message}
        if self.frame is not None:
            out["frame"] = self.frame
        return out


@dataclass(frozen=True)
class StatusReply(Reply):
    """The answer to ``status``: the status map (less what only operators see, for others)."""

    id: str | None
    status: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "status", "status": self.status}
