"""Sleeping on a word of shared memory until another process changes it: Linux futexes.

A rank that waits for a peer on the same host would otherwise spin or yield, and on a core that
also computes (a training worker bound to its core: backward runs while the engine waits for
the peer's gradients) every spin and every ``sched_yield`` is time taken from the computation.
A futex sleeps in the kernel until the peer, having published its flag, wakes it.

The flag words are 64-bit; a futex compares 32 bits, the low half of the word on a
little-endian machine, which is all this module supports. Where futexes are unavailable
(another OS or architecture) :data:`AVAILABLE` is False and callers keep spinning and sleeping.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["AVAILABLE", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None or sys.byteorder != "little":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return call


_call = _syscall()
#: whether :func:`wait` sleeps in the kernel (else it returns at once and callers poll)
AVAILABLE = _call is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` (the low half of a flag word) equals the
    low 32 bits of ``expected``, at most ``timeout_s``; return at once if it differs.

    Returns on a wake, a change, the timeout or a signal alike: callers re-read the flag.
    """
    if _call is None:
        return
    whole = int(timeout_s)
    spec = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _call(_SYS_FUTEX, address, _FUTEX_WAIT, ctypes.c_int32(expected).value,
          ctypes.addressof(spec), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping in :func:`wait` on the word at ``address``."""
    if _call is not None:
        _call(_SYS_FUTEX, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
