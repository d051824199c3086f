"""shoalrun's terminal: the workers' lines, tagged, and one live status line.

A worker that redraws a line with carriage returns (a progress bar: ``\\r`` then the new
text, no newline) would otherwise reach shoalrun's output only when a newline finally comes.
When shoalrun's stdout or stderr is a terminal, its workers are told (``SHOALRUN_TTY=1``, and
``COLUMNS`` = the width left after the tag), and such a redrawn segment is shown as the
status line at the bottom: erased before any other line is written, then drawn again below
it. A blank redraw (a bar closing) removes it. Output to files and pipes stays line by line
(no status line; a ``\\r`` inside a line is passed on as it is).
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["TAG_WIDTH", "StatusLine", "split_segments", "terminal", "worker_tty_env"]

#: Room left for a worker's tag (``[12]<stderr>: ``) when telling it the terminal's width.
TAG_WIDTH = 16
_CLEAR = b"\r\x1b[K"
_BREAK = re.compile(rb"\r\n|\n|\r")


def terminal() -> bool:
    """Whether shoalrun writes to a terminal (its stdout and stderr both are one)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def worker_tty_env() -> dict[str, str]:
    """What workers are told when shoalrun is on a terminal: ``SHOALRUN_TTY=1`` and the width
    their lines have after the tag (``COLUMNS``); nothing otherwise."""
    if not terminal():
        return {}
    columns = shutil.get_terminal_size((100, 24)).columns
    return {"SHOALRUN_TTY": "1", "COLUMNS": str(max(40, columns - TAG_WIDTH))}


def split_segments(buf: bytes, final: bool = False) -> tuple[list[tuple[bytes, bool]], bytes]:
    """Complete segments of ``buf`` as ``(text, is a line)`` (a line ends with ``\\n``, a
    redraw with a lone ``\\r``), and the rest. A ``\\r`` at the very end waits for the next
    bytes (it may start ``\\r\\n``) unless ``final``."""
    out: list[tuple[bytes, bool]] = []
    start = 0
    for m in _BREAK.finditer(buf):
        if m.group() == b"\r" and m.end() == len(buf) and not final:
            break
        out.append((buf[start:m.start()], m.group() != b"\r"))
        start = m.end()
    return out, buf[start:]


class StatusLine:
    """The one status line of a terminal; every write goes through :meth:`line` or
    :meth:`status` under its lock."""

    def __init__(self, lock: threading.Lock, write: Callable[[IO[str], bytes], None]) -> None:
        self.lock, self._write = lock, write
        self._out: IO[str] | None = None
        self._text = b""

    def _erase(self) -> None:
        if self._text and self._out is not None:
            self._write(self._out, _CLEAR)

    def line(self, out: IO[str], data: bytes) -> None:
        """Write the complete line ``data`` above the status line (caller holds the lock)."""
        self._erase()
        self._write(out, data)
        if self._text and self._out is not None:
            self._write(self._out, self._text)

    def status(self, out: IO[str], text: bytes) -> None:
        """Show ``text`` (tagged, no newline) as the status line; blank text removes it
        (caller holds the lock)."""
        self._erase()
        if not text.strip(b" \t\r[]<>:0123456789stdoerr"):
            self._text, self._out = b"", None
            return
        self._text, self._out = _CLEAR + text, out
        self._write(out, self._text)
