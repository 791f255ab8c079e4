"""Errors that reach the user as one clear line.

Every failure a user can cause (a bad file, a bad flag, a bad request) is raised as an
``NtxError`` whose ``str()`` is the whole message; the CLI prints it and exits non-zero, the
daemons turn it into an error reply. Anything else is a bug and may carry a traceback.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable (controls, line and paragraph
    separators, bidi overrides) written as its escape (``\\x1b``, ``\\n``, ``\\u202e``).

    Messages quote what users and files say (paths, tensor names, metadata); a quoted ANSI escape
    or newline must not recolour a terminal or forge a second line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class NtxError(Exception):
    """A problem the user can fix; ``str(err)`` is one line that names it, with anything
    unprintable it quotes escaped (``printable``)."""

    def __str__(self) -> str:
        return printable(super().__str__())


class ModelError(NtxError):
    """A model file (or split set) that cannot be used; the message starts with the path."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigError(NtxError):
    """A flag or setting that cannot be honoured."""
