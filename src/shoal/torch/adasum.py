"""``DistributedOptimizer(optimizer, op=hvd.Adasum)``: Horovod's delta optimizer.

Adasum combines what the ranks would each do, not their gradients: every rank takes its own
optimizer step from the same weights, the change it made (``delta = after - before``) is
combined over the ranks with Adasum (:mod:`shoal.core.adasum`), and every rank sets its
weights to ``before + adasum(deltas)``. The learning rate needs no scaling with the number of
ranks (Adasum of parallel deltas is their average, of orthogonal ones their sum).

Horovod steps each parameter alone, inside its gradient hook, to overlap the combination with
backward; here ``step()`` steps all parameters at once and then starts every combination
together. The result is the same for optimizers whose update of a parameter depends only on
that parameter's gradient and state (SGD, Adam and the like), which is what Horovod's
per-parameter steps assume too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from shoal.core.reduction import ReduceOp

from .collectives import allreduce_async_, synchronize
from .compression import Compression
from .optimizer import Wrapper, adopt

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer(Wrapper):
    """Wrap ``optimizer`` so that ``step()`` combines the ranks' steps with Adasum (see the
    module). ``named_parameters`` name the combinations (the same names on every rank);
    ``compression`` is applied to each delta around its combination."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 process_set: Any = None) -> None:
        self._inner = self._groups_of = self._state_of = optimizer
        adopt(self, optimizer)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is None:
            self._names = {p: f"adasum.noname.{i}" for i, p in enumerate(params)}
        else:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) for x in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) "
                                 "tuples, as model.named_parameters() gives")
            self._names = {p: f"adasum.{n}" for n, p in named}
            missing = [i for i, p in enumerate(params) if p not in self._names]
            if missing:
                raise ValueError(f"named_parameters was given but names no parameter at "
                                 f"position(s) {missing} of the optimizer's groups")
        self._start = {p: torch.empty_like(p, requires_grad=False) for p in params}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local step on every rank, then each parameter's change combined with Adasum
        over the ranks and applied to the weights it started from."""
        trained = [p for p in self._start if p.requires_grad and p.grad is not None]
        with torch.no_grad():
            for p in trained:
                self._start[p].copy_(p)
        loss = self._inner.step(closure)
        handles = []
        with torch.no_grad():
            for p in trained:
                p.sub_(self._start[p])  # p is now this rank's delta
                wire, ctx = self._compression.compress(p)
                handles.append((p, wire, ctx, allreduce_async_(
                    wire, name=self._names[p], op=ReduceOp.ADASUM,
                    process_set=self.process_set)))
            for p, wire, ctx, handle in handles:
                synchronize(handle)
                torch.add(self._start[p], self._compression.decompress(wire, ctx), out=p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._inner.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Nothing to wait for: the combination happens in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's refusal: the Adasum optimizer combines steps, not gradients."""
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover
