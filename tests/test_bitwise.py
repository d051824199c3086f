"""Bitwise reductions (torch.distributed's BAND, BOR, BXOR) against numpy, their refusal for
floating-point tensors, and a joined rank's neutral contribution to them."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from harness import run_ranks

_NP = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}


def _data(rank: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, 7])
    if dtype == "bool":
        return rng.random(37) < 0.5
    return rng.integers(-100 if dtype == "int32" else 0, 100, 37).astype(dtype)


def _bitwise(rank: int) -> str:
    import shoal
    n = shoal.size()
    for dtype in ("int32", "uint8", "bool"):
        for op, fn in _NP.items():
            want = functools.reduce(fn, [_data(r, dtype) for r in range(n)])
            got = shoal.allreduce(_data(rank, dtype), shoal.ReduceOp[op], name=f"{op}{dtype}")
            np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="bitwise"):
        shoal.allreduce(np.ones(3), shoal.ReduceOp.BOR)
    # a joined rank contributes all bits set to BAND and nothing to BOR
    if rank == 0:
        shoal.join()
    else:
        live = [_data(r, "int32") for r in range(1, n)]
        got = shoal.allreduce(_data(rank, "int32"), shoal.ReduceOp.BAND, name="jband")
        np.testing.assert_array_equal(got, functools.reduce(np.bitwise_and, live))
        got = shoal.allreduce(_data(rank, "int32"), shoal.ReduceOp.BOR, name="jbor")
        np.testing.assert_array_equal(got, functools.reduce(np.bitwise_or, live))
        shoal.join()
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_bitwise_reductions(n: int) -> None:
    assert run_ranks(_bitwise, n, timeout=60) == ["ok"] * n
