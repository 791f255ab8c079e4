"""``ntxctl --help`` as a person reads it, and README's command docs beside it: no value types
(``<str>``, ``<bool>``), descriptions that the terminal wraps, every option described, and every
option README names present in the command's help, with the defaults and choices README gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ntx.ctl import cli

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = typer.main.get_command(cli.app)
COMMANDS = dict(ROOT.commands)
# a group's commands (``ntxctl cluster up``) by their two words
SUBCOMMANDS = {f"{g} {n}": c for g, group in COMMANDS.items() for n, c in getattr(group, "commands", {}).items()}


def _help(*args: str, width: int = 200) -> str:
    r = CliRunner().invoke(cli.app, [*args, "--help"], env={"COLUMNS": str(width)})  # rich reads it
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("command", [""] + sorted(COMMANDS) + sorted(SUBCOMMANDS))
def test_help_shows_no_value_types(command):
    text = _help(*command.split(), width=100)
    assert not re.search(r"<(bool|str|int|float|path|list\[[a-z]+\])>", text), text
    assert not re.search(r"\b(TEXT|INTEGER|FLOAT|BOOLEAN)\b", text), text  # what older typer showed


def test_every_command_and_option_is_described():
    for name, command in {**COMMANDS, **SUBCOMMANDS}.items():
        assert (command.help or "").strip(), f"ntxctl {name} has no description"
        for p in command.params:
            if not getattr(p, "hidden", False):
                assert (p.help or "").strip(), f"ntxctl {name} {p.opts[0]} has no description"


def test_descriptions_are_paragraphs_the_terminal_wraps():
    """A description's lines are the terminal's, never the source's: each paragraph is one line
    of text, and in a wide terminal a description that goes on to a second line filled the first."""
    for name, command in COMMANDS.items():
        for paragraph in (command.help or "").split("\n\n"):
            assert "\n" not in paragraph, f"ntxctl {name}: a line break inside a paragraph of its help"
    panel = _help(width=200).split("─ Commands ")[1].split("╰")[0]
    rows = [ln.strip("│ ").rstrip() for ln in panel.splitlines() if ln.startswith("│ ")]
    assert len(rows) >= len(COMMANDS)
    for row, after in zip(rows, rows[1:]):
        if after and not re.match(r"^[a-z]+ ", after):  # ``row`` goes on in ``after``
            assert len(row) > 150, f"a description's line broke early: {row!r}"


# ---------------------------------------------------------------------------- README's command docs
def _readme_commands() -> list[tuple[str, str]]:
    """(command, its syntax with the comments left out) of each ``ntxctl`` entry of README's
    "Use" block (an entry goes on over the indented lines under it); command "" is ntxctl's own."""
    text = README.read_text()
    block = text[text.index("\n## Use"):].split("```")[1]
    entries: list[list[str]] = []
    for line in block.splitlines():
        syntax = re.split(r"\s#", " " + line, maxsplit=1)[0].strip()
        if line.startswith("ntxctl "):
            words = syntax.split()
            command = "" if words[1].startswith("-") else words[1]
            if f"{command} {words[2] if len(words) > 2 else ''}" in SUBCOMMANDS:
                command = f"{command} {words[2]}"
            entries.append([command, " ".join(words[len(command.split()) or 1:])])
        elif syntax and entries:
            entries[-1][1] += " " + syntax
    return [(c, s) for c, s in entries]


def _option_values(syntax: str) -> list[tuple[str, str | None]]:
    """(flag, the value README writes after it or None) for each option of ``syntax``."""
    tokens = [t.strip("[]") for t in syntax.split()]
    out = []
    for i, tok in enumerate(tokens):
        if re.fullmatch(r"--[a-z][a-z0-9-]*", tok):
            value = tokens[i + 1] if i + 1 < len(tokens) else ""
            out.append((tok, None if not value or value.startswith("-") or value == "|" else value.rstrip(".")))
    return out


def _is_placeholder(value: str) -> bool:
    """N, STR, KEY_SECRET, LIST, PROFILE[:N, ...: a value to fill in, not a value itself."""
    return value in ("", "...") or (re.search(r"[A-Z]", value) is not None and not re.search(r"[a-z]", value))


def _params(command: str) -> dict[str, object]:
    cmd = {**COMMANDS, **SUBCOMMANDS}[command] if command else ROOT
    ctx = cmd.make_context("ntxctl", [], resilient_parsing=True)
    return {opt: p for p in cmd.get_params(ctx) for opt in [*p.opts, *p.secondary_opts] if opt.startswith("--")}


def test_readme_and_help_agree():
    """Every option README's "Use" block names is an option of that command; where README gives
    choices (``a|b``) the option's default is one of them and each is in the option's help; where
    it gives a value and the option has a default, the value is that default."""
    entries = _readme_commands()
    assert {c for c, _ in entries} >= {"generate", "chat", "start", "bench", "status", "stop", ""}, entries
    problems = []
    for command, syntax in entries:
        if command and command not in COMMANDS and command not in SUBCOMMANDS:
            problems.append(f"README names `ntxctl {command}`, which is no command")
            continue
        params = _params(command)
        for flag, value in _option_values(syntax):
            where = f"README: ntxctl {command} {flag}".replace("  ", " ")
            p = params.get(flag)
            if p is None:
                problems.append(f"{where}: not an option of the command")
                continue
            default = p.default if not callable(p.default) else None
            has_default = default not in (None, "", False) and not getattr(p, "is_flag", False)
            if value is None or _is_placeholder(value):
                continue
            if "|" in value:
                choices = value.split("|")
                literal = [c for c in choices if not _is_placeholder(c)]
                for c in literal:
                    if c not in (p.help or "") and c != str(default):
                        problems.append(f"{where} {value}: {c!r} is not in the option's help")
                if has_default and str(default) not in choices and len(literal) == len(choices):
                    problems.append(f"{where} {value}: the default is {default!r}, not one of these")
            elif has_default and value != str(default):
                problems.append(f"{where} {value}: the default is {default!r}")
    assert not problems, "\n".join(problems)
