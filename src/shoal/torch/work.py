"""c10d work items of backend ``"shoal"``, and the tensor <-> byte helpers its process
group uses."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import shoal
from shoal.core.errors import ShoalTimeoutError

from .device.staging import consumer_context
from .device.streams import lane_for
from .tensors import Staged, stage

__all__ = ["DistTimeoutError", "ShoalWork", "stage_bytes", "timeout_seconds"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _completions() -> ThreadPoolExecutor:
    """The pool completing futures (a second thread only when a callback blocks)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shoal-torch-done")
        return _pool


def timeout_seconds(timeout: Any) -> float | None:
    """A c10d timeout (timedelta, seconds or None; <= 0 means none) in seconds."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return None if timeout is None or timeout <= 0 else float(timeout)


def stage_bytes(tensor: torch.Tensor, fetch: bool = True) -> tuple[Staged, np.ndarray]:
    """``tensor`` staged on the host, and its flat bytes (moved as-is: any dtype works); the
    staged tensor's ``ready`` must be passed along with the bytes. ``fetch=False``: an
    output buffer only."""
    st = stage(tensor, fetch=fetch)
    return st, st.host.reshape(-1).view(torch.uint8).numpy()



class DistTimeoutError(ShoalTimeoutError, dist.DistBackendError):
    """A torch collective of backend "shoal" ran past its timeout: torch's
    ``DistBackendError`` (as gloo raises), and shoal's ``ShoalTimeoutError``."""


_DONE = threading.Event()  # the "done" of every work completed before it was returned
_DONE.set()


def _timed_out(secs: float | None) -> DistTimeoutError:
    return DistTimeoutError(
        f"backend 'shoal': Timed out waiting {(secs or 0) * 1000:.0f}ms for a torch "
        f"collective to complete (a rank that has not joined it is slow, stuck or dead)")


class ShoalWork(dist.Work):
    """A c10d work item backed by shoal handles.

    ``get_future()`` completes (on the completion pool) once every handle is done and the
    results are written back; ``wait(timeout)`` drives the collectives on the calling thread
    and raises their error, or :class:`shoal.ShoalTimeoutError` past the timeout.
    """

    def __init__(self, handles: Sequence[shoal.Handle], finish: Callable[[], Any],
                 devices: Sequence[torch.device] = (), timeout: float | None = None,
                 source: Callable[[], int | None] | None = None) -> None:
        super().__init__()
        self._source = source  # a receive's sender, once it is known
        cuda = sorted({str(d) for d in devices if d.type == "cuda"})
        self._devices = [torch.device(d) for d in cuda]
        for device in self._devices:
            # results land through the copy stream; it must not overtake what the caller
            # queued before the collective (a zero-fill before recv into the same buffer),
            # also where no input was staged and so nothing ordered it yet
            lane_for(device).order_after_producer()
        self._future: torch.futures.Future = torch.futures.Future(devices=cuda or None)
        self._handles = list(handles)
        self._finish = finish
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._left = len(self._handles)
        self._lock = threading.Lock()
        self._starting = True  # callbacks now run on the caller's thread: finish inline
        if not self._handles:
            self._complete()
        for handle in self._handles:  # the engine thread runs this; it only hands over
            handle.add_done_callback(self._on_handle)
        self._starting = False

    @classmethod
    def completed(cls, value: Any, timeout: float | None = None) -> ShoalWork:
        """A work done before it is returned, with ``value`` as its result: what a group of
        one rank returns, without the machinery of a work that waits for collectives."""
        work = cls.__new__(cls)
        dist.Work.__init__(work)
        work._source, work._devices, work._handles, work._finish = None, [], [], None
        work._timeout, work._done, work._error, work._left = timeout, _DONE, None, 0
        work._lock, work._starting = None, False
        work._future = torch.futures.Future()
        work._future.set_result(value)
        return work

    def _on_handle(self, _: Any) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
            inline = self._starting
        if last and inline:  # done at submission (a group of one): no thread hand-off
            self._complete()
        elif last:
            _completions().submit(self._complete)

    def _complete(self) -> None:
        # on a GPU the copies back run on the device's copy stream, and the future records
        # its completion event there: whoever waits on the future (DDP, wait()) makes its own
        # stream wait on that event, and no host thread waits for the device
        with consumer_context(self._devices):
            try:
                for handle in self._handles:
                    exc = handle.exception()
                    if exc is not None:
                        raise exc
                value = self._finish()
            except BaseException as exc:  # delivered through wait() and the future
                self._error = exc
                self._future.set_exception(exc)
            else:
                self._future.set_result(value)
            finally:
                self._done.set()

    def handles_done(self, timeout: float | None = None) -> None:
        """Wait until shoal has finished this work's collectives (results not yet copied)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in self._handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(left)
            except TimeoutError as exc:
                raise _timed_out(timeout) from exc

    def wait(self, timeout: Any = None) -> bool:
        """Block until done (at most ``timeout``, default the group's); raise its error."""
        secs = timeout_seconds(timeout)
        secs = self._timeout if secs is None else secs
        start = time.monotonic()
        with contextlib.suppress(Exception):  # a failure: raised below, from the future
            self.handles_done(secs)
        left = None if secs is None else max(0.0, secs - (time.monotonic() - start))
        if not self._done.wait(left):
            raise _timed_out(secs)
        if self._error is not None:
            raise self._error
        if self._devices:  # the caller's current stream waits on the copies back
            self._future.wait()
        return True

    def result(self) -> Any:
        """The tensors of the finished work (what gloo's ``Work.result()`` returns); waits
        for it first."""
        self.wait()
        return self._future.value()

    def is_success(self) -> bool:
        """Finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the work ended with (None while running or after success)."""
        return self._error

    def get_future_result(self) -> torch.futures.Future:
        """A future of the ``WorkResult`` (as an int: SUCCESS 0, TIMEOUT 1, COMM_ERROR 2),
        completed with the work (the contract NCCL's works keep; gloo's do not offer it)."""
        out: torch.futures.Future = torch.futures.Future()

        def settle(_: Any) -> None:
            error = self._error
            out.set_result(0 if error is None else 1 if isinstance(error, TimeoutError) else 2)
        self._future.add_done_callback(settle)
        return out

    def _source_rank(self) -> int:
        """The sender of a finished receive (``dist.recv`` without ``src`` returns it)."""
        sender = None if self._source is None else self._source()
        if sender is None:
            raise RuntimeError("shoal backend: _source_rank() is only defined for receives")
        return int(sender)

    def get_future(self) -> torch.futures.Future:
        """The future of this work's output tensors."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the results are in place (or the work failed)."""
        return self._done.is_set()
