"""Horovod's compressor interface for torch tensors over shoal's wire codecs.

``Compression.fp16``/``.bf16``/``.none`` have Horovod's ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``, and each carries the core codec it stands for: given to a
collective or ``DistributedOptimizer``, shoal converts on the wire and accumulates in float32
(:mod:`shoal.core.compression`). Any other object with ``compress``/``decompress`` (a user's
compressor) is applied around the collective, as Horovod does.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.core.compression import Codec
from shoal.core.compression import Compression as CoreCompression

__all__ = ["Compression", "Compressor", "user_compressor", "wire_codec"]

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_FLOATS = {torch.float32: "float32", torch.float64: "float64"}


class Compressor:
    """A codec with Horovod's interface; ``codec`` is what shoal applies on the wire."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.name = codec.name

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``tensor`` converted for the wire (only float32/float64 change), and its dtype."""
        logical = _FLOATS.get(tensor.dtype)
        if logical is None or not self.codec.applies(logical):
            return tensor, tensor.dtype
        return tensor.to(_TORCH[self.codec.wire_dtype(logical)]), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Back to the dtype ``compress`` saw."""
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """The built-in compressors (Horovod's names)."""

    none = Compressor(CoreCompression.none)
    fp16 = Compressor(CoreCompression.fp16)
    bf16 = Compressor(CoreCompression.bf16)

    @classmethod
    def by_name(cls, name: str) -> Compressor:
        """``"fp16"`` -> ``Compression.fp16`` (a clear error for unknown names)."""
        return getattr(cls, CoreCompression.by_name(name).name)


def wire_codec(compression: Any) -> Codec:
    """The core codec a collective applies on the wire for ``compression`` (none for a
    user's compressor, which is applied around the collective instead)."""
    if isinstance(compression, Compressor):
        return compression.codec
    if isinstance(compression, Codec):
        return compression
    return CoreCompression.none


def user_compressor(compression: Any) -> bool:
    """A compressor shoal does not know (applied around the collective, as Horovod does)."""
    return compression is not None and not isinstance(compression, Compressor | Codec) and \
        hasattr(compression, "compress") and hasattr(compression, "decompress")
