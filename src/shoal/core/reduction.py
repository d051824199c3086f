"""Reduction operators and the dtypes collectives accept, as plain functions on numpy arrays.

bfloat16 has no numpy dtype of its own: shoal accepts ``ml_dtypes.bfloat16`` arrays and, from
the framework adapters, ``uint16`` arrays tagged as bfloat16. Either way the data is reduced by
widening to float32 with bit operations (exact), reducing, and rounding back to nearest-even.
float16 sums and averages are accumulated in float32 for the same reason: rounding once, at the
end, rather than once per rank.
"""

from __future__ import annotations

import enum

import numpy as np

from .casts import cast_into

__all__ = [
    "SUPPORTED_DTYPES",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "bf16_to_f32",
    "check_array",
    "check_rows",
    "f32_to_bf16",
    "finalize",
    "logical_dtype",
    "narrow",
    "reduce_into",
    "scale",
    "stage_op",
    "widen",
]


class ReduceOp(enum.IntEnum):
    """How values from every rank are combined (Horovod's numbering)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5
    BAND = 6  # bitwise, integers and bool only (torch.distributed's BAND/BOR/BXOR)
    BOR = 7
    BXOR = 8


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

SUPPORTED_DTYPES = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)
_HALF = ("float16", "bfloat16")


_NAMES: dict[np.dtype, str] = {}


def logical_dtype(array: np.ndarray, bf16: bool = False) -> str:
    """The dtype name shoal reasons about (``bfloat16`` for tagged ``uint16`` arrays)."""
    name = _NAMES.get(array.dtype)
    if name is None:  # numpy's dtype.name is slow enough to matter per tensor
        name = _NAMES[array.dtype] = array.dtype.name
    if bf16:
        if name not in ("uint16", "int16", "bfloat16"):
            raise TypeError(f"an array tagged bfloat16 must hold 16-bit words, not {name}")
        return "bfloat16"
    return name


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's two spellings of the op: the deprecated ``average=`` flag, or ``op=``."""
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE if op is None else ReduceOp(op)


def check_array(array: object, what: str, rank: int, op: ReduceOp | None = None,
                bf16: bool = False) -> str:
    """Validate a collective's input; return its logical dtype name.

    Raises ``TypeError`` for non-arrays and unsupported dtypes or ops, ``ValueError`` for
    non-contiguous arrays, each naming the tensor, the rank and the fix.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"rank {rank}: {what} must be a numpy.ndarray, got "
                        f"{type(array).__name__}; convert it with numpy.asarray()")
    if not array.flags.c_contiguous:
        raise ValueError(f"rank {rank}: {what} is not C-contiguous (shape {array.shape}, strides "
                         f"{array.strides}); pass numpy.ascontiguousarray(x)")
    dtype = logical_dtype(array, bf16)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rank {rank}: {what} has dtype {dtype}, which shoal cannot reduce; "
                        f"supported: {', '.join(SUPPORTED_DTYPES)}")
    if op is not None:
        if op == ReduceOp.ADASUM:
            raise TypeError(f"rank {rank}: {what}: op Adasum combines one tensor at a time "
                            f"(allreduce, allreduce_async), not in this collective; use "
                            f"Average or Sum here")
        if dtype == "bool" and op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise TypeError(f"rank {rank}: {what} is bool; only Min (and), Max (or), "
                            f"Product (and) and the bitwise ops make sense for it, not "
                            f"{op.name.capitalize()}")
        if op in _BITWISE and dtype not in _INTEGRAL:
            raise TypeError(f"rank {rank}: {what} has dtype {dtype}; bitwise op "
                            f"{op.name} needs an integer or bool tensor")
    return dtype


def check_rows(ndim: int | None, kind: str, name: str | None, rank: int) -> None:
    """ValueError for a scalar given to a collective that works on rows (dimension 0):
    allgather, alltoall, reducescatter. Adapters call it on every tensor of a grouped call
    before submitting any, so a refused call moves no data."""
    if ndim == 0:
        what = f"{kind} tensor" + ("" if name is None else f" {name!r}")
        raise ValueError(f"rank {rank}: {what} is a scalar; {kind} works on rows (dimension "
                         f"0): reshape it to (1,)")


def bf16_to_f32(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bit patterns (any 16-bit view) to float32, exactly."""
    wide = np.left_shift(words.view(np.uint16).astype(np.uint32), 16)
    if out is None:
        return wide.view(np.float32)
    out.view(np.uint32)[...] = wide
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays NaN) into 16-bit ``out``."""
    bits = values.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    result = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    out.view(np.uint16)[...] = result
    return out


def stage_op(op: ReduceOp) -> ReduceOp:
    """The op partial reductions use: an average is a sum until :func:`finalize` divides."""
    return ReduceOp.SUM if op == ReduceOp.AVERAGE else op


_BINARY = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}
_BITWISE = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
            ReduceOp.BXOR: np.bitwise_xor}
_BINARY.update(_BITWISE)
_BOOL = {ReduceOp.MIN: np.logical_and, ReduceOp.MAX: np.logical_or,
         ReduceOp.PRODUCT: np.logical_and, ReduceOp.BAND: np.logical_and,
         ReduceOp.BOR: np.logical_or, ReduceOp.BXOR: np.logical_xor}
_INTEGRAL = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (16-bit words of ``dtype``, or any numbers) as float32."""
    if dtype == "bfloat16":
        return bf16_to_f32(x)
    out = np.empty(x.shape, np.float32)
    cast_into(x, out)
    return out


