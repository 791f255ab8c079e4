"""The configuration record (``shared/config.py``: ``InstanceConfig``, ``EngineOptions``) and the
ntxctl options made from it: ``start`` and ``serve`` take the same options, each a field of the
same name with the field's default; an option's text reads into the record's value; every rule
is one line naming the option; the record crosses the wire whole or not at all; ``--ring-slots``
(and the deprecated ``--slots``) and ``--kernels`` as a user gives them."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import typer
from typer.testing import CliRunner

from ntx.ctl import cli
from ntx.shared.config import EngineOptions, InstanceConfig, cli_option
from ntx.shared.errors import ConfigError, NtxError

from .pipeline_util import own_instance


def _params(command: str) -> dict[str, object]:
    """The click parameters of ``ntxctl COMMAND``, by name."""
    return {p.name: p for p in typer.main.get_command(cli.app).commands[command].params}


def test_start_and_serve_take_the_same_options_each_a_field_of_the_record():
    start, serve = _params("start"), _params("serve")
    assert {n: (p.opts, p.default, p.hidden) for n, p in start.items()} == \
           {n: (p.opts, p.default, p.hidden) for n, p in serve.items()}
    fields = InstanceConfig.options()
    assert set(start) - {f.name for f in fields} == {"plan_only", "api_key", "ring_slots__as_slots"}
    for f in fields:
        spec = cli_option(f)
        assert start[f.name].opts[0] == "--" + f.name.replace("_", "-")
        assert start[f.name].help == spec.help
        if spec.read is None and f.default is not dataclasses.MISSING:
            assert start[f.name].default == f.default, f.name  # the record's default is the option's


def test_every_option_text_default_reads_as_the_record_default():
    """An option's default as the command line holds it (``auto`` for no width, nothing given
    for a size) is the record's default once read, so the two cannot drift apart."""
    given = {f.name: cli_option(f).default_text(f) for f in InstanceConfig.options() if f.name not in ("model", "backend")}
    record = InstanceConfig(model="m", **cli.read_record(given))
    assert record == InstanceConfig(model="m")


def test_option_texts_read_into_record_values(tmp_path, smollm2_path):
    replay = tmp_path / "replay.json"
    replay.write_text('{"sequences": [[1, 2, 3]]}')
    values = cli.read_record({"vram_budget": "1GiB", "draft_width": "3", "self_draft": "0-2,5",
                              "self_draft_skip": "13-14", "draft_replay": str(replay), "curve_clients": "keys",
                              "backend": "cpu", "ring_slots": 3}, str(smollm2_path))
    assert values == {"vram_budget": 1 << 30, "draft_width": 3, "self_draft": [0, 1, 2, 5], "self_draft_skip": [13, 14],
                      "draft_replay": str(replay), "curve_clients": str(tmp_path.cwd() / "keys"), "backend": "cpu",
                      "ring_slots": 3}
    assert cli.read_record({"self_draft": "all", "draft_width": "auto"}) == {"self_draft": True, "draft_width": None}
    with pytest.raises(ConfigError, match=r"^--draft-width 'wide': give auto or a whole number$"):
        cli.read_record({"draft_width": "wide"})
    with pytest.raises(NtxError, match=r"^--self-draft-skip 0-40: the model has layers 0 to 29"):
        cli.read_record({"self_draft_skip": "0-40"}, str(smollm2_path))


@pytest.mark.parametrize("change, says", [
    (dict(ring_slots=1), "--ring-slots 1: need between 2 and 64 slots"),
    (dict(io="fast"), "--io 'fast': choose auto, direct, buffered or mmap"),
    (dict(ctx=8), "--ctx 8: must be at least 16"),
    (dict(max_batch=0), "--max-batch 0: must be at least 1"),
    (dict(gpu_layers=-1), "--gpu-layers -1: must be 0 or more"),
    (dict(placement="middle"), "--placement 'middle': choose spread or first"),
    (dict(backend="tpu"), "--backend 'tpu': choose cuda or cpu"),
    (dict(draft_tokens=513), "--draft-tokens 513: choose 1 to 512"),
    (dict(draft_tokens=4, draft_width=5), r"--draft-width 5: choose auto or 1 to --draft-tokens \(4\)"),
    (dict(draft_model="d.gguf", self_draft=True), "choose one drafter: --self-draft or --draft-model, not both"),
    (dict(draft_model="d.gguf", self_draft_skip=[3]), "choose one drafter"),  # the skip list implies a self-draft
    (dict(draft_replay_p=1.5), "--draft-replay-p 1.5: a probability, from 0 to 1"),
    (dict(kernels="pdl=maybe"), "--kernels 'pdl=maybe': 'pdl=maybe' is not NAME=on|off"),
    (dict(log_level="loud"), "--log-level 'loud': choose debug, info, warning, error"),
    (dict(listen="tcp://0.0.0.0:5555"), "--listen tcp://0.0.0.0:5555: other machines can reach it"),
])
def test_each_rule_is_one_line_naming_the_option(change, says):
    with pytest.raises(ConfigError, match="^" + says) as e:
        InstanceConfig(model="m", **change).validate()
    assert "\n" not in str(e.value)


