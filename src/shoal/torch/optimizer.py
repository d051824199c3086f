"""``DistributedOptimizer``: Horovod's semantics, with communication overlapping backward.

Every parameter that requires a gradient gets a post-accumulate-grad hook. When a gradient is
final for the step (after ``backward_passes_per_step`` backward passes), the hook puts it in its
bucket (:mod:`shoal.torch.buckets`: flat buffers of about ``bucket_bytes``, in the order
backward produces gradients); a full bucket goes to the engine at once, so its reduction runs
while backward is still computing earlier layers; backward's end waits for what is still in
flight (below), and ``step()`` runs the wrapped optimizer.

Parameters that got no gradient in a step (unused branches) are reduced at ``synchronize()``
with the gradient they hold, zeros if they hold none, as Horovod does: every rank must reduce
the same set, or the ranks that did compute it would wait forever. Frozen parameters
(``requires_grad=False``) are never touched.

The backward pass that completes a step (the k-th with ``backward_passes_per_step=k``)
returns with its gradients reduced, as DDP's does: at its end (an autograd callback) the
buckets backward left incomplete are submitted and every reduction is waited for, so code
between ``backward()`` and ``step()`` sees the averaged gradients. The stock recipes work
as torch documents them::

    scaler.scale(loss).backward()           # returns with the reduced, scaled gradients
    scaler.unscale_(optimizer)              # every rank unscales the same bits
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                  # skipped on every rank alike
    scaler.update()                         # the same scale everywhere

Horovod's recipe (``optimizer.synchronize()`` after backward, then ``with
optimizer.skip_synchronize(): optimizer.step()``) works too and reduces nothing twice. Only
the time between backward's end and ``step()`` is no longer overlapped; backward itself
overlaps as before. ``compression=Compression.fp16`` sends fp32 and fp16 gradients as fp16
and sums them in fp32.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import shoal
from shoal.core.api import default_communicator
from shoal.core.elastic import elastic_job
from shoal.core.gradients import check_predivide
from shoal.core.process_sets import communicator_for
from shoal.core.reduction import ReduceOp

from .buckets import Buckets, auto_bucket_bytes
from .compression import Compression

__all__ = ["DistributedOptimizer", "Wrapper", "adopt"]


def adopt(wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Set up a wrapper that shares ``optimizer``'s groups instead of calling
    ``Optimizer.__init__`` (which would copy them): its defaults, and the hook registries the
    torch utilities look for."""
    wrapper.defaults = optimizer.defaults
    for registry in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
        setattr(wrapper, registry, collections.OrderedDict())


class Wrapper(torch.optim.Optimizer):
    """An optimizer that wraps another: ``param_groups`` are ``_groups_of``'s, ``state`` is
    ``_state_of``'s (shared, not copied: schedulers and user code edit either object)."""

    _groups_of: torch.optim.Optimizer
    _state_of: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._groups_of.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._groups_of.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._state_of.state

    @state.setter
    def state(self, value: Any) -> None:
        self._state_of.state = value


_CLASSES: dict[tuple[type, type], type] = {}


def _distributed_class(cls: type, base: type) -> type:
    """The subclass of ``cls`` (a DistributedOptimizer class) and optimizer class ``base``,
    made once per pair by an ordinary ``class`` statement, so it can itself be subclassed.
    ``cls`` comes first: its methods (``step``, ``zero_grad``, the shared ``param_groups``)
    win over ``base``'s, whose ``__init__`` is never called."""
    if issubclass(cls, base):
        return cls
    made = _CLASSES.get((cls, base))
    if made is None:
        class Distributed(cls, base):  # type: ignore[valid-type,misc]
            __doc__ = f"{base.__name__} whose gradients are averaged over all shoal ranks."

        Distributed.__name__ = Distributed.__qualname__ = base.__name__
        Distributed.__module__ = __name__
        made = _CLASSES[cls, base] = Distributed
    return made


