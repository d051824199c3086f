"""The three AllReduce algorithms of the core: ``shm``, ``ring`` and ``hierarchical``.

Each takes the fused request as lists of flat source and destination arrays of one logical
dtype, plus the codec that converts them to the wire dtype.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from ..compression import Codec, storage_dtype
from ..reduction import ReduceOp, finalize, narrow, reduce_into, widen
from ..transport import Transport
from . import register, wire16
from .doubling import doubling_allreduce
from .ring import ring_allreduce


def _finisher(op: ReduceOp, wire: str, count: int):
    if op != ReduceOp.AVERAGE or count == 1:
        return None
    return partial(finalize, op=op, count=count, dtype=wire)


def _half_average(op: ReduceOp, wire: str) -> bool:
    """Half-precision averages divide *before* their sums are rounded to the wire dtype:
    two ranks holding 40000.0 in float16 must average to 40000.0, not overflow to inf."""
    return op == ReduceOp.AVERAGE and wire in ("float16", "bfloat16")


def _needs_single_host_shm(transport: Transport) -> str | None:
    if not transport.has_shm:
        return "shared memory is disabled or this host has a single rank"
    if transport.world.cross_size != 1:
        return f"the job spans {transport.world.cross_size} hosts; use hierarchical or ring"
    return None


def _needs_hierarchy(transport: Transport) -> str | None:
    if transport.world.cross_size < 2:
        return "the job runs on one host"
    if not transport.world.homogeneous:
        return "hosts run different numbers of ranks"
    if transport.world.local_size > 1 and not transport.has_shm:
        return "shared memory is disabled"
    return None


def _pack(srcs: Sequence[np.ndarray], wire: np.dtype, codec: Codec) -> np.ndarray:
    buf = np.empty(sum(s.size for s in srcs), wire)
    pos = 0
    for s in srcs:
        codec.encode(s, buf[pos:pos + s.size])
        pos += s.size
    return buf


def _unpack(buf: np.ndarray, dsts: Sequence[np.ndarray], codec: Codec) -> None:
    pos = 0
    for d in dsts:
        codec.decode(buf[pos:pos + d.size], d)
        pos += d.size


def _cross(transport: Transport, group: Sequence[int], buf: np.ndarray, reduce, finish,
           what: str) -> None:
    """Allreduce ``buf`` across ``group`` over TCP: recursive doubling below
    ``SHOAL_SMALL_MESSAGE_BYTES`` (latency-bound), the ring above (bandwidth-bound)."""
    if buf.nbytes <= transport.cfg.small_message_bytes:
        doubling_allreduce(transport, group, buf, reduce, finish=finish, what=what)
    else:
        ring_allreduce(transport, group, buf, reduce, finish=finish,
                       block_bytes=transport.cfg.tcp_chunk_bytes, what=what)


def _wide_cross(transport: Transport, group: Sequence[int], wide: np.ndarray, op: ReduceOp,
                count: int, what: str) -> None:
    """Sum float32 ``wide`` across hosts in place, float32 on the wire (an average divides by
    ``count`` at the end): the route of a float16 sum whose partial sums could pass 65504
    (:func:`wire16.choose`), rounded once at the end."""
    finish = partial(finalize, op=op, count=count, dtype="float32") \
        if op == ReduceOp.AVERAGE and count > 1 else None
    _cross(transport, group, wide, partial(reduce_into, op=op, dtype="float32"), finish, what)


_half_sum = wire16.applies


def _ring_over(transport: Transport, group: Sequence[int], srcs, dsts, op, dtype, codec,
               what) -> str:
    wire = codec.wire_dtype(dtype)
    reduce = partial(reduce_into, op=op, dtype=wire)
    half = _half_sum(op, wire) and wire16.choose(transport, srcs, dtype, op, wire, what)
    if len(srcs) == 1 and wire == dtype:  # reduce in the destination itself, no packing
        buf = dsts[0]
        if buf is not srcs[0]:
            np.copyto(buf, srcs[0])
    else:
        buf = _pack(srcs, storage_dtype(wire), codec)
    if half == wire:
        wire16.allreduce(transport, group, wire16.start(buf, wire, op, transport.size), buf,
                         wire, what)
    elif half:
        wide = widen(buf, wire)
        _wide_cross(transport, group, wide, op, transport.size, what)
        narrow(wide, buf, wire)
    else:
        _cross(transport, group, buf, reduce, _finisher(op, wire, transport.size), what)
    if buf is not dsts[0]:
        _unpack(buf, dsts, codec)
    return half or wire


@functools.cache
def _shm_plan(op: ReduceOp, dtype: str, codec: Codec, size: int) -> tuple:
    """Per (op, dtype, codec): the wire dtype and the bound functions, built once."""
    wire = codec.wire_dtype(dtype)
    squeeze = wire != dtype
    if _half_average(op, wire) and size > 1:  # divide in float32, round once
        return (storage_dtype(wire), partial(reduce_into, op=op, dtype=wire, divide_by=size),
                codec.encode if squeeze else None, codec.decode if squeeze else None, None)
    return (storage_dtype(wire), partial(reduce_into, op=op, dtype=wire),
            codec.encode if squeeze else None, codec.decode if squeeze else None,
            _finisher(op, wire, size))


@register("shm", requires=_needs_single_host_shm)
def shm_allreduce(transport: Transport, srcs, dsts, op: ReduceOp, dtype: str, codec: Codec,
                  what: str, phases=None) -> None:
    """One host: reduce-scatter and allgather fused in the shared segments, chunk by chunk."""
    wire, reduce, encode, decode, finish = _shm_plan(op, dtype, codec, transport.size)
    transport.host_allreduce(srcs, dsts, wire, reduce, encode=encode, decode=decode,
                             finish=finish, phases=phases, what=what)


@register("ring", requires=lambda transport: None)
def flat_ring_allreduce(transport: Transport, srcs, dsts, op: ReduceOp, dtype: str, codec: Codec,
                        what: str, phases=None) -> str:
    """Every rank in one TCP ring (recursive doubling for small messages), whatever host it
    is on."""
    return _ring_over(transport, range(transport.size), srcs, dsts, op, dtype, codec, what)


@register("hierarchical", requires=_needs_hierarchy)
def hierarchical_allreduce(transport: Transport, srcs, dsts, op: ReduceOp, dtype: str,
                           codec: Codec, what: str, phases=None) -> str:
    """Reduce-scatter on the host, ring across hosts per shard (all local ranks at once),
    allgather on the host: the SMDDP shape, every core and link busy together."""
    group = transport.world.cross_peers
    if not transport.has_shm:  # one rank per host: the cross ring is the whole job
        return _ring_over(transport, group, srcs, dsts, op, dtype, codec, what)
    wire = codec.wire_dtype(dtype)
    reduce = partial(reduce_into, op=op, dtype=wire)
    finish = _finisher(op, wire, transport.size)
    cross: Callable[[np.ndarray], None] | None = None
    half = _half_sum(op, wire) and wire16.choose(transport, srcs, dtype, op, wire, what)
    if half:
        # the host's float32 sums wait here for their hop (the pipeline reduces chunk k+1
        # while chunk k crosses; both take chunks in order, one at a time each)
        pending: deque[np.ndarray] = deque()

        def local(part: np.ndarray, peers: list[np.ndarray],
                  first: np.ndarray | None = None) -> None:
            wide = widen(part if first is None else first, wire)
            for peer in peers:
                wide += widen(peer, wire)
            if op == ReduceOp.AVERAGE:  # the host's sum over the world size: an average of
                np.divide(wide, transport.size, out=wide)  # inputs, within their range
            pending.append(wide)

        def cross(part: np.ndarray) -> None:
            # the host's sum stays float32 through the hop between hosts: one rounding per
            # hop on a 16-bit wire, none on a float32 one
            wide = pending.popleft()
            if half == wire:
                wire16.allreduce(transport, group, wide, part, wire, what)
            else:  # a float16 sum: nothing to divide
                _wide_cross(transport, group, wide, op, transport.size, what)
                narrow(wide, part, wire)
        finish = None
    else:
        local = reduce

        def cross(part: np.ndarray) -> None:
            _cross(transport, group, part, reduce, None, what)

    transport.host_allreduce(srcs, dsts, storage_dtype(wire), local,
                             encode=codec.encode if wire != dtype else None,
                             decode=codec.decode if wire != dtype else None,
                             cross=cross, finish=finish, phases=phases, what=what)
    return half or wire
