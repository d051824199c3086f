"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", 2021), the
reduction behind Horovod's ``op=hvd.Adasum``.

Two gradients combine by how far they point the same way::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add up and parallel ones average (``adasum(a, c a) = (a + c a) / 2``).
A zero gradient leaves the other unchanged. Several ranks combine as a pairwise tree over the
ranks in order: level one combines ranks (0, 1), (2, 3), ...; each level combines the
results of the one below in the same way. Horovod defines this for a power of two ranks only;
shoal defines it for any number: when a level has an odd count, its last member goes up a
level unchanged and joins there (at 3 ranks: ``adasum(adasum(g0, g1), g2)``). At a power of
two this is Horovod's result. Dot products and norms are taken over the whole tensor, in
float64, whatever the tensor's type (half-precision gradients whose squares would underflow
included); the result is rounded back to the tensor's type once.

Every rank gathers every rank's tensor and computes the same tree, in the same order, so every
rank holds the same bits. That moves ``n`` times the tensor where Horovod's vector-halving
exchange moves about twice: the price of doing the arithmetic once per rank instead of across
pairs, and of defining it at every size.
"""

from __future__ import annotations

import numpy as np

__all__ = ["adasum_pair", "adasum_tree"]


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two float64 vectors (see the module)."""
    dot = float(np.dot(a, b))
    a_sq, b_sq = float(np.dot(a, a)), float(np.dot(b, b))
    a_coef = 1.0 - dot / (2.0 * a_sq) if a_sq > 0.0 else 1.0
    b_coef = 1.0 - dot / (2.0 * b_sq) if b_sq > 0.0 else 1.0
    return a_coef * a + b_coef * b


def adasum_tree(rows: np.ndarray) -> np.ndarray:
    """The pairwise tree over the rows of ``rows`` (one flat gradient per rank, in rank
    order), as float64."""
    level = [np.asarray(r, dtype=np.float64) for r in rows]
    while len(level) > 1:
        up = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        level = up
    return level[0]
