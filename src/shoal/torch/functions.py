"""``horovod.torch.functions``: broadcasting and gathering parameters, optimizer state and
Python objects (:mod:`shoal.torch.state`)."""

from .state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]
