"""Compression codecs for the wire: ``Compression.none``, ``.fp16``, ``.bf16``.

A codec is plain data plus two pure functions, applied to fusion buffers as tensors are packed
into them and unpacked out of them (in the same pass as the copy, so compression halves the
bytes moved and reduced rather than adding a pass). Only float32 and float64 tensors are
compressed; other dtypes travel as they are. Reductions of 16-bit data accumulate in float32
(:func:`shoal.core.reduction.reduce_into`), so an average is rounded once, not once per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .casts import cast_into
from .reduction import bf16_to_f32, f32_to_bf16

__all__ = ["Codec", "Compression", "Compressor", "compressors", "storage_dtype",
           "user_compressor", "wire_codec"]

_COMPRESSIBLE = ("float32", "float64")


def storage_dtype(logical: str) -> np.dtype:
    """The numpy dtype that holds a logical dtype (bfloat16 lives in uint16 words)."""
    return np.dtype(np.uint16) if logical == "bfloat16" else np.dtype(logical)


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    cast_into(src, dst)


def _to_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    f32_to_bf16(src if src.dtype == np.float32 else src.astype(np.float32), dst)


def _from_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    if dst.dtype == np.float32:
        bf16_to_f32(src, dst)
    else:
        np.copyto(dst, bf16_to_f32(src))


@dataclass(frozen=True)
class Codec:
    """How a dtype travels: its wire dtype and the functions that convert to and from it."""

    name: str
    wire: str | None  # logical wire dtype for compressible inputs; None: unchanged
    encode: Callable[[np.ndarray, np.ndarray], None] = _copy
    decode: Callable[[np.ndarray, np.ndarray], None] = _copy

    def wire_dtype(self, dtype: str) -> str:
        """The logical dtype a tensor of ``dtype`` travels as."""
        return self.wire if self.wire and dtype in _COMPRESSIBLE else dtype

    def applies(self, dtype: str) -> bool:
        """Whether this codec changes tensors of ``dtype``."""
        return self.wire_dtype(dtype) != dtype

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``bf16``."""

    none = Codec("none", None)
    fp16 = Codec("fp16", "float16")
    bf16 = Codec("bf16", "bfloat16", _to_bf16, _from_bf16)

    @classmethod
    def by_name(cls, name: str) -> Codec:
        """``"fp16"`` -> ``Compression.fp16``; a clear error for anything else."""
        codec = {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}.get(str(name).lower())
        if codec is None:
            raise ValueError(f"unknown compression {name!r}; use none, fp16 or bf16")
        return codec


class Compressor:
    """Horovod's compressor interface (``compress(tensor) -> (tensor, ctx)``,
    ``decompress(tensor, ctx)``) over a wire codec, written once for every adapter.

    An adapter subclasses it with two tensor functions, :meth:`_logical` (a tensor's dtype
    name) and :meth:`_cast` (a tensor converted to a dtype name). Given to a collective, shoal
    applies ``codec`` on the wire instead (accumulating in float32); a user's own object with
    ``compress``/``decompress`` is applied around the collective, as Horovod does.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.name = codec.name

    def _logical(self, tensor: Any) -> str:  # pragma: no cover - adapters override
        raise NotImplementedError

    def _cast(self, tensor: Any, dtype: str) -> Any:  # pragma: no cover - adapters override
        raise NotImplementedError

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """``tensor`` converted for the wire (only float32/float64 change), and its dtype."""
        logical = self._logical(tensor)
        if not self.codec.applies(logical):
            return tensor, None
        return self._cast(tensor, self.codec.wire_dtype(logical)), logical

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Back to the dtype :meth:`compress` saw."""
        return tensor if ctx is None else self._cast(tensor, ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


def compressors(cls: type[Compressor]) -> type:
    """A ``Compression`` namespace (Horovod's ``none``/``fp16`` plus ``bf16``) of ``cls``."""
    made = {name: cls(getattr(Compression, name)) for name in ("none", "fp16", "bf16")}

    def by_name(name: str) -> Compressor:
        """``"fp16"`` -> ``Compression.fp16`` (a clear error for unknown names)."""
        return made[Compression.by_name(name).name]

    return type("Compression", (), {**made, "by_name": staticmethod(by_name),
                                    "__doc__": "The built-in compressors (Horovod's names)."})


def wire_codec(compression: Any) -> Codec:
    """The codec a collective applies on the wire for ``compression`` (none for a user's
    compressor, which is applied around the collective instead)."""
    if isinstance(compression, Compressor):
        return compression.codec
    if isinstance(compression, Codec):
        return compression
    return Compression.none


def user_compressor(compression: Any) -> bool:
    """A compressor shoal does not know (applied around the collective, as Horovod does)."""
    return compression is not None and not isinstance(compression, Compressor | Codec) and \
        hasattr(compression, "compress") and hasattr(compression, "decompress")
