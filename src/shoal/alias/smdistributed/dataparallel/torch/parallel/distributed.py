"""``smdistributed.dataparallel.torch.parallel.distributed``: SMDDP's version-1
``DistributedDataParallel``, which is torch's over the default (shoal) process group."""

from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
