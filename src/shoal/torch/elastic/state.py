"""``horovod.torch.elastic.state``: the state of a torch training that elastic resets keep."""

from __future__ import annotations

import copy
from typing import Any

import torch

from shoal.core import api
from shoal.core.elastic import ObjectState

from ..state import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


def _bcast(obj: Any) -> Any:
    return broadcast_object(obj, 0, name="shoal.elastic.state")


class TorchState(ObjectState):
    """The state of a torch training: ``model`` (its ``state_dict``), ``optimizer`` (its
    ``state_dict``), samplers given as keywords (:class:`ElasticSampler`, any object with
    ``state_dict``/``load_state_dict``), and other picklable attributes (``epoch=0``).

    ``sync()`` broadcasts the parameters, the optimizer state and the attributes from rank 0
    and makes samplers agree on what was processed (the union over the ranks)."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._stateful = {k: v for k, v in kwargs.items()
                          if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}
        plain = {k: v for k, v in kwargs.items() if k not in self._stateful}
        for name, obj in self._stateful.items():
            setattr(self, name, obj)
        self._saved_objects: dict[str, Any] = {}
        super().__init__(_bcast, api.rank, **plain)
        self._save_objects()

    def _save_objects(self) -> None:
        saved: dict[str, Any] = {}
        if self.model is not None:
            saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        for name, obj in self._stateful.items():
            saved[name] = copy.deepcopy(obj.state_dict())
        self._saved_objects = saved

    def save(self) -> None:
        """Copy the model, optimizer and sampler state and the attributes (in memory)."""
        self._save_objects()
        super().save()

    def restore(self) -> None:
        """Back to the last commit."""
        saved = self._saved_objects
        if self.model is not None and "model" in saved:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and "optimizer" in saved:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, obj in self._stateful.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        super().restore()

    def sync(self) -> None:
        """Rank 0's model, optimizer, samplers and attributes everywhere (a sampler then
        shares the rest of its epoch out over the current workers)."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0, model=self.model)
        for obj in self._stateful.values():
            obj.load_state_dict(self._bcast_object(obj.state_dict()))
        super().sync()
        self._save_objects()
