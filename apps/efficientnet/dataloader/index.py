"""How many records each TFRecord file holds, found once and kept: the record index.

Counting a file walks every record header (ImageNet's 1,024 training shards: 1.28 million
small reads), which a job should not do at every start. :func:`record_counts` keeps the counts
in a JSON index, ``.shoal-index.json`` beside the data when that directory is local and
writable, else in ``$SHOAL_CACHE_DIR`` (default ``~/.cache/shoal``) under a name made from the
data's location (read-only mounts, S3). An entry holds the file's size; a file whose size
changed, or that the index lacks, is counted again. In a job, the files to count are split over
the ranks (a :class:`Team`), so a first start on N ranks walks 1/N of the headers on
each, and rank 0 writes the index for the next start.

:func:`assign` turns the counts into each data-loading worker's part: whole files when there
are at least as many files as workers, else a contiguous range of records (a worker reads only
the files its range touches, and passes over the records before its start by their headers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import INDEX_NAME
from .storage import file_sizes, is_url, name_of, open_binary, parent_of
from .tfrecord import count_records

__all__ = ["INDEX_NAME", "Span", "Team", "assign", "cache_dir", "describe", "record_counts"]

_VERSION = 1
Span = tuple[int, int, int]  # (file index, first record, end record)


def cache_dir() -> Path:
    """``$SHOAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/shoal``, else ``~/.cache/shoal``."""
    if os.environ.get("SHOAL_CACHE_DIR"):
        return Path(os.environ["SHOAL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shoal"


def _index_paths(directory: str) -> list[str]:
    """Where the index of ``directory`` may be: beside the data (local only), in the cache."""
    digest = hashlib.sha256(directory.rstrip("/").encode()).hexdigest()[:20]
    cached = str(cache_dir() / f"index-{digest}.json")
    if is_url(directory):
        return [cached]
    return [str(Path(directory) / INDEX_NAME), cached]


def _load(directory: str) -> dict[str, list[int]]:
    """``{file name: [size, records]}`` from the first readable index of ``directory``."""
    for path in _index_paths(directory):
        try:
            with open_binary(path) as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("version") == _VERSION:
            files = data.get("files")
            if isinstance(files, dict):
                return {str(k): list(v) for k, v in files.items()
                        if isinstance(v, list) and len(v) == 2}
    return {}


def _store(directory: str, entries: dict[str, list[int]]) -> str | None:
    """Write the index of ``directory`` atomically to the first place that takes it."""
    text = json.dumps({"version": _VERSION, "files": dict(sorted(entries.items()))})
    for path in _index_paths(directory):
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(tmp).write_text(text)
            os.replace(tmp, path)
            return path
        except OSError:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
    warnings.warn(f"could not write the record index of {directory} (tried "
                  f"{', '.join(_index_paths(directory))}); the next start counts again",
                  stacklevel=3)
    return None


@dataclass(frozen=True)
class Team:
    """The processes that share the counting: this one's ``rank`` of ``size``, and the two
    collectives it needs (a broadcast from rank 0 and an allgather, of picklable objects)."""

    rank: int = 0
    size: int = 1
    broadcast: Callable[[Any], Any] | None = None
    allgather: Callable[[Any], list[Any]] | None = None


def record_counts(files: Sequence[str], team: Team | None = None,
                  counter: Callable[[str], int] | None = None) -> list[int]:
    """The number of records of every file of ``files`` (local paths or URLs).

    Rank 0 of ``team`` reads the index and sends what it knows to the others; the files it
    does not know are counted (``counter``), rank ``r`` taking ``missing[r::size]``, and
    gathered everywhere; rank 0 then brings the index up to date. Every rank of the team must
    call it with the same ``files``.
    """
    team, counter = team or Team(), counter or count_records
    files = list(files)
    by_dir: dict[str, list[str]] = {}
    for f in files:
        by_dir.setdefault(parent_of(f), []).append(f)
    known: dict[str, int] = {}
    sizes: dict[str, int] = {}
    indexes: dict[str, dict[str, list[int]]] = {}
    if team.rank == 0:
        sizes = file_sizes(files)
        for directory, members in by_dir.items():
            index = indexes[directory] = _load(directory)
            for f in members:
                entry = index.get(name_of(f))
                if entry is not None and entry[0] == sizes[f]:
                    known[f] = int(entry[1])
    if team.size > 1:
        if team.broadcast is None or team.allgather is None:
            raise ValueError("record_counts: a team of several processes needs its "
                             "broadcast and allgather")
        known = team.broadcast(known)
    missing = [f for f in files if f not in known]
    if not missing:
        return [known[f] for f in files]
    mine = {f: int(counter(f)) for f in missing[team.rank::team.size]}
    for part in (team.allgather(mine) if team.size > 1 and team.allgather else [mine]):
        known.update(part)
    if team.rank == 0:
        for directory, members in by_dir.items():
            if any(f in missing for f in members):
                entries = indexes[directory]
                entries.update({name_of(f): [sizes[f], known[f]] for f in members})
                _store(directory, entries)
    return [known[f] for f in files]


def assign(counts: Sequence[int], consumer: int, consumers: int, by_file: bool = True
           ) -> list[Span]:
    """The part of ``consumer`` (of ``consumers``) as ``(file, first record, end record)``
    spans: every ``consumers``-th whole file from ``consumer`` on when there are at least as
    many files as consumers (and ``by_file``), else the ``consumer``-th of ``consumers`` equal
    contiguous record ranges of all files one after another."""
    if by_file and len(counts) >= consumers:
        return [(i, 0, int(counts[i])) for i in range(consumer, len(counts), consumers)]
    total = sum(counts)
    lo, hi = total * consumer // consumers, total * (consumer + 1) // consumers
    spans: list[Span] = []
    first = 0
    for i, n in enumerate(counts):
        a, b = max(lo, first), min(hi, first + n)
        if a < b:
            spans.append((i, a - first, b - first))
        first += n
    return spans


def describe(spans: Sequence[Span]) -> dict[str, Any]:
    """A short summary of ``spans`` (files touched, records) for logs and tests."""
    return {"files": len({s[0] for s in spans}), "records": sum(s[2] - s[1] for s in spans)}
