"""Elastic training for PyTorch, as ``horovod.torch.elastic`` spells it::

    import shoal.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):  # noqa
                ...
                state.train_sampler.record_batch(state.batch, batch_size)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch + 1)

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
    train(state)

The reset loop, the host-update check and the worker's side of the driver are shoal's core
(:mod:`shoal.core.elastic`); this module maps torch objects onto it: model and optimizer
state, samplers, and picklable attributes.
"""

from __future__ import annotations

from typing import Any

from shoal.core.elastic import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reset,
    run_fn,
)

from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


def run(func: Any) -> Any:
    """Decorate the training function ``func(state, ...)``: on a lost worker it restores the
    last commit, on added or removed hosts it keeps the state; then it joins the new world,
    syncs from rank 0 and calls ``func`` again (Horovod's ``hvd.elastic.run``)."""
    return run_fn(func, reset)