def test_the_engine_rules_hold_for_engine_options_alone():
    """``build_engine`` validates its options: the same rules, without an instance's."""
    with pytest.raises(ConfigError, match="^--draft-tokens 0: choose 1 to 512"):
        EngineOptions(draft_tokens=0).validate()
    assert EngineOptions(ctx=3).validate().ctx == 3  # perplexity's short chunks: --ctx >= 16 is an instance's rule
    assert EngineOptions(ctx=9000).for_model(2048).ctx == 2048
    assert EngineOptions(self_draft_skip=[]).drafts_itself  # a profile that names no layer still self-drafts


def test_the_record_crosses_the_wire_whole():
    cfg = InstanceConfig(model="m.gguf", ring_slots=3, self_draft=[0, 1], self_draft_skip=[1], kernels="pdl=off")
    assert InstanceConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="^InstanceConfig: unknown keys slots: written by another version of ntx"):
        InstanceConfig.from_dict({**cfg.to_dict(), "slots": 3})
    d = cfg.to_dict()
    del d["io"], d["kernels"]
    with pytest.raises(ConfigError, match="^InstanceConfig: missing keys io, kernels: "):
        InstanceConfig.from_dict(d)


def _run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ntxctl", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_gpu_layers_minus_one_means_all_layers(monkeypatch, capsys, smollm2_path, run_dir):
    """As llama.cpp's -ngl -1: every layer that fits, the same plan as all and as no option."""
    assert cli.read_record({"gpu_layers": "-1"}) == cli.read_record({"gpu_layers": "all"}) == {"gpu_layers": None}
    assert cli.read_record({"gpu_layers": "7"}) == {"gpu_layers": 7}
    base = ("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", *own_instance("ngl"))
    plans = [_run(monkeypatch, capsys, *base, *flags) for flags in (("--gpu-layers", "-1"), ("--gpu-layers", "all"), ())]
    assert all(code == 0 and err == "" for code, _, err in plans), plans
    labels = ("compute memory", "pinned RAM", "storage")  # the tier lines' labels on the cpu backend
    tiers = [[(label, ln.strip()[len(label):].split()[:2]) for ln in out.splitlines() for label in labels
              if ln.strip().startswith(label + " ")]
             for _, out, _ in plans]  # (the budget lines follow the machine's free memory, run to run)
    assert tiers[0] == tiers[1] == tiers[2] == [("compute memory", ["30", "layers"]), ("pinned RAM", ["0", "layers"]),
                                                ("storage", ["0", "layers"])], plans
    code, out, err = _run(monkeypatch, capsys, *base, "--gpu-layers", "-2")
    assert code == 1 and err == "ntxctl: error: --gpu-layers '-2': give a whole number of layers, or all (-1)\n"


def test_ctx_beyond_the_trained_context_is_refused(monkeypatch, capsys, smollm2_path, run_dir):
    base = ("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", *own_instance("ctx"))
    code, out, err = _run(monkeypatch, capsys, *base, "--ctx", "100000")
    assert code == 1 and out == "" and err == ("ntxctl: error: --ctx 100000: longer than the 8192 positions the model "
                                               "was trained for; give --ctx 8192 or less, or leave it out\n"), err
    code, out, err = _run(monkeypatch, capsys, *base, "--ctx", "8192")
    assert code == 0 and err == ""


def test_plan_only_shows_ring_slots_and_kernels_and_slots_still_works(monkeypatch, capsys, smollm2_path, run_dir):
    base = ("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", "--gpu-layers", "2",
            *own_instance("slots"))
    code, out, err = _run(monkeypatch, capsys, *base, "--ring-slots", "3", "--kernels", "pdl-matmul=on")
    assert code == 0 and err == "", err
    assert "3 slots of 2.12 MiB" in out and "  kernels pdl=on,pdl-matmul=on,cpu-quantized=on,batch-invariant=off\n" in out
    code, out, err = _run(monkeypatch, capsys, *base, "--slots", "3")
    assert code == 0 and "3 slots of 2.12 MiB" in out and "  kernels pdl=on,pdl-matmul=off,cpu-quantized=on,batch-invariant=off\n" in out
    assert err == "ntxctl: warning: --slots is deprecated: use --ring-slots\n"
    assert "--slots" not in CliRunner().invoke(cli.app, ["start", "--help"]).output  # hidden
    code, out, err = _run(monkeypatch, capsys, *base, "--kernels", "pdl=of")
    assert code == 1 and out == "" and err.startswith("ntxctl: error: --kernels: pdl=of must be ") and err.count("\n") == 1


def test_the_plan_says_when_a_setting_makes_speed_fall(monkeypatch, capsys, smollm2_path, run_dir):
    """--plan-only (and start, which prints the same plan) names the setting that streams layers
    and what it costs a pass; with every layer resident it says nothing of the kind."""
    base = ("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", *own_instance("slower"))
    code, out, err = _run(monkeypatch, capsys, *base)
    assert code == 0 and "  compute memory   30 layers" in out and "slower" not in out, out + err
    code, out, err = _run(monkeypatch, capsys, *base, "--gpu-layers", "10")
    assert code == 0, err
    assert ("\n  slower: --gpu-layers 10 streams 20 layers that fit the budget: 42.28 MiB more to move every pass\n"
            "  slower: on the cpu backend a streamed layer is also dequantized again on every pass\n") in out, out
