"""The backends' kernel switches, as a value of the instance's configuration.

The cuda launch switches (pdl, pdl-matmul) change how kernels are launched, never what they
compute (tests/gpu/test_programmatic_launch.py holds the bits equal with and without);
batch-invariant changes which kernels and launch shapes the cuda backend chooses, so that a
row's result does not depend on how many rows share its pass. The cpu backend's
one chooses between its compiled kernels on the quantized weights and the float32 numpy reference
(which differ by the activations' int8 rounding; daemons/compute/cpu_kernels.py). They are
measured, not tuned per device: part of
the configuration an instance starts with (``ntxctl start --kernels``), shown by ``status``,
and handed to the backend (``make_backend(..., kernels=)``). No cupy here: the CLI and the
planner parse and show it on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ntx.shared.errors import ConfigError

__all__ = ["KernelOptions"]

_ON, _OFF = ("on", "true", "1", "yes"), ("off", "false", "0", "no")


@dataclass(frozen=True)
class KernelOptions:
    """The backends' kernel switches: part of the instance's configuration, shown by status."""

    pdl: bool = True  # programmatic dependent launch where the GPU has it (sm_90)
    pdl_matmul: bool = False  # the tensor-core matmuls launched early too (measured slower at 8-32 rows)
    cpu_quantized: bool = True  # cpu backend: numba kernels on the quantized weights (off: numpy float32)
    # cuda backend: every kernel that reduces over the hidden size or the context keeps one
    # reduction order per row whatever the pass's row count (tuning.batch_invariant), so a
    # row's logits do not depend on the rows beside it (docs/ARCHITECTURE.md, "Batch-invariant
    # mode"). Off: this form costs +56% a pass at batch 1 (8B, H100; invariant_fixed below about
    # 3% at 1-8 rows and 9-10% at 64; docs/PERFORMANCE.md, "The batch-invariant mode: its
    # cost"). The cpu backend is batch-invariant
    # either way (cpu_kernels.py): there it changes nothing.
    batch_invariant: bool = False
    # with batch_invariant: the block-quantized types take the i16 matvec at 1-8 rows and
    # matvec_rows (the matvec's order on the int8 tensor cores) past 8, instead of mmq / mm from
    # one row. Bitwise on the GPU like the default form; +0.9% a pass at batch 1 but +62% at 8
    # and +231% at 64 (8B, H100: matvec_rows is 6-10x mmq at 64 rows), so a batch-1 choice, not
    # the mode's one form (docs/PERFORMANCE.md, "The other way round"). Alone it is refused (parse).
    invariant_rows: bool = False
    # with batch_invariant: the K-quants' sums as 64-bit fixed point (daemons/compute/cuda/
    # fixed_point.py): each 256-column block's value in mmq's f32 steps, then integer sums, exact
    # in any order, so the matvec at 1-2 rows and mmq past them give a row the same bits and
    # each keeps its own speed; the other types as in the mode's form in use. Results within a
    # block's rounding to 2^-32 of the f32 sums. Alone, or with invariant-rows, it is refused.
    # The mode's cheapest form: about +3% a pass at 1-8 rows, +9-10% at 64 (8B Q4_K_M, H100).
    invariant_fixed: bool = False

    @classmethod
    def parse(cls, text: str) -> "KernelOptions":
        """``"pdl=off,pdl-matmul=on"`` (keys with ``-`` or ``_``, values on/off); ``""``: the
        defaults. A bad key or value raises ``ConfigError`` naming it and the choices."""
        keys = {f.name.replace("_", "-"): f.name for f in fields(cls)}
        values: dict[str, bool] = {}
        for item in (s.strip() for s in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip().lower().replace("_", "-")
            if key not in keys:
                raise ConfigError(f"--kernels: unknown switch {key!r} (choose from {', '.join(keys)})")
            value = value.strip().lower()
            if not sep or value not in _ON + _OFF:
                raise ConfigError(f"--kernels: {key}={value} must be {key}=on or {key}=off")
            values[keys[key]] = value in _ON
        got = cls(**values)
        for name, on in (("invariant-rows", got.invariant_rows), ("invariant-fixed", got.invariant_fixed)):
            if on and not got.batch_invariant:
                raise ConfigError(f"--kernels: {name}=on is a form of the batch-invariant mode; "
                                  "add batch-invariant=on")
        if got.invariant_rows and got.invariant_fixed:
            raise ConfigError("--kernels: invariant-rows=on and invariant-fixed=on are two forms of the "
                              "batch-invariant mode; choose one")
        return got

    def describe(self) -> str:
        """``"pdl=on,pdl-matmul=off"``: every switch, in the form ``parse`` reads (invariant-rows
        and invariant-fixed, forms of the batch-invariant mode, only with the mode on)."""
        shown = [f for f in fields(self) if f.name not in ("invariant_rows", "invariant_fixed") or self.batch_invariant]
        return ",".join(f"{f.name.replace('_', '-')}={'on' if getattr(self, f.name) else 'off'}" for f in shown)
