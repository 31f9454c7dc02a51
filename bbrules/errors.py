"""User-facing errors: a position in a file, a message, the offending line and a caret.

Every mistake in a user's program (.bbp), block program (.bbk), rule file (.bbr) or target
file raises `SourceError` (`syntax_error` makes one of a lark parse error); the CLI prints
`str(err)` and exits with status 2.  Internal bugs stay ordinary exceptions, so a traceback
always means a bug in bbrules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lark import Lark, UnexpectedCharacters, UnexpectedInput
from lark.lexer import PatternStr


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
                text = Path(self.span.path).read_text(errors="replace")
            except OSError:
                return head
        lines = text.splitlines()
        if not 1 <= self.span.line <= len(lines):
            return head
        src = lines[self.span.line - 1]
        caret = " " * (max(self.span.column, 1) - 1) + "^"
        return f"{head}\n  {src}\n  {caret}"


def syntax_error(err: UnexpectedInput, parser: Lark, text: str, path: str,
                 words: Mapping[str, str], character: str = "{!r}") -> SourceError:
    """A lark parse error in `text` as "syntax error: unexpected X; expected one of ...".

    `words` names terminals ("NAME": "a name", a newline terminal "end of line"); any other
    terminal is shown as its literal text.  `character` formats an unexpected character.
    What was expected is found by replaying the text before the error, which gives every
    terminal that may continue it: the sets lark attaches to its errors come from its lexer
    (which folds keywords into NAME) or from the state after the reductions the unexpected
    token forced.  At a newline, the end of a statement in a line-based grammar, that reduced
    state is the one to report: what may follow the expression the line reduced to.
    """
    accepts = None
    if isinstance(err, UnexpectedCharacters):
        pos, line, column = err.pos_in_stream, err.line, err.column
        found = character.format(text[pos])
    elif getattr(err, "token", None) is None or err.token.type == "$END":
        found, pos = "end of file", len(text)
        line, column = _end_position(text)
    else:
        token = err.token
        pos, line, column = token.start_pos, err.line, err.column
        found = repr(str(token))
        if not str(token).strip():
            found, accepts = words[token.type], err.accepts or err.expected
    if accepts is None:
        accepts = _replayed_accepts(parser, text, pos)
    expected = sorted({_describe(parser, words, t) for t in accepts})
    message = f"syntax error: unexpected {found}"
    if expected:
        choice = expected[0] if len(expected) == 1 else "one of " + ", ".join(expected)
        message += f"; expected {choice}"
    return SourceError(Span(path, line, column), message, text)


def _describe(parser: Lark, words: Mapping[str, str], terminal: str) -> str:
    word = words.get(terminal.rsplit("__", 1)[-1])  # an imported terminal is `expr__NAME`
    if word:
        return word
    pattern = parser.get_terminal(terminal).pattern
    return repr(pattern.value) if isinstance(pattern, PatternStr) else terminal


def _end_position(text: str) -> tuple[int, int]:
    """Just after the last non-blank character: where a truncated file needs more."""
    lines = text.rstrip().split("\n")
    return len(lines), len(lines[-1]) + 1


def _replayed_accepts(parser: Lark, text: str, pos: int) -> set[str]:
    """The terminals the parser accepts after `text[:pos]`."""
    replay = parser.parse_interactive(text[:pos])
    try:
        replay.exhaust_lexer()
    except UnexpectedInput:
        return set()
    return replay.accepts()


class UsageError(Exception):
    """A mistake on the command line or in the environment with no file position (exit 2)."""


def read_source(path: str | Path, what: str = "file") -> str:
    """The text of a user's input file; bytes that are not UTF-8 are a `SourceError` at the
    first of them, an unreadable file a `UsageError` (`what` names the file in its message)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read {what} {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[:err.start].decode("utf-8")
        line = before.count("\n") + 1
        column = len(before) - (before.rfind("\n") + 1) + 1
        text = data.decode("utf-8", errors="replace")
        raise SourceError(Span(str(path), line, column),
                          f"byte 0x{data[err.start]:02x} is not UTF-8 text", text) from None
