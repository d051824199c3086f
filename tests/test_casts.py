"""float32 <-> float16 casts through torch's vectorised kernels give numpy's numbers."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from shoal.core.casts import cast_into


def _edge_values() -> np.ndarray:
    rng = np.random.default_rng(5)
    scales = np.float32(10.0) ** rng.integers(-9, 6, 1 << 16).astype(np.float32)
    edges = [65504, 65519, 65520, 1e9, -1e9, np.inf, -np.inf, np.nan, 6e-8, 3e-8, 2.9e-8,
             1e-45, 0.0, -0.0, 2.0 ** -14, 2.0 ** -24]
    return np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * scales,
                           np.array(edges, np.float32)])


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_casts_agree_with_numpy(torch_loaded: bool, monkeypatch) -> None:
    if torch_loaded:
        pytest.importorskip("torch")
    else:
        monkeypatch.setitem(sys.modules, "torch", None)
    x = _edge_values()
    want, got = np.empty(x.size, np.float16), np.empty(x.size, np.float16)
    with np.errstate(over="ignore"):
        np.copyto(want, x, casting="unsafe")
    x.flags.writeable = False  # a caller's read-only tensor is only read
    with np.errstate(over="ignore"):
        cast_into(x, got)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    words = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    back = np.empty(words.size, np.float32)
    cast_into(words, back)
    expected = words.astype(np.float32)
    same = back.view(np.uint32) == expected.view(np.uint32)
    # every number exactly; a signalling NaN may come back quiet (F16C), still NaN
    assert (same | (np.isnan(back) & np.isnan(expected))).all()
    assert same[~np.isnan(expected)].all()
