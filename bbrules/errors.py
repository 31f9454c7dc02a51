"""User-facing errors: a position in a file, a message, the offending line and a caret.

Every mistake in a user's program (.bbp), block program (.bbk), rule file (.bbr) or target
file raises `SourceError`; the CLI prints `str(err)` and exits with status 2.  Internal bugs
stay ordinary exceptions, so a traceback always means a bug in bbrules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Span:
    """A position in a source file; `line` and `column` count from 1."""

    path: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"


class SourceError(Exception):
    """A user mistake at a known position.  `text` is the file's content, for the caret."""

    def __init__(self, span: Span, message: str, text: str | None = None):
        super().__init__(message)
        self.span = span
        self.message = message
        self.text = text

    def __str__(self) -> str:
        head = f"{self.span}: error: {self.message}"
        text = self.text
        if text is None:
            try:
                text = Path(self.span.path).read_text()
            except OSError:
                return head
        lines = text.splitlines()
        if not 1 <= self.span.line <= len(lines):
            return head
        src = lines[self.span.line - 1]
        caret = " " * (max(self.span.column, 1) - 1) + "^"
        return f"{head}\n  {src}\n  {caret}"


class UsageError(Exception):
    """A mistake on the command line or in the environment with no file position (exit 2)."""
