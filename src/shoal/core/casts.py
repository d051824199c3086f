"""float32 <-> float16 casts at vector speed where it is to be had.

numpy converts float16 one number at a time (64 MiB of float32 to float16 in 63 ms on this
machine's AVX2 cores, back in 45 ms), which made Compression.fp16 slower than sending float32
across a 1 Gbit/s link. torch's casts use the CPU's F16C instructions (5 ms and 7 ms). When
torch is already loaded in the process (a torch job always has it), large casts go through
it; shoal never imports torch for this. Both round to nearest, ties to even, as IEEE 754 says,
so the bits do not depend on the route (but for a signalling NaN, which F16C makes quiet).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

__all__ = ["cast_into"]

_FAST = (np.dtype(np.float16), np.dtype(np.float32))
_MIN_ITEMS = 1 << 14  # below this the call costs more than numpy's loop


def _torch():  # the module if this process has loaded it, else None
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "from_numpy") else None


def cast_into(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src`` with numpy's unsafe casting (same shape), through torch's
    vectorised kernels for large float16 <-> float32 casts when torch is loaded."""
    if src.dtype != dst.dtype and src.dtype in _FAST and dst.dtype in _FAST and \
            src.size >= _MIN_ITEMS and src.shape == dst.shape and \
            src.flags.c_contiguous and dst.flags.c_contiguous and dst.flags.writeable:
        torch = _torch()
        if torch is not None:
            with warnings.catch_warnings():  # a read-only source is only read
                warnings.simplefilter("ignore", UserWarning)
                torch.from_numpy(dst).copy_(torch.from_numpy(src))
            return
    np.copyto(dst, src, casting="unsafe")
