"""Tensor <-> numpy without copies where the memory allows it.

A CPU tensor that is contiguous is handed to the core as a numpy *view* of its own memory, so
reductions write straight into it. bfloat16 tensors travel as their 16-bit words (flagged, so
the core widens them to float32 for arithmetic). Non-contiguous tensors go through a contiguous
copy that is written back. CUDA tensors are staged through pinned host memory and reduced on
the CPU (the SMDDP design: the GPU keeps computing meanwhile), then copied back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Staged", "stage"]


@dataclass
class Staged:
    """A tensor's host-side numpy view, and how to put results back into the tensor."""

    tensor: torch.Tensor   # the caller's tensor
    host: torch.Tensor     # contiguous CPU tensor the core works on (may be ``tensor``)
    array: np.ndarray      # numpy view of ``host``
    bf16: bool             # ``array`` holds bfloat16 words

    def finish(self) -> torch.Tensor:
        """Copy the host result back into the caller's tensor if it was staged; return it."""
        if self.host is not self.tensor:
            self.tensor.copy_(self.host, non_blocking=self.tensor.is_cuda)
        return self.tensor


def _numpy(host: torch.Tensor) -> tuple[np.ndarray, bool]:
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16), True
    return host.numpy(), False


def stage(tensor: torch.Tensor, *, copy: bool = False) -> Staged:
    """Prepare ``tensor`` for the core. ``copy=True`` works on a copy (out-of-place ops)."""
    t = tensor.detach()
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        done = torch.cuda.Event()
        host.copy_(t, non_blocking=True)
        done.record()
        done.synchronize()  # waits for this copy only, not for the whole device
    elif copy or not t.is_contiguous():
        host = t.contiguous().clone() if copy else t.contiguous()
    else:
        host = t
    array, bf16 = _numpy(host)
    if copy:  # the result is a new tensor on the caller's device
        target = torch.empty_like(tensor, memory_format=torch.contiguous_format) \
            if t.is_cuda else host
    else:
        target = tensor
    return Staged(target, host, array, bf16)
