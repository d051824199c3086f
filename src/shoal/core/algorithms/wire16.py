"""Half-precision sums and averages over TCP on a 16-bit wire, accumulated in float32.

Every hop between ranks carries 16-bit words (half the bytes of float32) while every sum is
formed in float32: a rank widens what arrives, adds it to its float32 accumulator, and rounds
only what it sends on. So a partial sum is rounded once per hop and never summed in 16 bits.

- **Averages** are divided before the wire (the accumulator starts as ``x / n``), so every
  partial sum is an average of some ranks' values and stays within the inputs' range: two
  ranks' 40000.0 average to 40000.0 in float16, where a float16 sum would be inf.
- **bfloat16 sums** always take the 16-bit wire: bfloat16 has float32's range.
- **float16 sums** could overflow on the way (65504 is float16's largest number). The ranks
  agree per fused buffer before any data moves (:func:`choose`): each contributes the largest
  finite magnitude of its buffer, and the 16-bit wire is taken only if their total (a bound on
  every partial sum), with room for the rounding of each hop, stays below 65504; else the
  buffer crosses as float32, as it would without compression. NaN and inf are ignored in the
  bound: they make the result NaN or inf whatever the wire. Every rank computes the choice from
  the same gathered numbers, so every rank picks the same wire.

The ring (:func:`allreduce` above ``SHOAL_SMALL_MESSAGE_BYTES``) reduce-scatters with each
segment sent narrowed and added wide, then the owner of each segment rounds its result once and
the 16-bit results are allgathered: every rank ends with the same bits. Recursive doubling
(small messages) rounds symmetrically: both partners add the 16-bit forms of the two
accumulators, so both hold the same sum.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from ..compression import storage_dtype
from ..reduction import ReduceOp, narrow, widen
from ..transport import Transport
from .doubling import doubling_rounds

__all__ = ["FLOAT16_MAX", "allreduce", "choose", "reducescatter"]

FLOAT16_MAX = 65504.0
_HALF = ("float16", "bfloat16")
_BOUND = struct.Struct("<d")


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.view(np.uint8))


def applies(op: ReduceOp, wire: str) -> bool:
    """A half-precision sum or average: the kinds this module carries."""
    return wire in _HALF and op in (ReduceOp.SUM, ReduceOp.AVERAGE)


def _largest(arrays: Sequence[np.ndarray], dtype: str) -> float:
    """The largest finite magnitude in ``arrays`` (words of ``dtype`` or plain numbers)."""
    best = 0.0
    for a in arrays:
        if not a.size:
            continue
        v = np.abs(widen(a, dtype))
        v = v[np.isfinite(v)]
        if v.size:
            best = max(best, float(v.max()))
    return best


def choose(transport: Transport, arrays: Sequence[np.ndarray], dtype: str, op: ReduceOp,
           wire: str, what: str) -> str:
    """The wire of a half-precision reduction over TCP: ``wire`` (16-bit) or ``float32``.
    ``arrays`` are this rank's inputs (of ``dtype``, before any compression); a float16 sum
    gathers every rank's largest magnitude first (one small round), everything else decides
    alone. Call it on every rank of the job, for the same buffer."""
    if wire == "bfloat16" or op == ReduceOp.AVERAGE:
        return wire
    mine = _BOUND.pack(_largest(arrays, dtype))
    bound = sum(_BOUND.unpack(b)[0] for b in transport.gather_all(mine, f"{what} (its wire)"))
    # each hop rounds a partial sum by at most half a unit in the last place (2^-11)
    room = 1.0 + transport.size * 2.0 ** -11
    return wire if bound * room <= FLOAT16_MAX else "float32"


def start(values: np.ndarray, dtype: str, op: ReduceOp, count: int) -> np.ndarray:
    """The float32 accumulator of ``values`` (words of ``dtype``): an average divided now."""
    acc = widen(values, dtype)
    if op == ReduceOp.AVERAGE and count > 1:
        np.divide(acc, count, out=acc)
    return acc


def allreduce(transport: Transport, group: Sequence[int], acc: np.ndarray, out: np.ndarray,
              wire: str, what: str) -> None:
    """Sum the float32 ``acc`` over ``group`` with 16-bit words of ``wire`` on the wire; the
    rounded result lands in ``out`` (storage of ``wire``, same length), alike on every rank.
    ``acc`` is scratch."""
    n = len(group)
    if n == 1:
        narrow(acc, out, wire)
    elif acc.nbytes // 2 <= transport.cfg.small_message_bytes:
        _doubling(transport, group, acc, out, wire, what)
    else:
        _ring(transport, group, acc, out, wire, what)


def _pass(transport: Transport, right: int, left: int, send: np.ndarray, dst: np.ndarray,
          words: np.ndarray, wire: str, what: str) -> None:
    """One ring step: float32 ``send`` goes right as 16-bit words while the left neighbour's
    words arrive and are added, widened, into float32 ``dst`` as they come. ``words``: two
    scratch rows of 16-bit words, at least a segment long (what goes, what comes)."""
    out = words[0, :send.size]
    narrow(send, out, wire)
    incoming = words[1, :dst.size]
    block = max(1, transport.cfg.tcp_chunk_bytes // 2)
    done_items = 0

    def on_recv(_i: int, done: int, total: int) -> None:
        nonlocal done_items
        ready = done // 2
        if ready - done_items >= block or done == total:
            dst[done_items:ready] += widen(incoming[done_items:ready], wire)
            done_items = ready

    transport.exchange([(right, _bytes(out))], [(left, _bytes(incoming))], on_recv=on_recv,
                       what=what)


def _ring(transport: Transport, group: Sequence[int], acc: np.ndarray, out: np.ndarray,
          wire: str, what: str) -> None:
    n = len(group)
    me = list(group).index(transport.rank)
    right, left = group[(me + 1) % n], group[(me - 1) % n]
    bounds = [acc.size * i // n for i in range(n + 1)]
    words = np.empty((2, max(bounds[i + 1] - bounds[i] for i in range(n))), out.dtype)
    for step in range(n - 1):
        s, d = (me - step) % n, (me - step - 1) % n
        _pass(transport, right, left, acc[bounds[s]:bounds[s + 1]],
              acc[bounds[d]:bounds[d + 1]], words, wire, what)
    owned = (me + 1) % n
    narrow(acc[bounds[owned]:bounds[owned + 1]], out[bounds[owned]:bounds[owned + 1]], wire)
    for step in range(n - 1):
        s, d = (me - step + 1) % n, (me - step) % n
        transport.exchange([(right, _bytes(out[bounds[s]:bounds[s + 1]]))],
                           [(left, _bytes(out[bounds[d]:bounds[d + 1]]))], what=what)


def _doubling(transport: Transport, group: Sequence[int], acc: np.ndarray, out: np.ndarray,
              wire: str, what: str) -> None:
    theirs = np.empty_like(out)

    def outgoing() -> np.ndarray:
        narrow(acc, out, wire)  # what goes out is also what this rank adds of its own
        return out

    def fold() -> None:
        acc[:] += widen(theirs, wire)

    def combine() -> None:
        np.add(widen(out, wire), widen(theirs, wire), out=acc)

    doubling_rounds(transport, group, outgoing, theirs, out, fold, combine,
                    lambda: narrow(acc, out, wire), what)


def reducescatter(transport: Transport, group: Sequence[int], acc: np.ndarray,
                  bounds: Sequence[int], wire: str, what: str) -> np.ndarray:
    """Reduce-scatter the float32 ``acc`` in place around ``group`` with 16-bit words on the
    wire; returns this rank's block, still float32 (its caller rounds it once)."""
    n = len(group)
    me = list(group).index(transport.rank)
    if n > 1:
        right, left = group[(me + 1) % n], group[(me - 1) % n]
        words = np.empty((2, max(bounds[i + 1] - bounds[i] for i in range(n))),
                         storage_dtype(wire))
        for step in range(n - 1):
            s, d = (me - step - 1) % n, (me - step - 2) % n
            _pass(transport, right, left, acc[bounds[s]:bounds[s + 1]],
                  acc[bounds[d]:bounds[d + 1]], words, wire, what)
    return acc[bounds[me]:bounds[me + 1]]
