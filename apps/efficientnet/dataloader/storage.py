"""Where data files live: local paths (also FSx, EFS, SageMaker FastFile mounts) or object
stores through fsspec (``s3://bucket/prefix``, with the ``shoal[s3]`` extra: ``s3fs``).

Only what the loaders need: list a directory, a file's size, open a file for reading. URLs
keep their scheme through every call, so ``find_split("s3://b/imagenet", "train")`` returns
``s3://b/imagenet/train-00000-of-01024`` and friends. The S3 endpoint, region and credentials
come from the usual places (``AWS_*`` variables, ``~/.aws``, the instance or container role);
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` point it at an S3-compatible server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

__all__ = ["file_sizes", "is_url", "join", "list_dir", "name_of", "open_binary", "parent_of",
           "size_of"]


def is_url(path: str) -> bool:
    """Whether ``path`` names an object store (``scheme://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the path inside it."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with the s3 extra
        raise ImportError(f"{url}: reading from object stores needs fsspec and s3fs "
                          f"(pip install 'shoal[s3]')") from None
    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        fs, inner = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"{url}: no file system for {protocol!r} ({exc}); for S3 install "
                          f"the extra: pip install 'shoal[s3]'") from None
    return fs, inner


def join(base: str, name: str) -> str:
    """``base/name`` for paths and URLs alike."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else str(Path(_local(base)) / name)


def name_of(path: str) -> str:
    """The last component of ``path``."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def parent_of(path: str) -> str:
    """The directory holding ``path``."""
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else str(Path(_local(path)).parent)


def list_dir(where: str) -> list[tuple[str, bool, int]]:
    """``(full path, is a directory, size in bytes)`` of every entry of the directory
    ``where``, sorted; ``[]`` when there is no such directory. One listing call (one request
    on S3), however many files."""
    if not is_url(where):
        root = Path(_local(where))
        if not root.is_dir():
            return []
        with os.scandir(root) as it:
            return sorted((e.path, e.is_dir(), 0 if e.is_dir() else e.stat().st_size)
                          for e in it)
    fs, inner = _filesystem(where)
    scheme = where.split("://", 1)[0]
    try:
        entries = fs.ls(inner, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/")
        if name == inner.rstrip("/"):
            continue
        out.append((f"{scheme}://{name}", e.get("type") == "directory", int(e.get("size") or 0)))
    return sorted(out)


def file_sizes(paths: list[str]) -> dict[str, int]:
    """The size of every file of ``paths``, from one listing per directory."""
    out: dict[str, int] = {}
    for parent in dict.fromkeys(parent_of(p) for p in paths):
        out.update((p, n) for p, is_dir, n in list_dir(parent) if not is_dir)
    missing = [p for p in paths if p not in out]
    for p in missing:  # not listed under that spelling (a symlinked or relative path)
        out[p] = size_of(p)
    return {p: out[p] for p in paths}


def size_of(path: str) -> int:
    """The size of the file ``path`` in bytes."""
    if not is_url(path):
        return os.path.getsize(_local(path))
    fs, inner = _filesystem(path)
    return int(fs.size(inner))


def open_binary(path: str) -> IO[bytes]:
    """``path`` opened for reading bytes (buffered; seekable: S3 reads are ranged GETs)."""
    if not is_url(path):
        return open(_local(path), "rb")
    fs, inner = _filesystem(path)
    return fs.open(inner, "rb", block_size=8 << 20, cache_type="readahead")
