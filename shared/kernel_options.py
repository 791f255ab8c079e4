"""Switches of the cuda backend's kernels, as configuration (``--kernels``).

They are part of an instance's configuration (``InstanceConfig.kernels``, shown by ``ntxctl
status`` and ``--plan-only``) and reach the backend through ``make_backend``; the cpu backend has
no such kernels and ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ntx.shared.errors import ConfigError

_ON_OFF = {"on": True, "off": False}


@dataclass(frozen=True)
class KernelOptions:
    """How the cuda backend launches its kernels. ``pdl``: programmatic dependent launch (a kernel
    starts while the one before it ends) where the device has it; ``pdl_matmul``: the same for the
    matmuls, which are otherwise launched after the kernel before them has ended."""

    pdl: bool = True
    pdl_matmul: bool = False

    @classmethod
    def parse(cls, text: str) -> KernelOptions:
        """``"pdl=off,pdl-matmul=on"`` -> KernelOptions; "" -> the defaults. One ConfigError line
        naming the bad item and the choices otherwise."""
        names = {f.name.replace("_", "-"): f.name for f in fields(cls)}
        values: dict[str, bool] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key not in names or not sep or value not in _ON_OFF:
                raise ConfigError(f"--kernels {text!r}: {item!r} is not NAME=on|off with NAME one of "
                                  f"{', '.join(names)} (example: pdl=off,pdl-matmul=on)")
            values[names[key]] = _ON_OFF[value]
        return cls(**values)

    def describe(self) -> str:
        """The switches as ``--kernels`` reads them: ``pdl=on,pdl-matmul=off``."""
        return ",".join(f"{f.name.replace('_', '-')}={'on' if getattr(self, f.name) else 'off'}" for f in fields(self))
