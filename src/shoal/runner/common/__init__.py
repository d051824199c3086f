"""What every part of shoalrun shares: its error type, its exit codes, its one-line messages."""

from __future__ import annotations

import enum
import sys

from shoal.core.errors import ShoalError

__all__ = ["ExitCode", "LaunchError", "err"]


class LaunchError(ShoalError):
    """The command line or the environment asks for a job shoalrun cannot launch."""


class ExitCode(enum.IntEnum):
    """shoalrun's own exit codes; a failed worker's code is passed on as it is, and a signal N
    (to a local worker or to shoalrun) becomes 128 + N, as in a shell."""

    OK = 0
    ERROR = 1  # shoalrun itself failed after the job was planned
    USAGE = 2  # bad flag, variable, host list or hostfile: nothing was started
    START_TIMEOUT = 124  # some ranks never joined the rendezvous within --start-timeout
    CANNOT_START = 127  # a worker process could not be started at all


def err(message: str) -> None:
    """Print ``shoalrun: <message>`` on stderr."""
    print(f"shoalrun: {message}", file=sys.stderr, flush=True)
