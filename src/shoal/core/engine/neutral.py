"""Neutral contributions: what a rank that has called ``join()`` puts into the allreduces
the other ranks still run (Horovod's join, for uneven data across ranks).

A joined rank has no tensor of its own, so it builds one from the description every rank
agreed on (kind, shape, dtype, op, compression) filled with the op's identity: 0 for Sum and
Average (an average still divides by the full size, as Horovod's does), 1 for Product, the
largest value for Min and the smallest for Max, all bits set for BAND and none for BOR and
BXOR.
"""

from __future__ import annotations

import re

import numpy as np

from ..compression import Codec, Compression
from ..reduction import ReduceOp, f32_to_bf16

__all__ = ["neutral_allreduce", "parse_allreduce_desc"]

_DESC = re.compile(r"^allreduce shape=\((?P<shape>[\d, ]*)\) dtype=(?P<dtype>\w+) "
                   r"op=(?P<op>\w+) compression=(?P<codec>\w+)$")


def parse_allreduce_desc(desc: str) -> tuple[tuple[int, ...], str, ReduceOp, Codec] | None:
    """``(shape, dtype, op, codec)`` of an allreduce description, or None for other kinds."""
    m = _DESC.match(desc)
    if m is None:
        return None
    shape = tuple(int(d) for d in m["shape"].replace(" ", "").split(",") if d)
    return shape, m["dtype"], ReduceOp[m["op"].upper()], Compression.by_name(m["codec"])


def neutral_allreduce(shape: tuple[int, ...], dtype: str, op: ReduceOp) -> np.ndarray:
    """A flat storage array (bfloat16 as 16-bit words) of ``op``'s identity."""
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == "bfloat16":
        value = {ReduceOp.MIN: np.inf, ReduceOp.MAX: -np.inf,
                 ReduceOp.PRODUCT: 1.0}.get(op, 0.0)
        return f32_to_bf16(np.full(count, value, np.float32), np.empty(count, np.uint16))
    np_dtype = np.dtype(dtype)
    if np_dtype == np.bool_:
        return np.full(count, op in (ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND), bool)
    if op == ReduceOp.PRODUCT:
        return np.ones(count, np_dtype)
    if op == ReduceOp.BAND:  # every bit set
        return np.full(count, -1).astype(np_dtype) if np_dtype.kind == "i" else \
            np.full(count, np.iinfo(np_dtype).max, np_dtype)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = np.finfo(np_dtype) if np_dtype.kind == "f" else np.iinfo(np_dtype)
        big = np.inf if np_dtype.kind == "f" else info.max
        small = -np.inf if np_dtype.kind == "f" else info.min
        return np.full(count, big if op == ReduceOp.MIN else small, np_dtype)
    return np.zeros(count, np_dtype)
