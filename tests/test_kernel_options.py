"""The cuda backend's kernel switches as configuration (shared/kernel_options.py): parsed from
the ``--kernels`` text, shown as text that parses back, bad input one line naming the key and
the choices. No GPU or cupy needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ntx.shared.errors import ConfigError
from ntx.shared.kernel_options import KernelOptions


def test_defaults_and_empty_text():
    assert KernelOptions.parse("") == KernelOptions() == KernelOptions(pdl=True, pdl_matmul=False)
    assert KernelOptions.parse(" , ") == KernelOptions()
    assert KernelOptions().describe() == "pdl=on,pdl-matmul=off,cpu-quantized=on,batch-invariant=off"


@pytest.mark.parametrize("text,want", [
    ("pdl=off", KernelOptions(pdl=False)),
    ("pdl-matmul=on", KernelOptions(pdl_matmul=True)),
    ("cpu-quantized=off", KernelOptions(cpu_quantized=False)),
    ("batch-invariant=on", KernelOptions(batch_invariant=True)),
    ("batch_invariant=1,pdl=off", KernelOptions(batch_invariant=True, pdl=False)),
    ("pdl_matmul=ON, pdl=0", KernelOptions(pdl=False, pdl_matmul=True)),
    ("pdl=true,pdl=no", KernelOptions(pdl=False)),  # the last one wins
])
def test_parse(text, want):
    assert KernelOptions.parse(text) == want


@pytest.mark.parametrize("opts", [KernelOptions(), KernelOptions(pdl=False), KernelOptions(pdl=False, pdl_matmul=True),
                                  KernelOptions(batch_invariant=True)])
def test_describe_round_trips(opts):
    assert KernelOptions.parse(opts.describe()) == opts


@pytest.mark.parametrize("text,message", [
    ("dp4a=on", "unknown switch 'dp4a' (choose from pdl, pdl-matmul, cpu-quantized, batch-invariant, invariant-rows, invariant-fixed)"),
    ("pdl=maybe", "pdl=maybe must be pdl=on or pdl=off"),
    ("pdl", "pdl= must be pdl=on or pdl=off"),
])
def test_bad_input_is_one_line_naming_the_key_and_the_choices(text, message):
    with pytest.raises(ConfigError) as err:
        KernelOptions.parse(text)
    assert str(err.value) == f"--kernels: {message}" and "\n" not in str(err.value)


def test_frozen_and_importable_without_cupy():
    with pytest.raises(Exception):
        KernelOptions().pdl = False  # type: ignore[misc]
    code = "import sys; sys.modules['cupy'] = None\nimport ntx.shared.kernel_options"
    subprocess.run([sys.executable, "-c", code], check=True)
