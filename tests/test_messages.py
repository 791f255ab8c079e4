"""The internal messages (shared/messages.py) and the one sampling-parameter table
(shared/sampling_fields.py): every record survives its channel, a malformed frame is refused
with one line naming the problem, and the table drives the wire check, SamplingParams, the CLI
options and docs/PROTOCOL.md."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import typer

from ntx.ctl.cli import app
from ntx.ctl.request_limits import RequestLimits
from ntx.ctl.requests import parse_generate
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared import messages as m
from ntx.shared.errors import NtxError
from ntx.shared.sampling_fields import SAMPLING_FIELDS, from_wire, to_wire

LIMITS = RequestLimits(max_context=4096, max_batch=16)


def check_generate(msg: dict) -> None:
    """The front's one check of a generate map (ctl/requests.py), at a 4096-token context."""
    parse_generate(msg, LIMITS)

CHANNELS = [
    m.DAEMON_TO_SUPERVISOR, m.SUPERVISOR_TO_DAEMON, m.CTL_TO_SUPERVISOR, m.SUPERVISOR_TO_CTL,
    m.DMA_TO_READER, m.READER_TO_DMA, m.COMPUTE_TO_DMA, m.DMA_TO_COMPUTE,
]
EXAMPLES = [
    m.Hello(), m.Ready(device_slots=[b"\x01handle"]), m.Ready(host_slots=["ntx-g0-hslot0"]),
    m.Fatal(message="no GPU"), m.Stats(stats={"total": {"busy_s": 1.5}}),
    m.EngineOutputs(events=[m.EngineOutput(id="r0", tokens=[5, 6], logprobs=[[[5, -0.1]], [[6, -0.2]]],
                                           token_logprobs=[-0.1, -0.2], prompt_logprobs=[None, [[1, -3.0]]],
                                           queued_s=0.5, drafted=2, accepted=1),
                            m.EngineOutput(id="r1", tokens=[], finish_reason="cancelled"),
                            m.EngineError(id="r2", code="numerical_error", message="NaN")]),
    m.Drained(),
    m.Config(instance={"model": "x.gguf"}, plan={"n_slots": 2}, shm_names={"ram": "r"},
             host_ring="ipc://h", device_ring="ipc://d", device_slots=["s0"], host_slots=["h0"]),
    m.Shutdown(), m.EngineRequest(id="r1", prompt_tokens=[1, 2, 3], params=SamplingParams(seed=4, stop=["x"]),
                                  logprobs=2, speculative=False),
    m.Cancel(rid="r1"), m.Drain(timeout_s=30.0),
    m.CtlStatus(), m.StatusReport(status={"state": "ready"}), m.CtlStop(force=True), m.Stopped(reason=None),
    m.Read(slot=1, layer=7, pass_id=3, backlog=2, active=True), m.Filled(slot=1, layer=7, pass_id=3),
    m.ReadFailed(slot=1, layer=7, pass_id=3, message="EIO"),
    m.Want(pass_id=4, layers=[5, 6, 7]), m.Drop(first_pass=4, last_pass=5), m.SlotReady(slot=0, layer=5, pass_id=4),
    m.SlotFree(slot=0, layer=5, pass_id=4), m.LayerError(layer=6, pass_id=4, message="EIO"),
    m.Activity(active=False), m.Standby(layers=[0, 4]), m.StandbyWanted(),
]


NESTED = {m.EngineOutput, m.EngineError}  # records that travel inside another (EngineOutputs)


