"""TFRecord files without TensorFlow: reading, writing and counting, with CRC checks.

A TFRecord file is a sequence of records, each framed as::

    uint64  length            little-endian
    uint32  masked_crc32c(length bytes)
    bytes   data[length]
    uint32  masked_crc32c(data)

``masked_crc32c(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32), where ``crc`` is
CRC-32C (Castagnoli), computed here by the ``crc32c`` package. A record whose length or data
does not match its CRC, or a file that ends inside a record, raises :class:`TFRecordError`
naming the file and the byte offset at which the bad record starts.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO

import crc32c

from .storage import open_binary

__all__ = ["RecordRef", "TFRecordError", "TFRecordWriter", "count_records", "masked_crc",
           "read_records"]

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


class TFRecordError(ValueError):
    """A TFRecord file is corrupt or truncated; the message names the file and byte offset."""

    def __init__(self, path: str, offset: int, what: str) -> None:
        super().__init__(f"{path}: corrupt TFRecord at byte offset {offset}: {what}")
        self.path = path
        self.offset = offset


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _read_exact(f: BinaryIO, n: int, path: str, offset: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TFRecordError(path, offset, f"file ends inside the record ({what}: wanted {n} "
                                          f"bytes, got {len(data)})")
    return data


@dataclass(frozen=True)
class RecordRef:
    """A record located but not read: its file, the byte offset of its frame, its length.
    :meth:`load` reads it (CRCs checked)."""

    path: str
    offset: int
    length: int

    def load(self, check_crc: bool = True) -> bytes:
        """The record's data."""
        with open_binary(self.path) as f:
            f.seek(self.offset)
            header = _read_exact(f, _HEADER.size, self.path, self.offset, "header")
            frame = _read_exact(f, self.length + _FOOTER.size, self.path, self.offset, "data")
        length, length_crc = _HEADER.unpack(header)
        data, (data_crc,) = frame[:-_FOOTER.size], _FOOTER.unpack(frame[-_FOOTER.size:])
        if length != self.length or (check_crc and masked_crc(header[:8]) != length_crc):
            raise TFRecordError(self.path, self.offset, "the record changed since it was "
                                                        "indexed (length or length CRC)")
        if check_crc and masked_crc(data) != data_crc:
            raise TFRecordError(self.path, self.offset, f"data CRC mismatch ({length}-byte "
                                                        f"record)")
        return data


def _never() -> bool:
    return False


def read_records(path: str | os.PathLike[str], check_crc: bool = True, start: int = 0,
                 stop: int | None = None, lazy: Callable[[], bool] = _never
                 ) -> Iterator[bytes | RecordRef]:
    """Yield the data of records ``start``..``stop`` (default: all) of the TFRecord file
    ``path`` (a local path or a URL), in order.

    Records before ``start`` are passed over by their headers alone (their data is not read),
    and so is every record for which ``lazy()`` is true when it is reached: those come out as
    a :class:`RecordRef` instead of bytes.

    Raises:
        TFRecordError: a CRC does not match (with ``check_crc``) or the file is truncated.
    """
    name = os.fspath(path)
    with open_binary(name) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        offset = index = 0
        while stop is None or index < stop:
            header = f.read(_HEADER.size)
            if not header:
                return
            if len(header) != _HEADER.size:
                raise TFRecordError(name, offset, f"file ends inside a record header "
                                                  f"({len(header)} of {_HEADER.size} bytes)")
            length, length_crc = _HEADER.unpack(header)
            if check_crc and masked_crc(header[:8]) != length_crc:
                raise TFRecordError(name, offset, "length CRC mismatch")
            end = offset + _HEADER.size + length + _FOOTER.size
            if index < start or lazy():
                if end > size:
                    raise TFRecordError(name, offset, "file ends inside the record")
                f.seek(end)
                if index >= start:
                    yield RecordRef(name, offset, length)
            else:
                data = _read_exact(f, length, name, offset, "data")
                (data_crc,) = _FOOTER.unpack(_read_exact(f, _FOOTER.size, name, offset,
                                                         "data CRC"))
                if check_crc and masked_crc(data) != data_crc:
                    raise TFRecordError(name, offset, f"data CRC mismatch ({length}-byte "
                                                      f"record)")
                yield data
            offset, index = end, index + 1


def _always() -> bool:
    return True


def count_records(path: str | os.PathLike[str]) -> int:
    """Number of records in ``path``, found by walking the headers (data is skipped unread).

    Length CRCs are checked, so a corrupt header is caught here already.
    """
    return sum(1 for _ in read_records(path, lazy=_always))


class TFRecordWriter:
    """Write records to a TFRecord file: ``with TFRecordWriter(path) as w: w.write(data)``.

    The file appears under its final name only when the writer is closed without error (it is
    written to a temporary name first, then renamed), so readers never see half a file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._tmp = f"{self.path}.tmp-{os.getpid()}"
        self._f: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()

    def write(self, data: bytes) -> None:
        """Append one record."""
        if self._f is None:
            raise ValueError(f"{self.path}: writer is closed")
        length = struct.pack("<Q", len(data))
        self._f.write(length + struct.pack("<I", masked_crc(length)))
        self._f.write(data)
        self._f.write(_FOOTER.pack(masked_crc(data)))

    def write_all(self, records: Iterable[bytes]) -> None:
        """Append every record of ``records``."""
        for r in records:
            self.write(r)

    def close(self, keep: bool = True) -> None:
        """Finish the file (``keep``) or discard it."""
        if self._f is None:
            return
        self._f.close()
        self._f = None
        if keep:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(keep=exc_type is None)
