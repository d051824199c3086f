"""Streams and events of the device stage: one copy lane per device.

A *lane* owns the side stream that every staging copy of one device runs on, and the events
that order those copies against the streams that produce and consume the data::

    producer stream --[grad_ready]--> copy stream: device -> pinned host --[copied]--> engine
    engine result in pinned host --> copy stream: host -> device --[returned]--> consumer

- ``grad_ready`` is recorded on the stream that produced the tensor (the tensor's device's
  *current* stream on the producing thread: autograd runs a gradient's hook on the stream
  its backward kernel used), and the copy stream waits on it: the copy never races the
  kernel, and the producer never waits.
- ``copied`` is what :meth:`Download.wait` synchronises on: called by shoal's engine thread
  just before it reads the host buffer (``ready=`` of the core's collectives), never by the
  thread that submitted the collective.
- ``returned`` is recorded after the copy back; the consumer stream (the caller's current
  stream, or the stream a Work's future completes on) *waits on the event*: the host does not.

Memory that a side stream touches is marked with ``record_stream`` so torch's caching
allocator does not hand it out again before the copy ran.

:class:`HostLane` is the same lane for CPU tensors, the stand-in that ``scripts/gpu-check.sh
--dry-run`` and the CPU tests walk (``SHOAL_DEVICE_STAGE_CPU=1``): the copy to the host
buffer is deferred to :meth:`Download.wait` on the engine thread, as a CUDA copy would still
be in flight when the collective is submitted, and copies back run at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["CudaLane", "Download", "HostLane", "Lane", "lane_for", "pinned_empty", "use_device"]

_thread = threading.local()


def use_device(device: torch.device) -> None:
    """Make ``device`` this thread's current CUDA device, once per thread. shoal's own threads
    (the engine, the completion pool) start with device 0 current; entering a stream of
    another device and leaving it would switch back to 0 and create a CUDA context there
    (about 0.5 GiB on GPU 0 for every rank), so they bind to the rank's device first."""
    if device.type != "cuda" or device.index is None:
        return
    if getattr(_thread, "device", None) != device.index:
        torch.cuda.set_device(device)
        _thread.device = device.index


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for staging: page-locked where CUDA is present (copies to and from it
    are asynchronous), plain host memory otherwise (the CPU stand-in)."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())


class Download:
    """A device-to-host copy in flight; :meth:`wait` returns once the host buffer holds it.

    ``waits`` counts how often it was waited on, and ``waited_on`` names the threads that
    waited (tests assert that the submitting thread never did)."""

    __slots__ = ("_copy", "_device", "_event", "waited_on")

    def __init__(self, event: torch.cuda.Event | None,
                 copy: Callable[[], None] | None = None,
                 device: torch.device | None = None) -> None:
        self._event = event
        self._copy = copy
        self._device = device
        self.waited_on: list[str] = []

    def order_stream(self) -> None:
        """Make this thread's current stream (of the copy's device) wait for the copy; on
        the CPU stand-in nothing is in flight to wait for."""
        if self._event is not None and self._device is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def wait(self) -> None:
        """Block this thread until the copy is complete (the engine's thread calls this)."""
        self.waited_on.append(threading.current_thread().name)
        if self._copy is not None:
            copy, self._copy = self._copy, None
            copy()
        if self._event is not None:
            if self._device is not None:
                use_device(self._device)
            self._event.synchronize()


class Lane:
    """The copy lane of one device (see the module docstring)."""

    device: torch.device

    def download(self, src: torch.Tensor, dst: torch.Tensor) -> Download:
        """Queue ``src`` (on this device) -> ``dst`` (host) after the work already queued on
        the stream producing ``src``."""
        raise NotImplementedError

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``src`` (host) -> ``dst`` (this device); the consumer stream waits on it."""
        raise NotImplementedError

    def order_after_producer(self) -> None:
        """Make the copy stream wait for what the current stream has queued so far."""

    def consumer_context(self) -> object:
        """A context in which the consumer stream is the copy stream itself (a Work's future
        completes there, so whoever waits on the future waits on this stream's events)."""
        return _nullcontext


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_nullcontext = _Null()


class HostLane(Lane):
    """The CPU stand-in: deferred copy to the host buffer, immediate copy back."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def download(self, src: torch.Tensor, dst: torch.Tensor) -> Download:
        return Download(None, lambda: dst.copy_(src.reshape(dst.shape)))

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.data.copy_(src.reshape(dst.shape))  # (its storage: see tensors.raw)


class CudaLane(Lane):
    """A CUDA device's copy stream and its events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def order_after_producer(self) -> None:
        grad_ready = torch.cuda.Event()
        grad_ready.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(grad_ready)

    def download(self, src: torch.Tensor, dst: torch.Tensor) -> Download:
        self.order_after_producer()
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src.reshape(dst.shape), non_blocking=True)
            # the engine thread synchronises on it: blocking, so the wait sleeps instead of
            # spinning on the core the CPU reduction needs
            copied = torch.cuda.Event(blocking=True)
            copied.record(self.copy_stream)
        src.record_stream(self.copy_stream)
        return Download(copied, device=self.device)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        consumer = torch.cuda.current_stream(self.device)
        if consumer != self.copy_stream:  # dst may still be read by queued consumer work
            self.order_after_producer()
        with torch.cuda.stream(self.copy_stream):  # (dst's storage: see tensors.raw)
            dst.data.copy_(src.reshape(dst.shape), non_blocking=True)
            returned = torch.cuda.Event()
            returned.record(self.copy_stream)
        dst.record_stream(self.copy_stream)
        consumer.wait_event(returned)

    def consumer_context(self) -> object:
        use_device(self.device)  # entering the stream then switches no device
        return torch.cuda.stream(self.copy_stream)


_lanes: dict[str, Lane] = {}
_lock = threading.Lock()


def lane_for(device: torch.device) -> Lane:
    """The copy lane of ``device`` (made once per device and process)."""
    key = str(device)
    lane = _lanes.get(key)
    if lane is None:
        with _lock:
            lane = _lanes.get(key)
            if lane is None:
                if device.type == "cuda":
                    index = device.index if device.index is not None else \
                        torch.cuda.current_device()
                    lane = CudaLane(torch.device("cuda", index))
                    key = str(device)
                elif device.type == "cpu":
                    lane = HostLane()
                else:
                    raise NotImplementedError(
                        f"shoal stages tensors on cpu and cuda devices, not {device.type!r}; "
                        f"move the tensor to one of them")
                _lanes[key] = lane
    return lane
