"""``allreduce(op=Adasum)`` against a numpy reference written from the definition (the pairwise
tree over the ranks in order, an odd one out joining a level up), at 2, 3 and 4 ranks, several
dtypes, odd lengths and empty tensors; orthogonal gradients add up and parallel ones average;
wrong input is refused with a typed error on every rank, and shoal stays usable."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from harness import run_ranks


def _reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Adasum over ``vectors`` in rank order, in float64, straight from the definition."""
    def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot = sum(float(x) * float(y) for x, y in zip(a, b, strict=True))
        na, nb = sum(float(x) ** 2 for x in a), sum(float(y) ** 2 for y in b)
        ca = 1 - dot / (2 * na) if na else 1.0
        cb = 1 - dot / (2 * nb) if nb else 1.0
        return np.array([ca * x + cb * y for x, y in zip(a, b, strict=True)], np.float64)

    def tree(vs: list[np.ndarray]) -> np.ndarray:
        if len(vs) == 1:
            return vs[0]
        ups = [pair(vs[i], vs[i + 1]) for i in range(0, len(vs) - 1, 2)]
        return tree(ups + ([vs[-1]] if len(vs) % 2 else []))
    return tree([v.astype(np.float64) for v in vectors])


def _grad(tag: str, rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(tag.encode()), rank])
    return rng.standard_normal(n).astype(dtype)


CASES = [("float32", 37), ("float64", 1000), ("float16", 9), ("float32", 0), ("float64", 1)]


def _random(rank: int) -> list[np.ndarray]:
    import shoal
    out = []
    for i, (dtype, n) in enumerate(CASES):
        x = _grad(f"g{i}", rank, n, dtype).reshape(-1, 1) if n % 2 else _grad(
            f"g{i}", rank, n, dtype)
        got = shoal.allreduce(x, name=f"g{i}", op=shoal.Adasum)
        assert got.shape == x.shape and got.dtype == x.dtype
        out.append(got.reshape(-1))
    handle = shoal.allreduce_async(_grad("a", rank, 50, "float32"), name="async",
                                   op=shoal.Adasum, postscale_factor=2.0)
    out.append(handle.wait())
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_adasum_matches_the_reference(n: int) -> None:
    results = run_ranks(_random, n)
    for rank in range(n):
        assert all(np.array_equal(a, b) for a, b in zip(results[0], results[rank], strict=True))
    for i, (dtype, size) in enumerate(CASES):
        want = _reference([_grad(f"g{i}", r, size, dtype) for r in range(n)])
        tol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(results[0][i].astype(np.float64), want, rtol=tol,
                                   atol=tol, err_msg=f"{dtype}[{size}] at {n} ranks")
    want = 2 * _reference([_grad("a", r, 50, "float32") for r in range(n)])
    np.testing.assert_allclose(results[0][-1], want, rtol=1e-5, atol=1e-5)


def _shaped(rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    import shoal
    basis = np.linalg.qr(np.random.default_rng(3).standard_normal((64, n)))[0]
    orthogonal = shoal.allreduce(basis[:, rank].copy(), name="orth", op=shoal.Adasum)
    direction = np.random.default_rng(4).standard_normal(64)
    parallel = shoal.allreduce(direction * (rank + 1), name="par", op=shoal.Adasum)
    return orthogonal, parallel


def test_orthogonal_gradients_add_up_and_parallel_ones_average() -> None:
    n = 4
    basis = np.linalg.qr(np.random.default_rng(3).standard_normal((64, n)))[0]
    direction = np.random.default_rng(4).standard_normal(64)
    for orthogonal, parallel in run_ranks(_shaped, n, n):
        np.testing.assert_allclose(orthogonal, basis.sum(axis=1), atol=1e-12)
        np.testing.assert_allclose(parallel, direction * 2.5, atol=1e-12)  # mean of 1..4


def _refused(rank: int) -> list[str]:
    import shoal
    from shoal.core.compression import Compression
    seen = []
    for call in (lambda: shoal.allreduce(np.arange(4), name="int", op=shoal.Adasum),
                 lambda: shoal.allreduce(np.ones(4, np.float32), name="fp16",
                                         op=shoal.Adasum, compression=Compression.fp16),
                 lambda: shoal.reducescatter(np.ones(4), name="rs", op=shoal.Adasum)):
        try:
            call()
        except (TypeError, ValueError, NotImplementedError) as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    x = shoal.allreduce(np.ones(3) * (rank + 1), name="after", op=shoal.Adasum)
    seen.append(str(x.tolist()))
    return seen


def test_wrong_input_is_refused_on_every_rank_and_shoal_stays_usable() -> None:
    for rank, seen in enumerate(run_ranks(_refused, 2)):
        assert len(seen) == 4, seen
        assert seen[0].startswith("TypeError") and "floating-point" in seen[0]
        assert f"rank {rank}" in seen[0] and "'int'" in seen[0]
        assert seen[1].startswith("ValueError") and "compression" in seen[1]
        assert seen[2].startswith("NotImplementedError") and "ADASUM" in seen[2]
        assert seen[3] == str([1.5, 1.5, 1.5])  # parallel: the average
