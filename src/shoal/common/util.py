"""``horovod.common.util``: build queries and small helpers, answered for shoal.

The build queries say what shoal can do, never what makes a test run: ``gloo_built()`` is True
(shoal plays gloo's part: collectives and rendezvous without MPI), ``mpi_built()``, DDL and
oneCCL are False, and ``nccl_built()`` is NCCL's version code (as Horovod's) only where the
torch adapter's device path can use NCCL (torch with CUDA and NCCL), else 0.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from shoal.core import build_info

from .exceptions import HorovodVersionMismatchError, get_version_mismatch_message

__all__ = ["EXTENSIONS", "ccl_built", "check_installed_version", "ddl_built", "env",
           "extension_available", "get_average_backwards_compatibility_fun", "gloo_built",
           "gloo_enabled", "gpu_available", "is_iterable", "is_version_greater_equal_than",
           "mpi_built", "mpi_enabled", "nccl_built", "num_rank_is_power_2", "split_list"]

#: Horovod's extension names; shoal has adapters for the first two
EXTENSIONS = ["tensorflow", "torch", "mxnet"]
_ADAPTERS = {"tensorflow": "shoal.tensorflow", "torch": "shoal.torch"}
_T = TypeVar("_T")


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether shoal's adapter for ``ext_base_name`` (``"torch"``, ``"tensorflow"``) can be
    used here: the framework is installed. ``"mxnet"`` has no adapter."""
    module = _ADAPTERS.get(ext_base_name)
    available = module is not None and importlib.util.find_spec(ext_base_name) is not None
    if verbose and not available:
        print(f"shoal: no {ext_base_name} support here"
              + ("" if module else " (shoal has no adapter for it)"))
    return available


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework sees a GPU (shoal's adapter then stages through it)."""
    if not extension_available(ext_base_name, verbose):
        return False
    if ext_base_name == "torch":
        import torch
        return bool(torch.cuda.is_available())
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


def mpi_built(verbose: bool = False) -> bool:
    """False: shoal is not built on MPI (it runs under mpirun all the same)."""
    return build_info.mpi_built()


def gloo_built(verbose: bool = False) -> bool:
    """True: shoal plays gloo's part."""
    return build_info.gloo_built()


def mpi_enabled(verbose: bool = False) -> bool:
    """False: shoal runs no MPI."""
    return build_info.mpi_enabled()


def gloo_enabled(verbose: bool = False) -> bool:
    """True: shoal runs as Horovod does under gloo."""
    return build_info.gloo_enabled()


def nccl_built(verbose: bool = False) -> int:
    """NCCL's version code where torch with CUDA and NCCL is installed (the torch adapter's
    device path then reduces within a host over NCCL), else 0."""
    if not extension_available("torch"):
        return 0
    return int(importlib.import_module("shoal.torch").nccl_built())


def ddl_built(verbose: bool = False) -> bool:
    """False: no IBM DDL."""
    return build_info.ddl_built()


def ccl_built(verbose: bool = False) -> bool:
    """False: no oneCCL."""
    return build_info.ccl_built()


@contextlib.contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set environment variables for the ``with`` block (``None`` values are ignored) and
    restore them afterwards."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], Any]:
    """Horovod's bridge from the old ``average=`` argument to ``op=``: ``impl(op, average)``
    returns the op, refusing both at once and warning about ``average``."""
    def impl(op: Any, average: bool | None) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one "
                                 "of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                          DeprecationWarning, stacklevel=2)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: Sequence[_T], n: int) -> list[Sequence[_T]]:
    """``items`` in ``n`` contiguous chunks whose lengths differ by at most one."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def check_installed_version(name: str, version: str,
                            exception: BaseException | None = None) -> None:
    """Compare the installed version of framework ``name`` with ``version``: a warning, or
    :class:`HorovodVersionMismatchError` raised from ``exception`` when one is given. shoal
    is pure Python, so a mismatch never needs a rebuild."""
    try:
        installed = importlib.import_module(name).__version__
    except ImportError:
        installed = None
    if installed != version:
        if exception is None:
            warnings.warn(get_version_mismatch_message(name, version, str(installed)),
                          stacklevel=2)
        else:
            raise HorovodVersionMismatchError(name, version, str(installed)) from exception


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


@functools.cache
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version ``ver`` is at least ``target`` (``major.minor.patch``), by PEP 440
    (``packaging``) where installed, else by release numbers."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"This function only accepts string arguments; received "
                         f"{type(ver).__name__} {ver!r} and {type(target).__name__} {target!r}")
    if len(target.split(".")) != 3:
        raise ValueError(f"We only accepts target version values in the form of: "
                         f"major.minor.patch. Received: {target}")
    try:
        from packaging import version
    except ImportError:
        width = max(len(_release(ver)), 3)
        pad = lambda v: v + (0,) * (width - len(v))  # noqa: E731
        return pad(_release(ver)) >= pad(_release(target))
    return version.parse(ver) >= version.parse(target)