def test_every_record_has_an_example_and_a_channel():
    records = {cls for cls in vars(m).values() if isinstance(cls, type) and issubclass(cls, m.Message) and cls.T}
    examples = {type(e) for e in EXAMPLES} | {type(ev) for e in EXAMPLES if isinstance(e, m.EngineOutputs)
                                              for ev in e.events}
    assert examples == records
    on_a_channel = {kind for ch in CHANNELS for kind in ch.kinds.values()}
    assert on_a_channel == records - NESTED


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_on_its_channels(msg):
    channels = [ch for ch in CHANNELS if msg.T in ch.kinds]
    for ch in channels:
        assert ch.decode(msg.encode()) == msg
    for ch in CHANNELS:
        if ch not in channels:  # a message on the wrong channel is refused, never misread
            with pytest.raises(m.MessageError, match="unexpected message type"):
                ch.decode(msg.encode())


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\xc1\xff", "not valid msgpack"),
        (m.pack([1, 2]), "must be a msgpack map"),
        (m.pack({"slot": 0}), "unexpected message type None"),
        (m.pack({"t": "slot_ready", "slot": 0, "layer": 5}), "lacks field 'pass_id'"),
        (m.pack({"t": "slot_ready", "slot": "0", "layer": 5, "pass_id": 1}), "'slot' must be an integer"),
        (m.pack({"t": "slot_ready", "slot": True, "layer": 5, "pass_id": 1}), "'slot' must be an integer"),
        (m.pack({"t": "slot_ready", "slot": 0, "layer": 5, "pass_id": 1, "gen": 0}), "unknown field(s) 'gen'"),
        (m.pack({"t": "layer_error", "layer": 5, "pass_id": 1}), "lacks field 'message'"),
    ],
)
def test_a_malformed_frame_is_one_clear_error(frame, needle):
    with pytest.raises(m.MessageError) as err:
        m.DMA_TO_COMPUTE.decode(frame)
    text = str(err.value)
    assert text.startswith("device ring (dma -> compute): ") and needle in text and "\n" not in text
    assert isinstance(err.value, NtxError)  # a daemon reports it as a fatal error, one line


@pytest.mark.parametrize(
    "event, needle",
    [
        ({"t": "engine_output", "id": "r0", "tokens": [1, "2"]}, "item 0 (engine_output) field 'tokens' must be a list"),
        ({"t": "engine_output", "tokens": [1]}, "item 0 (engine_output) lacks field 'id'"),
        ({"t": "hello"}, "item 0: unexpected message type 'hello' (expected one of engine_output, engine_error)"),
        ({"t": "engine_error", "id": "r0", "code": "x", "message": "y", "extra": 1}, "unknown field(s) 'extra'"),
        ([1], "item 0 must be a map"),
    ],
)
def test_a_nested_record_is_checked_like_a_frame(event, needle):
    with pytest.raises(m.MessageError) as err:
        m.DAEMON_TO_SUPERVISOR.decode(m.pack({"t": "engine_outputs", "events": [event]}))
    assert str(err.value).startswith("control (daemon -> supervisor): engine_outputs field 'events' ")
    assert needle in str(err.value), str(err.value)


def test_sampling_params_inside_a_request_are_checked():
    frame = m.pack({"t": "engine_request", "id": "r", "prompt_tokens": [1], "params": {"top_k": "3"}})
    with pytest.raises(m.MessageError, match=r"field 'params' \(SamplingParams\) field 'top_k' must be an integer"):
        m.SUPERVISOR_TO_DAEMON.decode(frame)


def test_list_items_are_checked():
    with pytest.raises(m.MessageError, match="'layers' must be a list"):
        m.COMPUTE_TO_DMA.decode(m.pack({"t": "want", "pass_id": 0, "layers": [1, "2"]}))


def test_ring_messages_carry_no_dead_fields():
    assert [f.name for f in dataclasses.fields(m.Filled)] == ["slot", "layer", "pass_id"]
    for kind in (m.Read, m.Filled, m.ReadFailed, m.Want, m.SlotReady, m.SlotFree, m.LayerError, m.Activity):
        assert "gen" not in {f.name for f in dataclasses.fields(kind)}


# --- the sampling table --------------------------------------------------------------------------


def test_sampling_params_are_the_table():
    p = SamplingParams()
    assert [f.name for f in dataclasses.fields(p)] == [f.name for f in SAMPLING_FIELDS]
    for f in SAMPLING_FIELDS:
        assert getattr(p, f.name) == (list(f.default) if f.kind is list else f.default)
    assert SamplingParams().stop is not SamplingParams().stop  # no shared mutable default


