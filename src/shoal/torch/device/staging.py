"""Tensors on a device, staged through pinned host buffers for shoal's CPU reduction.

:func:`stage` is what :func:`shoal.torch.tensors.stage` hands every tensor that does not live
in host memory (and, with ``SHOAL_DEVICE_STAGE_CPU=1``, CPU tensors too: the stand-in that
walks this path without a GPU). It returns a :class:`DeviceStaged` whose

- ``array`` is the numpy view of a pinned host buffer; the copy into it is queued on the
  device's copy stream, after an event recorded on the stream that produced the tensor;
- ``ready`` waits for that copy: pass it to the core's collective (``ready=``) and shoal's
  engine thread calls it right before it reads the buffer, so the submitting thread (the
  autograd thread, in a gradient hook) never waits for the device;
- ``finish()`` queues the copy back on the copy stream and makes the consumer stream wait on
  its event: no host wait.

A staged tensor given as ``reuse`` lends its pinned buffer to the next staging of a tensor of
the same shape and dtype (a gradient bucket allocates its buffer once): the copies that used
it last ran on the same copy stream, so stream order keeps them apart, and the engine writes
into the buffer only after ``ready``. Other staging buffers come from torch's caching host
allocator, which reuses a freed pinned block once the copies queued on it have completed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..tensors import Staged, numpy_of
from .streams import Download, Lane, lane_for, pinned_empty

__all__ = ["DeviceStaged", "consumer_context", "stage", "upload", "upload_into"]

class DeviceStaged(Staged):
    """A device tensor's pinned host copy, the copy's completion, and the way back."""

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, array: np.ndarray,
                 bf16: bool, lane: Lane, download: Download | None,
                 writes_back: bool) -> None:
        super().__init__(tensor, host, array, bf16)
        self.lane = lane
        self.download = download
        self.ready = download.wait if download is not None else None
        self._writes_back = writes_back

    def order_after_copy(self) -> None:
        """Make the current stream wait until the copy to the host has read the tensor, so
        that work queued next may write it (a stream wait: the host does not wait)."""
        if self.download is not None:
            self.download.order_stream()

    def finish(self) -> torch.Tensor:
        """Queue the host result's copy into the caller's tensor; the consumer stream waits
        on it (call after the collective completed). Returns the tensor."""
        if self._writes_back:
            self.lane.upload(self.host, self.tensor)
        return self.tensor


def _pinned(t: torch.Tensor, reuse: Staged | None) -> torch.Tensor:
    host = getattr(reuse, "host", None)
    if isinstance(reuse, DeviceStaged) and host is not None and host.shape == t.shape and \
            host.dtype == t.dtype:
        return host
    return pinned_empty(t.shape, t.dtype)


def stage(tensor: torch.Tensor, *, copy: bool = False, reuse: Staged | None = None,
          fetch: bool = True) -> DeviceStaged:
    """Stage ``tensor`` through a pinned host buffer (see the module docstring).

    ``copy=True``: the result goes to a new tensor on the tensor's device (out-of-place ops).
    ``fetch=False``: the buffer is an output only (nothing is copied to the host)."""
    t = tensor.detach()
    lane = lane_for(t.device)
    host = _pinned(t, reuse)
    download = lane.download(t, host) if fetch else None
    array, bf16 = numpy_of(host)
    target = torch.empty_like(tensor, memory_format=torch.contiguous_format) if copy \
        else tensor
    return DeviceStaged(target, host, array, bf16, lane, download, writes_back=True)


def upload(array: np.ndarray, like: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """A new tensor on ``like``'s device holding ``array`` (a result the core allocated):
    copied once into pinned memory, then to the device on the copy stream; the consumer
    stream waits on it."""
    src = torch.from_numpy(np.ascontiguousarray(array))
    if bf16:
        src = src.view(torch.bfloat16)
    host = pinned_empty(src.shape, src.dtype)
    host.copy_(src)
    out = torch.empty(src.shape, dtype=src.dtype, device=like.device)
    lane_for(like.device).upload(host, out)
    return out


def upload_into(out: torch.Tensor, raw: np.ndarray) -> None:
    """Copy the bytes ``raw`` into ``out`` (any device, any layout) through pinned memory."""
    host = pinned_empty((out.numel(),), out.dtype)
    host.view(torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(raw)))
    target = out if out.is_contiguous() else torch.empty_like(
        out, memory_format=torch.contiguous_format)
    lane_for(out.device).upload(host.view(out.shape), target)
    if target is not out:
        out.data.copy_(target)  # (its storage: see tensors.raw)


def consumer_context(devices: Any) -> Any:
    """The copy stream as current stream for the first device of ``devices`` that has one
    (a Work completes its future there), else a no-op context."""
    for d in devices:
        if d.type == "cuda":
            return lane_for(d).consumer_context()
    return lane_for(torch.device("cpu")).consumer_context()

