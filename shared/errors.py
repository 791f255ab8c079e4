"""Errors that reach the user as one clear line.

Every failure a user can cause (a bad file, a bad flag, a bad request) is raised as an
``NtxError`` whose ``str()`` is the whole message; the CLI prints it and exits non-zero, the
daemons turn it into an error reply. Anything else is a bug and may carry a traceback.
"""

from __future__ import annotations


class NtxError(Exception):
    """A problem the user can fix; ``str(err)`` is one line that names it."""


class ModelError(NtxError):
    """A model file (or split set) that cannot be used; the message starts with the path."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigError(NtxError):
    """A flag or setting that cannot be honoured."""
