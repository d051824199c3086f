"""The negotiator: every rank's proposal in, one decision out, the same on every rank.

A *proposal* is what one rank has pending, in a compact wire format: a header (bit-vector
bytes, cache size, flags), a bit per cached name it proposes, then the names it proposes in
full (name, description, per-rank extra) as JSON. :func:`decide` is a pure function of the
gathered proposals and the name cache: no threads, sockets or engine state, so every rank,
given the same proposals and the same cache, computes the same :class:`Decision`: the names
to run now (in cache order), names the ranks disagree on (refused with the error to raise),
names new to the cache, and what each pending request still waits for. The engine applies
it (:mod:`.loop`).

Cached names are compared as bit vectors (one vectorised AND), so the steady-state cost does
not grow with the number of tensors in Python; only new or changed names are compared one by
one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError, ShoalError
from .requests import mismatch_message

__all__ = ["FAST", "HEAD", "JOINED", "STUCK", "Decision", "decide", "encode"]

HEAD = struct.Struct("!qqB")  # bit-vector bytes, cache size, flags
#: flags: waited past stall_warning_s; this rank has called join(); a payload rides along
STUCK, JOINED, FAST = 1, 2, 4
_EMPTY = b"[]"


def encode(bits: np.ndarray, new: Sequence[Sequence[Any]], flags: int) -> bytes:
    """A proposal: ``bits`` (one bool per cached name, the cache's size), the ``new``
    ``[name, desc, extra]`` entries, ``flags``."""
    packed = np.packbits(bits).tobytes()
    tail = json.dumps(list(new)).encode() if new else _EMPTY
    return HEAD.pack(len(packed), len(bits), flags) + packed + tail


@dataclass
class Decision:
    """What every rank does after a round (see :func:`decide`)."""

    order: list[str]  # the names that run now, in cache order
    extras: dict[str, dict[int, Any]] = field(default_factory=dict)  # name -> rank -> extra
    refused: dict[str, CollectiveMismatchError] = field(default_factory=dict)
    fresh: list[tuple[str, str]] = field(default_factory=list)  # (name, desc) to append
    adopted: dict[str, str] = field(default_factory=dict)  # cached names every rank changed
    joined: list[int] = field(default_factory=list)  # ranks that have called join()
    missing: dict[str, tuple[int, ...]] = field(default_factory=dict)  # pending -> ranks
    ran_ids: np.ndarray | None = None  # cache ids of ``order`` (after ``fresh``)


def decide(blobs: Sequence[bytes], by_id: Sequence[str],
           cache: Mapping[str, tuple[int, str]], *, rank: int, pending: Sequence[str],
           stall_warning_s: float) -> Decision:
    """The decision of one round from every rank's proposal (``blobs``, by rank), given the
    name cache (``by_id``: names by id; ``cache``: name -> (id, desc)) and this rank's
    ``pending`` names. Raises ShoalError when a rank's cache is out of step (a bug)."""
    size = len(blobs)
    n_cached = len(by_id)
    flags = [HEAD.unpack_from(blob)[2] for blob in blobs]
    joined = [r for r, f in enumerate(flags) if f & JOINED]
    if not joined and blobs[0][-2:] == _EMPTY and blobs.count(blobs[0]) == size:
        # steady state: every rank proposes the same cached set
        nbytes, _, _ = HEAD.unpack_from(blobs[0])
        ids = np.flatnonzero(np.unpackbits(np.frombuffer(blobs[0], np.uint8, nbytes,
                                                         HEAD.size), count=n_cached))
        return Decision([by_id[i] for i in ids], ran_ids=ids)
    bits = np.zeros((size, n_cached), bool)
    present: dict[str, dict[int, str]] = {}
    extras: dict[str, dict[int, Any]] = {}
    stuck = [bool(f & STUCK) for f in flags]
    active = [r for r in range(size) if r not in joined]
    for r, blob in enumerate(blobs):
        nbytes, their_size, _ = HEAD.unpack_from(blob)
        if their_size != n_cached:
            raise ShoalError(f"rank {rank}: negotiation cache out of step with rank {r} "
                             f"({their_size} vs {n_cached} entries); this is a bug")
        if n_cached:
            bits[r] = np.unpackbits(np.frombuffer(blob, np.uint8, nbytes, HEAD.size),
                                    count=n_cached).astype(bool)
        tail = blob[HEAD.size + nbytes:]
        if tail != _EMPTY:
            for name, desc, extra in json.loads(tail):
                present.setdefault(name, {})[r] = desc
                extras.setdefault(name, {})[r] = extra
    ready = [by_id[i] for i in np.flatnonzero(bits[active].all(axis=0))] \
        if n_cached and active else []
    fresh: list[str] = []
    adopted: dict[str, str] = {}
    refused: dict[str, CollectiveMismatchError] = {}
    for name, descs in present.items():
        cached = cache.get(name)
        if cached is not None:  # proposed as a bit by the ranks whose desc is unchanged
            for r in np.flatnonzero(bits[:, cached[0]]):
                descs[int(r)] = cached[1]
        if not set(active) <= descs.keys() or not active:
            continue
        if len(set(descs.values())) > 1:
            refused[name] = CollectiveMismatchError(
                f"rank {rank}: " + mismatch_message(repr(name), descs), descs)
            continue
        if cached is None:
            fresh.append(name)
        else:
            ready.append(name)
            adopted[name] = descs[active[0]]  # every rank changed it: the cache adopts it
    fresh.sort()
    ids = {name: cache[name][0] for name in ready}
    ids.update({name: n_cached + i for i, name in enumerate(fresh)})
    fresh_descs = [(nm, present[nm][active[0]]) for nm in fresh]
    ready += fresh
    if joined:  # joined ranks take part in allreduces only (Horovod's join): any other
        # collective a rank proposes fails at once, whether or not the others proposed it
        proposed = {by_id[i]: adopted.get(by_id[i], cache[by_id[i]][1])
                    for i in np.flatnonzero(bits.any(axis=0))} if n_cached else {}
        proposed.update({nm: next(iter(d.values())) for nm, d in present.items()})
        for name, desc in proposed.items():
            if desc.startswith("allreduce"):
                continue
            if name in ready:
                ready.remove(name)
            refused[name] = CollectiveMismatchError(
                f"rank {rank}: {name!r} ({desc.split()[0]}) cannot run while ranks {joined} "
                f"have joined; only allreduce takes neutral contributions from joined ranks")
    if not ready and active and all(stuck[r] for r in active) and not refused:
        # every rank (joined ones aside) has been blocked in a wait for stall_warning_s on
        # collectives no other rank will match (different names, or different collectives):
        # a mismatch, not a hang
        waiting = {r: sorted([by_id[i] for i in np.flatnonzero(bits[r])]
                             + [nm for nm, d in present.items() if r in d])
                   for r in active}
        error = CollectiveMismatchError(
            f"rank {rank}: every rank{' not joined' if joined else ''} has been blocked over "
            f"SHOAL_STALL_WARNING_S={stall_warning_s:g}s on collectives that cannot match:\n"
            + "\n".join(f"  rank {r} waits for {', '.join(map(repr, names[:8]))}"
                        + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                        for r, names in waiting.items())
            + "\nevery rank must submit the same collectives (names and kinds)",
            {r: ", ".join(names) for r, names in waiting.items()})
        refused = {name: error for name in pending}
    runnable = set(ready)
    missing = {}
    for name in pending:
        if name not in runnable:
            descs = present.get(name, {})
            idx = cache.get(name, (None,))[0]
            missing[name] = tuple(r for r in range(size) if r not in descs and not (
                idx is not None and idx < n_cached and bits[r, idx]))
    order = sorted(ready, key=ids.__getitem__)
    return Decision(order, extras, refused, fresh_descs, adopted, joined, missing,
                    np.array([ids[nm] for nm in order], np.int64))
