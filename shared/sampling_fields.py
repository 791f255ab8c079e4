"""The one definition of a request's sampling parameters: name, type, default, help and rule.

Every place that knows these fields reads this table: ``SamplingParams`` (its fields and
``validate``), the front's check of a client's generate map (``ctl/requests.py``), the
conversion of that map into ``SamplingParams`` (``from_wire``), ntxctl's ``generate`` and
``chat`` options and the map ntxctl sends (``to_wire``). A new parameter is one new row here (and
a line in docs/PROTOCOL.md, which a test holds to this table).

It lives in shared/ because the supervisor (ctl) and compute (a daemon) both need it and neither
may import the other: ``SamplingParams`` travels inside the engine's request record
(``messages.EngineRequest``).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ntx.shared.errors import NtxError

# numbers.* rather than numpy's types, so ntxctl's start-up does not pay for importing numpy
# (numpy's integer and floating scalars register as Integral and Real; its bool does not).


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingField:
    """One sampling parameter. ``kind`` is how it travels (int, float or list of strings);
    ``valid`` is its rule as code and ``rule`` the same rule as the error line says it."""

    name: str
    kind: type
    default: Any
    help: str
    rule: str
    valid: Callable[[Any], bool]
    nullable: bool = False  # None is a value (seed: draw one)
    short_flag: str | None = None  # ntxctl's one-letter option, if any

    @property
    def wire_types(self) -> tuple[tuple[type, ...], str]:
        """Accepted msgpack types and their description for a wrong-type error line."""
        if self.kind is float:
            return (int, float), "a number"
        if self.kind is int:
            return (int,), "an integer"
        return (list,), "a list of strings"

    @property
    def annotation(self) -> str:
        """The field's type as ``SamplingParams`` declares it."""
        base = "list[str]" if self.kind is list else self.kind.__name__
        return f"{base} | None" if self.nullable else base

    def check(self, value: Any) -> str | None:
        """None if ``value`` is valid, else the one-line reason."""
        if (value is None and self.nullable) or self.valid(value):
            return None
        return f"invalid sampling parameter {self.name}={value!r}: {self.rule}"


# every generated token is matched against every stop string: a million of them once slowed
# every client of the pipeline a hundredfold (docs/RELIABILITY.md)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# the most log-probability alternatives a request may ask per token (logprobs, prompt_logprobs;
# the OpenAI API's top_logprobs)
MAX_LOGPROBS = 20

SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "temperature", float, 0.8, "softmax temperature; 0 = greedy",
        "must be a finite number >= 0 (0 = greedy)",
        lambda v: _is_number(v) and math.isfinite(v) and v >= 0, short_flag="-t",
    ),
    SamplingField(
        "top_k", int, 40, "keep the k most likely tokens; 0 = off",
        "must be an integer >= 0 (0 = off)",
        lambda v: _is_int(v) and v >= 0,
    ),
    SamplingField(
        "top_p", float, 0.95, "keep the smallest set with this much probability; 1 = off",
        "must be a number in (0, 1] (1 = off)",
        lambda v: _is_number(v) and 0.0 < v <= 1.0,
    ),
    SamplingField(
        "min_p", float, 0.05, "drop tokens below this share of the best one's probability; 0 = off",
        "must be a number in [0, 1] (0 = off)",
        lambda v: _is_number(v) and 0.0 <= v <= 1.0,
    ),
    SamplingField(
        "repetition_penalty", float, 1.0, "penalise the last 64 tokens (llama.cpp's rule); 1 = off",
        "must be a finite number > 0 (1 = off)",
        lambda v: _is_number(v) and math.isfinite(v) and v > 0,
    ),
    SamplingField(
        "seed", int, None, "random seed: the same seed and request give the same text (default: drawn anew "
        "for each request; generate --json reports it as seed)",
        "must be an integer in [0, 2**64) or null",
        lambda v: _is_int(v) and 0 <= v < 2**64, nullable=True,
    ),
    SamplingField(
        "max_tokens", int, 256, "at most this many generated tokens",
        "must be an integer > 0",
        lambda v: _is_int(v) and v > 0, short_flag="-n",
    ),
    SamplingField(
        "stop", list, (), "stop string (repeatable)",
        f"must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
        lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v),
    ),
)
SAMPLING_BY_NAME: dict[str, SamplingField] = {f.name: f for f in SAMPLING_FIELDS}


def sampling_dataclass(cls: type) -> type:
    """Make ``cls`` a dataclass with one field per table row (its type and default), in table
    order; ``cls`` keeps its own docstring and methods."""
    cls.__annotations__ = {f.name: f.annotation for f in SAMPLING_FIELDS}
    for f in SAMPLING_FIELDS:
        default = f.default
        setattr(cls, f.name, field(default_factory=lambda d=default: list(d)) if f.kind is list else default)
    return dataclass(cls)


def validate_sampling(params: Any) -> None:
    """Raise NtxError naming the first field of ``params`` (any object with the table's
    attributes) that breaks its rule."""
    for f in SAMPLING_FIELDS:
        reason = f.check(getattr(params, f.name))
        if reason:
            raise NtxError(reason)


def from_wire(msg: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a generate map gives, as keyword arguments of SamplingParams (fields it
    leaves out take the table's defaults there)."""
    out = {f.name: msg[f.name] for f in SAMPLING_FIELDS if f.name in msg}
    if out.get("stop") is not None:
        out["stop"] = list(out["stop"])
    return out


def to_wire(params: Any) -> dict[str, Any]:
    """Every sampling field of ``params`` as a generate map's fields."""
    out = {f.name: getattr(params, f.name) for f in SAMPLING_FIELDS}
    out["stop"] = list(out["stop"])
    return out



def draw_seed() -> int:
    """A seed for a request that names none: from OS entropy, below 2**63 (so it is reported and
    replayed as any other)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@sampling_dataclass
class SamplingParams:
    """Per-request sampling settings: one field per row of ``SAMPLING_FIELDS`` (name, type,
    default, rule). ``temperature=0`` means greedy; ``top_k=0``, ``top_p=1``, ``min_p=0`` and
    ``repetition_penalty=1`` each switch their step off. ``stop`` is the front's (stop strings
    are matched on text, ``ctl/requests.py``); the engine draws tokens by the rest."""

    def validate(self) -> SamplingParams:
        """Raise NtxError naming the first bad field; returns self so calls can chain."""
        validate_sampling(self)
        return self
