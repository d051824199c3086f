"""Tensor <-> numpy without copies where the memory allows it.

A CPU tensor that is contiguous is handed to the core as a numpy *view* of its own memory, so
reductions write straight into it. bfloat16 tensors travel as their 16-bit words (flagged, so
the core widens them to float32 for arithmetic). Non-contiguous tensors go through a contiguous
copy that is written back.

Tensors on a device (CUDA) go through the device stage, :mod:`shoal.torch.device`: a pinned
host buffer filled on a copy stream after an event of the producing stream, a ``ready`` wait
that shoal's engine thread (never the caller's) runs before reading it, and a copy back that
the consumer stream waits on (the SMDDP design: the GPU keeps computing meanwhile). This
module is the one place that tells the two apart; callers see :class:`Staged` either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Staged", "copy_back", "fill_bytes", "numpy_of", "raw", "reduce_now",
           "result_tensor", "set_stand_in", "stage", "staged_on_device", "stand_in"]


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory without autograd, for writing a collective's result: as the c10d
    backends write a tensor's storage, a parameter that requires grad takes it, and a
    tensor autograd saved for backward is not marked modified (backward then uses the new
    values, as it does after gloo's or NCCL's in-place collectives)."""
    return t.data


class Staged:
    """A tensor's host-side numpy view, and how to put results back into the tensor.

    ``ready`` is None for host memory; for a staged device tensor it waits until the host
    copy is complete: pass it as ``ready=`` to the core's collectives."""

    __slots__ = ("array", "bf16", "host", "ready", "tensor")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, array: np.ndarray,
                 bf16: bool) -> None:
        self.tensor = tensor   # the caller's tensor (or the new result tensor)
        self.host = host       # contiguous CPU tensor the core works on (may be ``tensor``)
        self.array = array     # numpy view of ``host``
        self.bf16 = bf16       # ``array`` holds bfloat16 words
        self.ready: Callable[[], None] | None = None

    def order_after_copy(self) -> None:
        """Order the current stream after the copy to the host (host memory: nothing to
        order; see the device stage's)."""

    def finish(self) -> torch.Tensor:
        """Copy the host result back into the caller's tensor if it was staged; return it."""
        t = self.tensor
        if self.host is not t and self.host.data_ptr() != t.data_ptr():  # (not an alias)
            raw(t).copy_(self.host)
        return t


def numpy_of(host: torch.Tensor) -> tuple[np.ndarray, bool]:
    """The numpy view of a CPU tensor, and whether it holds bfloat16 words."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16), True
    return host.numpy(), False


_STAND_IN: bool | None = None


def stand_in() -> bool:
    """Whether CPU tensors go through the device stage too (``SHOAL_DEVICE_STAGE_CPU``: the
    stand-in that walks the device path without a GPU; read once per process)."""
    global _STAND_IN
    if _STAND_IN is None:
        from shoal.core import config
        _STAND_IN = bool(config.load().device_stage_cpu)
    return _STAND_IN


def set_stand_in(on: bool | None) -> None:
    """Switch the stand-in on or off in this process (None: read the setting again)."""
    global _STAND_IN
    _STAND_IN = on


def staged_on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the device stage (a device tensor, or any tensor with the
    CPU stand-in on)."""
    return not t.is_cpu or (_STAND_IN if _STAND_IN is not None else stand_in())


def stage(tensor: torch.Tensor, *, copy: bool = False, reuse: Staged | None = None,
          fetch: bool = True) -> Staged:
    """Prepare ``tensor`` for the core. ``copy=True`` works on a copy (out-of-place ops).

    ``reuse``: an earlier :class:`Staged` of a tensor of the same shape and dtype whose host
    buffer may be used again (a gradient bucket's). ``fetch=False``: the host buffer is an
    output only, its contents need not be copied from the tensor."""
    # (detach only what autograd tracks: the latency path of small synchronous allreduces)
    t = tensor.detach() if tensor.requires_grad else tensor
    if staged_on_device(t):
        from .device import staging
        return staging.stage(tensor, copy=copy, reuse=reuse, fetch=fetch)
    if copy or not t.is_contiguous():
        host = t.contiguous().clone() if copy else t.contiguous()
    else:
        host = t
    array, bf16 = numpy_of(host)
    return Staged(host if copy else tensor, host, array, bf16)


def reduce_now(comm: Any, staged: Staged, op: Any, name: str) -> np.ndarray:
    """Reduce ``staged``'s host buffer in place across ``comm`` and wait, for a caller that
    needs the values now (SyncBatchNorm's statistics, the sharded optimizer's overflow
    count). A host tensor takes the one-round path of small messages. A device tensor's
    copy to the host is waited for by shoal's engine thread, which also runs the round: this
    thread (autograd's, in SyncBatchNorm) waits for the reduction only, never for the device,
    and runs no other request's device waits or reductions; ``finish()`` brings the result
    back with the consumer stream waiting on it."""
    if staged.ready is None:
        return comm.allreduce(staged.array, op, name, out=staged.array, bf16=staged.bf16)
    handle = comm.allreduce_async(staged.array, op, name, out=staged.array, bf16=staged.bf16,
                                  ready=staged.ready)
    return handle.wait(drive=False)


def result_tensor(array: np.ndarray, like: torch.Tensor, bf16: bool) -> torch.Tensor:
    """A result array the core allocated, as a tensor on ``like``'s device."""
    if staged_on_device(like):
        from .device.staging import upload
        return upload(array, like, bf16)
    out = torch.from_numpy(np.ascontiguousarray(array))
    if not out.numel():  # (numpy's strides of an empty array are not torch's)
        out = torch.empty(out.shape, dtype=out.dtype)
    return out.view(torch.bfloat16) if bf16 else out


def copy_back(host: torch.Tensor, out: torch.Tensor) -> None:
    """Copy ``host`` (a staged host buffer, or a slice of one) into ``out``; on a device the
    copy runs on the copy stream and the consumer stream waits on it."""
    if staged_on_device(out):
        from .device.streams import lane_for
        lane_for(out.device).upload(host, out)
    else:
        raw(out).copy_(host.view(out.shape))


def fill_bytes(outs: Sequence[torch.Tensor], data: np.ndarray) -> None:
    """Copy consecutive byte ranges of ``data`` into ``outs`` (any device, any layout)."""
    sizes = [o.numel() * o.element_size() for o in outs]
    if sum(sizes) != data.nbytes:
        raise ValueError(f"received {data.nbytes} bytes for outputs of "
                         f"{sum(sizes)}; output sizes must match what the other ranks send")
    for out, end, n in zip(outs, np.cumsum(sizes), sizes, strict=True):
        if not n:
            continue
        piece = data[end - n:end]
        if staged_on_device(out):
            from .device.staging import upload_into
            upload_into(out, piece)
        else:
            raw(out).copy_(torch.from_numpy(np.ascontiguousarray(piece)).view(out.dtype)
                           .view(out.shape))
