"""What ``ntxctl chat`` reads from its user: messages for the model, slash commands and messages
of several lines.

A line that starts with ``/`` is a command and never reaches the model (a mistyped one included:
it gets one line naming the commands); ``//`` starts a message that begins with ``/``. A line
that starts with ``\"\"\"`` opens a message of several lines, which ends at a line that ends with
``\"\"\"`` (Ollama's convention: a pasted text needs nothing added to each of its lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BLOCK = '"""'
PROMPT = "> "
MORE_PROMPT = "... "  # inside a message of several lines
COMMANDS = {
    "/help": "this list",
    "/clear": "forget the conversation (the --system message stays)",
    "/exit": "end the chat (also /quit, or Ctrl-D)",
}
ALIASES = {"/quit": "/exit"}
HELP = "\n".join(
    [f"{name:7s} {what}" for name, what in COMMANDS.items()]
    + [f'{BLOCK}    a line that starts with {BLOCK} opens a message of several lines; a line that ends with {BLOCK} '
       "ends it",
       "//      a line that starts with // sends the rest of it after one /",
       "Ctrl-C  cancels the reply being written; the chat goes on"])


@dataclass(frozen=True)
class Turn:
    """One thing the user said: a message for the model (``text``), a command (``command``, one
    of ``COMMANDS``) or a line that is neither (``error``, one line to show them)."""

    text: str | None = None
    command: str | None = None
    error: str | None = None


def read_turn(read_line: Callable[[str], str] = input) -> Turn:
    """The user's next turn, read with ``read_line(prompt)`` (``input``); empty lines are passed
    over. EOFError (Ctrl-D, the end of piped input, inside a message of several lines too)
    passes through: the chat ends."""
    while True:
        line = read_line(PROMPT)
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith(BLOCK):
            text = _read_block(stripped[len(BLOCK):], read_line)
            if text.strip():
                return Turn(text=text)
            continue
        if stripped.startswith("//"):
            return Turn(text=stripped[1:])
        if stripped.startswith("/"):
            word = stripped.split()[0]
            word = ALIASES.get(word, word)
            if word in COMMANDS:
                return Turn(command=word)
            return Turn(error=f"unknown command {word[:40]}: the commands are {', '.join(COMMANDS)} (// starts a "
                              "message with /)")
        return Turn(text=line)


def _read_block(first: str, read_line: Callable[[str], str]) -> str:
    """The message of several lines whose first line (after the opening quotes) is ``first``,
    up to the line that ends with the closing quotes (that line's text before them included)."""
    if first.rstrip().endswith(BLOCK):
        return first.rstrip()[:-len(BLOCK)]
    lines = [first] if first else []
    while True:
        line = read_line(MORE_PROMPT)
        if line.rstrip().endswith(BLOCK):
            lines.append(line.rstrip()[:-len(BLOCK)])
            return "\n".join(lines).strip("\n")
        lines.append(line)
