"""The core's sharding plan (:mod:`shoal.core.sharding`): buckets, ownership and alignment."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.core import sharding


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_tensor_is_aligned_owned_once_and_gaps_are_the_rest(n: int) -> None:
    rng = np.random.default_rng(n)
    sizes = [int(x) for x in rng.integers(1, 3000, size=40)]
    itemsizes = [4] * 20 + [2] * 20
    keys = ["f32"] * 20 + ["f16"] * 20
    buckets = sharding.plan(sizes, keys, itemsizes, list(reversed(range(40))), 16 << 10, n,
                            "t")
    seen = []
    for b in buckets:
        align = 64 // itemsizes[b.tensors[0]]
        assert all(o % align == 0 for o in b.offsets)
        assert list(b.sizes) == [sizes[i] for i in b.tensors]
        covered = np.zeros(b.total, dtype=np.int64)
        for o, size in zip(b.offsets, b.sizes, strict=True):
            covered[o:o + size] += 1
        for a, e in b.gaps():
            assert (covered[a:e] == 0).all() and 0 < e - a < align
            covered[a:e] += 1
        assert (covered == 1).all()  # tensors and gaps tile the buffer exactly
        assert b.bounds[0] == 0 and b.bounds[-1] == b.total and sum(b.splits) == b.total
        assert all(x % align == 0 for x in b.bounds[:-1])  # a rank's run starts aligned
        for j, o in enumerate(b.offsets):  # a tensor lies inside its owner's run
            r = b.owner(j)
            assert b.bounds[r] <= o and o + b.sizes[j] <= b.bounds[r + 1]
        seen += b.tensors
    assert sorted(seen) == list(range(40))


def test_align_one_byte_packs_tightly() -> None:
    (b,) = sharding.plan([3, 5, 7], ["k"] * 3, [4] * 3, [0, 1, 2], 1 << 20, 2, "t",
                         align_bytes=1)
    assert b.offsets == (0, 3, 8) and b.total == 15 and b.gaps() == []