class DistributedOptimizer(Wrapper):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    It *is* a ``torch.optim.Optimizer`` (learning-rate schedulers accept it) and shares the
    wrapped optimizer's ``param_groups`` and ``state``, so changes through either are seen by
    both. ``bucket_bytes`` (a shoal extension; default the ``SHOAL_BUCKET_BYTES`` knob, whose
    default 0 picks a size by :func:`shoal.torch.buckets.auto_bucket_bytes`) sizes the
    gradient buckets: smaller ones start reducing earlier in backward, larger ones cost fewer
    round trips and leave backward's cores alone.
    """

    def __new__(cls, optimizer: torch.optim.Optimizer,
                named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                compression: Any = Compression.none, backward_passes_per_step: int = 1,
                op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                process_set: Any = None, bucket_bytes: int | None = None,
                sharded: bool = False) -> Any:
        """An instance of a subclass of both this class and ``type(optimizer)`` (as Horovod's
        is: ``isinstance(hvd.DistributedOptimizer(SGD(...)), SGD)``); ``sharded=True``: a
        :class:`~shoal.torch.sharded.ShardedOptimizer` (ZeRO stages 1 and 2: each rank keeps
        and steps 1/N of the optimizer state); ``op=Adasum``: a
        :class:`~shoal.torch.adasum.AdasumOptimizer` (Horovod's delta optimizer)."""
        if isinstance(optimizer, Wrapper):
            raise TypeError(f"the optimizer is wrapped already ({optimizer!r}); wrap the plain "
                            f"optimizer once")
        if op == ReduceOp.ADASUM:  # Horovod's delta optimizer
            if sharded or gradient_predivide_factor != 1.0 or sparse_as_dense:
                raise ValueError("DistributedOptimizer(op=Adasum) combines the ranks' steps; "
                                 "it takes no sharded, gradient_predivide_factor or "
                                 "sparse_as_dense")
            from .adasum import AdasumOptimizer
            return AdasumOptimizer(optimizer, named_parameters, compression,
                                   backward_passes_per_step, process_set)
        if not sharded:
            return super().__new__(_distributed_class(cls, type(optimizer)))
        unsupported = [what for what, bad in (
            ("compression", compression is not Compression.none),
            ("gradient_predivide_factor", gradient_predivide_factor != 1.0),
            ("sparse_as_dense", sparse_as_dense)) if bad]
        if unsupported:
            raise ValueError(f"DistributedOptimizer(sharded=True) does not take "
                             f"{', '.join(unsupported)}; leave them at their defaults")
        from .sharded import ShardedOptimizer
        return ShardedOptimizer(optimizer, named_parameters, op=op, process_set=process_set,
                                bucket_bytes=bucket_bytes,
                                backward_passes_per_step=backward_passes_per_step)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                 process_set: Any = None, bucket_bytes: int | None = None,
                 sharded: bool = False) -> None:
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        check_predivide(op, gradient_predivide_factor)
        # share, do not copy: schedulers and user code edit param_groups through either object;
        # Optimizer.__init__ is not called (it would copy the groups), so set up its hook
        # registries here for the torch utilities that use them
        self._inner = self._groups_of = self._state_of = optimizer
        adopt(self, optimizer)
        self._passes = backward_passes_per_step
        # Horovod's groups/num_groups only decide which gradients are fused together; shoal
        # fuses by bucket (bucket_bytes), so they are accepted and need no action
        self.backward_passes_per_step = backward_passes_per_step
        self.op, self.process_set, self.sparse_as_dense = op, process_set, sparse_as_dense

        self._names = self._name_parameters(named_parameters)
        self._parameter_names = self._names  # Horovod's attribute
        self._counts: dict[torch.nn.Parameter, int] = {}
        self._synchronized = False  # the user called synchronize() since the last step
        self._reduced = False  # this step's gradients are reduced (nothing in flight)
        self._end_queued = False  # this backward's end reduces what is left
        self._left: dict[torch.nn.Parameter, weakref.ref] = {}
        self._skip = False
        self._hooks = []
        self._setup = (bucket_bytes, compression, gradient_predivide_factor)
        self._bind(check=not elastic_job())
        for p in self._names:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _bind(self, check: bool = True) -> None:
        """Attach to the current communicator: the buckets depend on its size. Done again
        when shoal was shut down and initialised anew (an elastic reset)."""
        bucket_bytes, compression, predivide = self._setup
        process_set = self.process_set
        # a rank outside the process set steps on its own gradients, as in Horovod
        member = process_set is None or process_set.included()
        self._comm = communicator_for(process_set) if member else None
        self._bound_to = default_communicator()
        if check:
            self._check_same_model_everywhere()
        trained = [p for p in self._names if p.requires_grad]
        # alone, every reduction is the identity: no buckets; gradients are counted (for the
        # same errors as with peers) and left where backward put them, as Horovod does
        self._buckets: Buckets | None = None
        if self._comm is not None and self._comm.size > 1:
            if bucket_bytes is None:
                cfg = self._comm.cfg
                bucket_bytes = cfg.bucket_bytes or auto_bucket_bytes(
                    {p.device.type for p in trained}, self._comm.world.local_size,
                    torch.get_num_threads(), len(os.sched_getaffinity(0)),
                    cfg.fusion_threshold)
            self._buckets = Buckets(trained, self._names, bucket_bytes, compression,
                                    self.op, predivide, process_set, self.sparse_as_dense)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r})"

    # -- set-up ----------------------------------------------------------------------------
    def _name_parameters(self, named: Iterable[tuple[str, torch.nn.Parameter]] | None
                         ) -> dict[torch.nn.Parameter, str]:
        params = [p for group in self._inner.param_groups for p in group["params"]]
        if named is None:
            return {p: f"grad.param.{i}" for i, p in enumerate(params)}
        names: dict[torch.nn.Parameter, str] = {}
        seen: set[str] = set()
        for name, p in named:
            if name in seen:
                raise ValueError(f"parameter name {name!r} appears twice in named_parameters; "
                                 f"names must be unique (they name the reductions)")
            seen.add(name)
            names[p] = f"grad.{name}"
        missing = [i for i, p in enumerate(params) if p not in names]
        if missing:
            raise ValueError(f"named_parameters does not name the optimizer's parameters at "
                             f"positions {missing[:10]}; pass model.named_parameters() of the "
                             f"model whose parameters the optimizer holds")
        return {p: names[p] for p in params}

    def _check_same_model_everywhere(self) -> None:
        """Fail now, on every rank, if ranks hold different models (not later, in a hang)."""
        if self._comm is None:
            return
        mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad)
                for p, name in self._names.items()]
        everyone = self._comm.allgather_object(mine, name="shoal.torch.optimizer.check")
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                diff = next(((a, b) for a, b in zip(mine, theirs, strict=False) if a != b),
                            (f"{len(mine)} parameters", f"{len(theirs)} parameters"))
                raise shoal.CollectiveMismatchError(
                    f"rank {shoal.rank()}: DistributedOptimizer wraps a different model than "
                    f"rank {rank}: here {diff[0]}, there {diff[1]}; every rank must build the "
                    f"same model and pass the same parameters")

    # -- the hot path ----------------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._counts:
            if self._bound_to is not default_communicator():
                self._bind(check=False)  # shoal re-initialised since the last step: rebind
            elif self._reduced and (left := self._left.get(p)) is not None and \
                    left() is p.grad:
                # the reduced gradient this backward accumulated into was never stepped
                # with nor cleared (a step GradScaler skipped is followed by zero_grad())
                raise RuntimeError(
                    f"gradient of {self._names[p]} was computed again before step(), on top "
                    f"of the reduced one; call optimizer.step() (or optimizer.zero_grad()) "
                    f"between backward passes, or raise backward_passes_per_step to "
                    f"accumulate gradients")
            self._synchronized = self._reduced = False  # a new step's backward
        count = self._counts.get(p, 0) + 1
        self._counts[p] = count
        if count == self._passes:
            if self._buckets is not None:
                self._buckets.arrived(p)
            if not self._end_queued:  # this backward completes the step
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._end_queued = True
        elif count > self._passes:
            if self._bound_to is not default_communicator():  # a step cut short by a lost
                self._counts.clear()                          # peer, then a re-init
                self._on_grad(p)
                return
            raise RuntimeError(f"gradient of {self._names[p]} was computed "
                               f"again before step(); call optimizer.step() (or "
                               f"synchronize()) between backward passes, or raise "
                               f"backward_passes_per_step")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce after every ``passes`` backward passes from now on (Horovod's method; call
        it between steps, on every rank)."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if self._buckets is not None and self._buckets.in_flight:
            raise RuntimeError("set_backward_passes_per_step() called with gradients in flight; "
                               "call step() or synchronize() first")
        self._passes = self.backward_passes_per_step = passes
        self._counts.clear()

    def _end_of_backward(self) -> None:
        """The backward that completes a step ends (autograd's callback): reduce what is
        left and wait, so it returns with the step's gradients reduced."""
        self._end_queued = False
        self._reduce(drive=None if self._buckets is None or not self._buckets.on_device
                     else False)

    def _reduce(self, drive: bool | None = None) -> None:
        try:
            if self._buckets is not None:
                self._buckets.finish(drive)
        finally:
            self._counts.clear()
            self._end_queued = False  # (a backward that raised never ran its callback)
        self._reduced = True
        # the gradients as reduced: a backward into them before step() or zero_grad() is
        # refused (weak: a cleared gradient is not kept alive)
        self._left = {p: weakref.ref(p.grad) for p in self._names if p.grad is not None}

    def synchronize(self) -> None:
        """Wait for every gradient's reduction (parameters backward gave no gradient are
        reduced with the gradient they hold, or zeros, so every rank reduces the same set).
        After a backward that completed the step there is nothing left to wait for."""
        if not self._reduced:
            self._reduce()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``synchronize(); clip_grad_norm_(...); with skip_synchronize(): step()``."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Any = None) -> Any:
        """Wait for the gradients still in flight, then run the wrapped optimizer's step."""
        if self._synchronized and not self._skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(): the gradients are reduced "
                          "again. Use `with optimizer.skip_synchronize(): optimizer.step()` "
                          "after synchronize() (e.g. for gradient clipping).", stacklevel=2)
            self._reduced = False  # Horovod's rule: reduced again, as it warned
        if not self._reduced:
            self._reduce()
        self._synchronized = self._reduced = False
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refused while reductions are in flight (they would be lost)."""
        in_flight = self._buckets.in_flight if self._buckets is not None else 0
        if in_flight:
            raise RuntimeError(f"zero_grad() called with "
                               f"{in_flight} gradient buckets in flight; call "
                               f"step() or synchronize() first")
        self._inner.zero_grad(set_to_none=set_to_none)
        self._reduced = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after wrapping: hooks and names are fixed at wrap time."""
        raise NotImplementedError("add parameter groups before wrapping the optimizer in "
                                  "DistributedOptimizer")

    def remove_hooks(self) -> None:
        """Detach from the parameters (the optimizer then no longer reduces anything)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
