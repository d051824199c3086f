"""The device stage: how tensors on a GPU reach shoal's CPU reduction and come back without
a host thread waiting on the device.

- :mod:`.streams`: one copy lane per device (its copy stream, the events that order it);
- :mod:`.staging`: pinned host buffers, the ``ready`` wait the engine thread runs, the copy
  back that the consumer stream waits on;
- :mod:`.placement`: which GPU a process uses (``CUDA_VISIBLE_DEVICES``, sharing);
- :mod:`.group`: SMDDP's intra-node path: reduce-scatter over a torch process group of the
  host's GPUs (NCCL), the shard reduced across hosts on the CPUs, allgather back.

Adapters do not branch on devices: :func:`shoal.torch.tensors.stage` hands non-host tensors
here.
"""

from __future__ import annotations

from .placement import local_device
from .staging import DeviceStaged, consumer_context, stage, upload, upload_into
from .streams import CudaLane, Download, HostLane, Lane, lane_for, pinned_empty

__all__ = ["CudaLane", "DeviceStaged", "Download", "HostLane", "Lane", "consumer_context",
           "lane_for", "local_device", "pinned_empty", "stage", "upload", "upload_into"]