def narrow(acc: np.ndarray, dst: np.ndarray, dtype: str) -> None:
    """Round float32 ``acc`` into ``dst`` (words of ``dtype``)."""
    if dtype == "bfloat16":
        f32_to_bf16(acc, dst)
    else:
        cast_into(acc, dst)


def reduce_into(dst: np.ndarray, sources: list[np.ndarray], op: ReduceOp, dtype: str,
                divide_by: int = 0, first: np.ndarray | None = None) -> None:
    """``dst = op(first or dst, *sources)``, then divide by ``divide_by`` if it is non-zero.

    ``first`` lets the caller reduce straight from its own private array into ``dst`` without
    copying it there first. Half precision types are accumulated (and divided) in float32 and
    rounded once.
    """
    op = stage_op(op)
    if first is not None and not sources:
        np.copyto(dst, first)
        first = None
    if dtype in _HALF:
        acc = widen(dst if first is None else first, dtype)
        for src in sources:
            _BINARY[op](acc, widen(src, dtype), out=acc)  # numpy's mixed loop is no faster
        if divide_by:
            np.divide(acc, divide_by, out=acc)
        narrow(acc, dst, dtype)
        return
    ufunc = _BOOL[op] if dtype == "bool" else _BINARY[op]
    if first is not None:
        ufunc(first, sources[0], out=dst)
        sources = sources[1:]
    for src in sources:
        ufunc(dst, src, out=dst)
    if divide_by:
        finalize(dst, ReduceOp.AVERAGE, divide_by, dtype)


def finalize(dst: np.ndarray, op: ReduceOp, count: int, dtype: str) -> None:
    """Turn a sum into an average in place (integers truncate toward zero)."""
    if op != ReduceOp.AVERAGE or count == 1:
        return
    if dtype in _HALF:
        acc = widen(dst, dtype)
        np.divide(acc, count, out=acc)
        narrow(acc, dst, dtype)
    elif dst.dtype.kind in "iu":  # truncated toward zero, as C and Horovod divide
        rem = np.remainder(dst, count)
        np.floor_divide(dst, count, out=dst)
        if dst.dtype.kind == "i":
            dst += ((rem != 0) & (dst < 0)).astype(dst.dtype)
    else:
        np.divide(dst, count, out=dst)


def scale(array: np.ndarray, factor: float, dtype: str) -> None:
    """Multiply ``array`` (flat storage of logical ``dtype``) by ``factor`` in place, as
    Horovod's pre- and post-scaling does: integers in float64 (truncated back), half
    precision in float32."""
    if factor == 1.0 or array.size == 0:
        return
    if dtype in _HALF:
        acc = widen(array, dtype)
        np.multiply(acc, factor, out=acc)
        narrow(acc, array, dtype)
    elif array.dtype.kind in "iub":
        np.copyto(array, array.astype(np.float64) * factor, casting="unsafe")
    else:
        np.multiply(array, factor, out=array, casting="unsafe")
