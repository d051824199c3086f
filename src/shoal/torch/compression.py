"""Horovod's compressor interface for torch tensors: the core's
:class:`~shoal.core.compression.Compressor` with torch's casts.

``Compression.fp16``/``.bf16``/``.none`` have Horovod's ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``, and each carries the core codec it stands for: given to a
collective or ``DistributedOptimizer``, shoal converts on the wire and accumulates in float32.
Any other object with ``compress``/``decompress`` (a user's compressor) is applied around the
collective, as Horovod does.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core.compression import Compressor as CoreCompressor
from shoal.core.compression import compressors, user_compressor, wire_codec

__all__ = ["Compression", "Compressor", "user_compressor", "wire_codec"]


class Compressor(CoreCompressor):
    """A wire codec with Horovod's interface, for torch tensors."""

    def _logical(self, tensor: torch.Tensor) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    def _cast(self, tensor: torch.Tensor, dtype: str) -> Any:
        return tensor.to(getattr(torch, dtype))


Compression = compressors(Compressor)
