"""Deterministic per-rank inputs and numpy references for collective tests."""

from __future__ import annotations

import zlib

import numpy as np

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - dev extra
    BF16 = None

FLOATS = ["float16", "float32", "float64"] + (["bfloat16"] if BF16 is not None else [])
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
ALL_DTYPES = [*FLOATS, *INTS, "bool"]
TOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def dtype_of(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def rank_input(case: str, rank: int, shape: tuple[int, ...], dtype: str,
               special: bool = True) -> np.ndarray:
    """Random, never all-zero data for ``rank``; floats carry a NaN and an Inf if ``special``."""
    rng = np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode()))
    n = int(np.prod(shape))
    if dtype == "bool":
        data = rng.random(n) < 0.5
    elif dtype in INTS:
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -100), min(info.max, 100)
        data = rng.integers(lo, hi, n, endpoint=True).astype(dtype)
    else:
        data = (rng.standard_normal(n) * 4).astype(np.float32).astype(dtype_of(dtype))
        if special and n >= 8:
            data[3] = np.inf
            data[5] = np.nan
    return data.reshape(shape)


_UFUNC = {"SUM": np.add, "AVERAGE": np.add, "MIN": np.minimum, "MAX": np.maximum,
          "PRODUCT": np.multiply}
_BOOL = {"MIN": np.logical_and, "MAX": np.logical_or, "PRODUCT": np.logical_and}


def reference(inputs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """What an allreduce of ``inputs`` must produce: floats reduced in float64 and rounded
    once, integers in their own width (wrapping), integer averages truncated toward zero (as
    Horovod's)."""
    n = len(inputs)
    floats = dtype in FLOATS
    fn = _BOOL[op] if dtype == "bool" else _UFUNC[op]
    values = [x.astype(np.float64) for x in inputs] if floats else inputs
    acc = values[0].copy()
    for x in values[1:]:
        acc = fn(acc, x)
    if op == "AVERAGE":
        if floats:
            acc = acc / n
        else:  # truncated toward zero, computed wide (negating -128 overflows int8)
            wide = acc.astype(np.int64)
            acc = np.where(wide < 0, -((-wide) // n), wide // n).astype(acc.dtype)
    return acc.astype(dtype_of(dtype)) if floats else acc


def assert_matches(got: np.ndarray, want: np.ndarray, dtype: str, what: str,
                   inputs: list[np.ndarray] | None = None) -> None:
    """Exact for integers and bools; for floats within the summation error bound
    ``tol * sum_r |x_r|`` (element-wise), which covers partial sums rounded to 16 bits."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if dtype not in FLOATS:
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaNs differ"
    finite = np.isfinite(w)
    assert np.array_equal(g[~finite & ~np.isnan(w)], w[~finite & ~np.isnan(w)]), \
        f"{what}: infinities differ"
    bound = TOL[dtype] * np.abs(w)
    if inputs is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            bound = bound + TOL[dtype] * sum(np.abs(x.astype(np.float64)) for x in inputs)
    bound = np.maximum(bound, TOL[dtype])
    bad = finite & ~(np.abs(g - w) <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off, e.g. index "
                           f"{int(np.argmax(bad))}: got {g[bad][0]}, want {w[bad][0]}")