def test_wire_round_trip_through_the_table():
    p = SamplingParams(temperature=0.0, top_k=3, seed=9, max_tokens=7, stop=["\n"])
    wire = to_wire(p)
    assert set(wire) == {f.name for f in SAMPLING_FIELDS}
    check_generate({"op": "generate", "id": "x", "prompt": "hi", **wire})
    assert SamplingParams(**from_wire({"prompt": "hi", **wire})) == p
    assert SamplingParams(**from_wire({"prompt": "hi"})) == SamplingParams()


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("top_k", "3", "field 'top_k' must be an integer, got str"),
        ("temperature", True, "field 'temperature' must be a number, got bool"),
        ("stop", "x", "field 'stop' must be a list of strings"),
        ("top_p", 9.0, "invalid sampling parameter top_p=9.0"),
        ("max_tokens", 0, "invalid sampling parameter max_tokens=0"),
        ("seed", -1, "invalid sampling parameter seed=-1"),
        ("stop", ["ok", ""], "invalid sampling parameter stop="),
    ],
)
def test_wire_check_of_sampling_fields(field, value, needle):
    with pytest.raises(m.RequestError) as err:
        check_generate({"op": "generate", "id": "x", "prompt": "hi", field: value})
    assert err.value.code == "bad_request" and needle in str(err.value)


def test_seed_may_be_nil_on_the_wire():
    check_generate({"op": "generate", "id": "x", "prompt": "hi", "seed": None})


def _options(command: str) -> dict[str, object]:
    cmd = typer.main.get_command(app).commands[command]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("command, overrides", [("generate", {}), ("chat", {"temperature": 0.7, "max_tokens": 512})])
def test_cli_options_come_from_the_table(command, overrides):
    opts = _options(command)
    for f in SAMPLING_FIELDS:
        opt = opts[f.name]
        assert f"--{f.name.replace('_', '-')}" in opt.opts
        assert opt.help == f.help
        if f.kind is not list:
            assert opt.default == overrides.get(f.name, f.default)


def test_protocol_doc_lists_every_sampling_field_with_its_default():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
    for f in SAMPLING_FIELDS:
        row = re.search(rf"^\| `{f.name}` \| [^|]+ \| ([^|]+) \|", doc, re.M)
        assert row, f"docs/PROTOCOL.md has no row for {f.name}"
        shown = row.group(1).strip()
        expected = "random" if f.default is None else "[]" if f.kind is list else str(f.default)
        assert shown == expected, (f.name, shown, expected)


@pytest.mark.parametrize("frame, rid", [
    # over the frame bound: once answered with id nil, so no client could match the error
    (m.pack({"op": "generate", "id": "big", "prompt": "hello " * 190_000}), "big"),
    (m.pack({"op": "generate", "prompt": "x" * (3 << 20), "id": "id-after-the-prompt"}), "id-after-the-prompt"),
    (m.pack({"op": "generate", "id": "deep", "messages": [[[[[[[[[[1]]]]]]]]]]}), "deep"),
    (m.pack({"op": "generate", "id": "first", "id2": 1, "stop": ["a"] * 1_000_000}), "first"),
    (m.pack({"op": "generate", "id": "cut", "prompt": "hi"})[:-3], "cut"),  # truncated after the id
    (m.pack({"op": "generate", "id": "x" * 300}), None),  # too long to be an id
    (m.pack({"op": "generate", "id": 7}), None),
    (m.pack(["op", "id"]), None),
    (b"\xc1garbage", None),
    (b"", None),
    (m.pack({"op": "generate", ("a" * 5000): 1, "id": "after-a-long-key"}), "after-a-long-key"),
])
def test_a_refused_frames_id_is_read_whenever_it_can_be(frame, rid):
    """``client_frame_id`` reads the top-level ``id`` without unpacking the rest, so a frame over
    the bounds (size, nesting, lengths) or cut short after its id is answered under its id."""
    t0 = time.monotonic()
    assert m.client_frame_id(frame) == rid
    assert time.monotonic() - t0 < 0.5
