"""``ShardedOptimizer``: ZeRO stages 1 and 2 for any ``torch.optim`` optimizer.

The plan is the core's (:mod:`shoal.core.sharding`): the trained parameters are grouped
into buckets in the order backward produces their gradients, and every bucket is split among
the ranks at parameter boundaries. This module only maps tensors and hooks onto it:

- each bucket's parameters are moved into one flat buffer (``p.data`` becomes a view of
  it), so the allgather after the step writes the new values straight into the parameters;
- a post-accumulate-grad hook copies (or, accumulating, adds) each gradient into the
  bucket's flat gradient, allocated at the step's first gradient, releases autograd's
  ``p.grad``, and starts the bucket's reduce-scatter the moment it is complete, overlapping
  backward; each rank receives the reduced gradients of its own parameters only, and the
  flat gradient is dropped as soon as the reduce-scatter is done (ZeRO-2: only the buckets
  still in flight hold a flat gradient);
- ``step()`` waits for those, runs a private copy of the wrapped optimizer over this
  rank's parameters only (so it holds their state and no other), and allgathers every
  bucket's updated parameters: all ranks end the step with the same bits.

Every rank must call ``step()``, ``state_dict()`` and ``load_state_dict()``: they are
collectives. ``state_dict()`` returns the ordinary, unsharded state dict of the wrapped
optimizer (loadable into it, or into a ``ShardedOptimizer`` on any number of ranks).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shoal.core import sharding
from shoal.core.process_sets import communicator_for
from shoal.core.reduction import ReduceOp

from .buckets import auto_bucket_bytes
from .optimizer import Wrapper, adopt
from .tensors import reduce_now, stage, staged_on_device

__all__ = ["ShardedOptimizer"]


def _name_of(comm: Any, optimizer: torch.optim.Optimizer,
             trained: list[torch.Tensor]) -> str:
    """A name from what is sharded (the optimizer's class, each parameter's shape and dtype)
    and how many such optimizers this communicator has made: the same on every rank that
    builds the same, and untouched by other optimizers only some ranks build."""
    layout = repr((type(optimizer).__qualname__,
                   [(tuple(p.shape), str(p.dtype)) for p in trained]))
    digest = hashlib.sha256(layout.encode()).hexdigest()[:10]
    return f"shard.{digest}.{comm.ordinal('shard.' + digest)}"


class _Shard:
    """One bucket of the plan, in tensors."""

    def __init__(self, bucket: sharding.Bucket, params: list[torch.nn.Parameter],
                 rank: int) -> None:
        self.plan = bucket
        self.params = params
        first = params[0]
        # zeros: the alignment gaps stay zero (the allgather moves them too)
        self.flat = torch.zeros(bucket.total, dtype=first.dtype, device=first.device)
        gaps = bucket.gaps()
        self.gap_index = torch.cat([torch.arange(a, b) for a, b in gaps]).to(first.device) \
            if gaps else None
        # the bucket's flat gradient lives from the step's first gradient until its
        # reduce-scatter is done (ZeRO-2: between steps a rank holds only its reduced shard)
        self.grad: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        lo, hi = bucket.bounds[rank], bucket.bounds[rank + 1]
        self.lo, self.hi = lo, hi
        self.reduced = torch.zeros(hi - lo, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(params, bucket.offsets, strict=True):
                view = self.flat[offset:offset + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view  # the parameter now lives in the bucket
        self.owned = [j for j in range(len(params)) if bucket.owner(j) == rank]
        self.passes = [0] * len(params)  # backward passes that reached each parameter
        self.marks: set[int] = set()  # parameters whose gradient is final for the step
        self.handle: Any = None
        self.source: Any = None     # the staged gradient bucket (its buffer is reused)
        self.staged: Any = None     # the staged reduced shard (an output)
        self.params_staged: Any = None  # the staged parameter bucket (allgathered)
        self.gathering: Any = None  # the allgather of the updated parameters, in flight

    def gradient_views(self) -> list[torch.Tensor]:
        """Each parameter's slice of the flat gradient, allocated on first use (uninitialised:
        a first pass copies over its slice, synchronize() fills the slices none reached)."""
        if self.grad is None:
            self.grad = torch.empty_like(self.flat)
            if self.gap_index is not None:  # reduced with the rest: must be finite
                self.grad.index_fill_(0, self.gap_index, 0)
            self.views = [self.grad[o:o + p.numel()].view(p.shape)
                          for p, o in zip(self.params, self.plan.offsets, strict=True)]
        return self.views

    def drop_gradient(self) -> None:
        """Drop the flat gradient (its reduce-scatter is done, or the step's gradients are
        discarded); a device tensor's pinned host copy stays, for the next step."""
        self.grad, self.views = None, []
        if not staged_on_device(self.flat):
            self.source = None  # on the host it is the flat gradient itself

    def release(self) -> None:
        """The step's gradients are done with: none held, no pass counted."""
        self.drop_gradient()
        self.passes = [0] * len(self.params)
        self.marks.clear()


class ShardedOptimizer(Wrapper):
    """Wrap ``optimizer`` so that each rank keeps and steps only its shard of the
    parameters' optimizer state, with gradients averaged (``op``) over all ranks.

    A ``torch.optim.Optimizer``: ``param_groups`` are the wrapped optimizer's (schedulers
    edit them; each step copies their hyper-parameters to this rank's shard), ``state`` is
    this rank's shard. Gradients of parameters another rank owns are ``None`` after
    ``synchronize()``; for clipping use :meth:`clip_grad_norm_`, which sees every shard.

    Backward's gradients go into their bucket's flat gradient as they come, and autograd's
    ``p.grad`` is released at once; ``synchronize()`` leaves this rank's parameters holding
    their reduced shard and drops the rest. ``backward_passes_per_step=k`` (Horovod's
    gradient accumulation) adds ``k`` backward passes' gradients in the bucket and reduces
    them once, after the k-th.

    With ``overlap_param_gather=True`` ``step()`` returns with the updated parameters still
    being allgathered: the forward of a module waits for the buckets of its own parameters
    only, so the gather of later layers overlaps the forward of earlier ones; so do the
    module's ``state_dict()``, this optimizer's calls, and :meth:`wait_params`. It is off by
    default because code that reads parameters between ``step()`` and the next forward
    (weight averaging, a parent module using a child's weight) would read stale values
    unless it calls :meth:`wait_params` first.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 op: ReduceOp = ReduceOp.AVERAGE, process_set: Any = None,
                 bucket_bytes: int | None = None, backward_passes_per_step: int = 1,
                 overlap_param_gather: bool = False) -> None:
        op = ReduceOp(op)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = backward_passes_per_step
        self.overlap_param_gather = overlap_param_gather
        self._before_forward_hook: Any = None
        self._modules: weakref.WeakSet = weakref.WeakSet()  # seen by the forward pre-hook
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"ShardedOptimizer reduces gradients with Average or Sum, not "
                             f"{op.name.capitalize()}")
        self._full = self._groups_of = optimizer
        adopt(self, optimizer)
        self.op = op
        self._comm = comm = communicator_for(process_set)
        rank, n = comm.rank, comm.size
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._index = {p: i for i, p in enumerate(params)}
        names = dict((p, name) for name, p in named_parameters or ())
        self._names = {p: names.get(p, f"param.{i}") for i, p in enumerate(params)}
        trained = [p for p in params if p.requires_grad]
        if any(p.is_sparse for p in trained):
            raise ValueError("ShardedOptimizer needs dense parameters")
        if bucket_bytes is None:
            bucket_bytes = comm.cfg.bucket_bytes or auto_bucket_bytes(
                {p.device.type for p in trained}, comm.world.local_size,
                torch.get_num_threads(), len(os.sched_getaffinity(0)),
                comm.cfg.fusion_threshold)
        self._name = _name_of(comm, optimizer, trained)
        plan = sharding.plan([p.numel() for p in trained],
                             [(p.device, p.dtype) for p in trained],
                             [p.element_size() for p in trained],
                             list(reversed(range(len(trained)))), bucket_bytes, n,
                             self._name)
        self._shards = [_Shard(b, [trained[i] for i in b.tensors], rank) for b in plan]
        self._where = {p: (s, j) for s in self._shards for j, p in enumerate(s.params)}
        mine = {s.params[j] for s in self._shards for j in s.owned}
        mine |= {p for p in params if not p.requires_grad}  # frozen: stepped by nobody
        # this rank's optimizer: the wrapped one's class and settings over its own shard
        self._inner = self._state_of = copy.copy(optimizer)
        self._inner.state = collections.defaultdict(dict)
        self._inner.param_groups = [dict(g, params=[p for p in g["params"] if p in mine])
                                    for g in optimizer.param_groups]
        for p in mine:
            if p in optimizer.state:
                self._inner.state[p] = optimizer.state[p]
        optimizer.state = collections.defaultdict(dict)  # the shards hold it now
        self._synchronized = False  # this step's gradients are reduced
        self._end_queued = False  # this backward's end reduces what is left
        self._left: dict[torch.nn.Parameter, weakref.ref] = {}  # the reduced gradients
        self._owns_any = any(s.owned for s in self._shards)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trained]
        if overlap_param_gather:
            self._watch_forwards()

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self._full!r}, shards={len(self._shards)})"

    # -- gradients -------------------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        shard, j = self._where[p]
        passes = self.backward_passes_per_step
        if self._synchronized:  # a backward after the last one's reduction, no step between
            self._new_step(p)
        if j in shard.marks:
            raise RuntimeError(f"gradient of {self._names[p]} was computed again before "
                               f"step(); call step() (or synchronize()) after every "
                               f"{passes} backward pass{'es' if passes > 1 else ''} "
                               f"(backward_passes_per_step)")
        view = shard.gradient_views()[j]
        with torch.no_grad():
            if shard.passes[j]:
                view.add_(p.grad)
            else:
                view.copy_(p.grad)
        p.grad = None  # the bucket holds it now: no full-size gradient outlives backward
        shard.passes[j] += 1
        if shard.passes[j] == passes:
            shard.marks.add(j)
            if len(shard.marks) == len(shard.params):
                self._reduce(shard)
            if not self._end_queued:  # this backward completes the step
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._end_queued = True

    def _new_step(self, p: torch.nn.Parameter) -> None:
        """A backward began after the last one's gradients were reduced, with no step
        between: a new step where they were cleared (``zero_grad``, or set to None after a
        step GradScaler skipped), refused where this backward would add to them."""
        for q, left in self._left.items():
            if left() is q.grad is not None:
                raise RuntimeError(
                    f"gradient of {self._names[p]} was computed again before step(), on top "
                    f"of the reduced ones; call optimizer.step() (or optimizer.zero_grad()) "
                    f"between backward passes, or raise backward_passes_per_step to "
                    f"accumulate gradients")
        self._synchronized = False
        self._left = {}

    def _end_of_backward(self) -> None:
        """The backward that completes a step ends (autograd's callback): it returns with
        this rank's reduced gradients, the overflow seen by every rank, as DDP's does."""
        self._end_queued = False
        # (autograd's own thread runs this: with device tensors it waits without running
        # the engine's rounds, which wait for device copies)
        on_device = bool(self._shards) and staged_on_device(self._shards[0].flat)
        self._synchronize(share_overflow=True, drive=False if on_device else None)

    def _reduce(self, shard: _Shard) -> None:
        src = shard.source = stage(shard.grad, reuse=shard.source)
        shard.staged = stage(shard.reduced, reuse=shard.staged, fetch=False)
        shard.handle = self._comm.reducescatter_async(
            src.array, op=self.op, name=f"{shard.plan.name}.grad", bf16=src.bf16,
            splits=shard.plan.splits, out=shard.staged.array, ready=src.ready)
        # done (on shoal's engine thread): nothing of the bucket but this rank's reduced
        # shard outlives it, even while backward still runs
        shard.handle.add_done_callback(lambda _handle, shard=shard: shard.drop_gradient())

    def synchronize(self) -> None:
        """Wait for every bucket's reduce-scatter (a parameter backward did not reach is
        reduced with the gradient it holds, or zeros); then this rank's parameters hold
        their reduced gradients and the others none, and a non-finite gradient on any
        rank's shard is seen by every rank (for ``GradScaler``: see ``_share_overflow``).
        After a backward that completed the step there is nothing left to wait for."""
        if not self._synchronized:
            self._synchronize(share_overflow=True)

    def _synchronize(self, share_overflow: bool, drive: bool | None = None) -> None:
        self.wait_params()
        for shard in self._shards:
            if shard.handle is None:
                views = shard.gradient_views()
                for j, p in enumerate(shard.params):
                    if shard.passes[j]:
                        continue  # accumulated by backward
                    with torch.no_grad():
                        if p.grad is not None:  # set by hand
                            views[j].copy_(p.grad)
                        else:  # backward did not reach it
                            views[j].zero_()
                self._reduce(shard)
        error: BaseException | None = None
        for shard in self._shards:
            try:
                shard.handle.wait(drive=drive)
                shard.staged.finish()
            except BaseException as exc:  # wait for the rest, then raise the first failure
                error = error or exc
            finally:
                shard.handle = None
                shard.release()
        if error is not None:
            raise error
        flag = self._share_overflow() if share_overflow else None
        for shard in self._shards:
            for j, p in enumerate(shard.params):
                if j in shard.owned:
                    offset = shard.plan.offsets[j] - shard.lo
                    p.grad = shard.reduced[offset:offset + p.numel()].view(p.shape)
                else:
                    p.grad = None
        if flag is not None and not self._owns_any:
            # nothing of the model is this rank's: one parameter holds a zero gradient with
            # the overflow (NaN where any rank's sum was not finite), so that GradScaler has
            # a gradient to check here and skips the step on this rank as on the others
            first = self._shards[0].params[0]
            stand_in = torch.zeros_like(first)
            stand_in.view(-1)[:1] = flag.to(first.dtype)
            first.grad = stand_in
        self._synchronized = True
        self._left = {p: weakref.ref(p.grad) for s in self._shards for j, p in
                      enumerate(s.params) if j in s.owned}

    def _share_overflow(self) -> torch.Tensor | None:
        """Make a non-finite reduced gradient seen by every rank, not only its shard's
        owner, so that each rank's ``GradScaler`` skips the same steps and keeps the same
        scale (the scaler checks only the gradients its optimizer holds). Every rank
        counts its shards whose sum is not finite (one pass each: a sum is non-finite when
        any value is, or when finite values sum past the dtype's range, which the scaler
        would have to skip too), the counts are summed, and where the sum is not zero each
        shard's first value becomes NaN. Device operations only: the count travels through
        the device stage, no host wait.

        Done at the end of the backward that completes a step (a GradScaler's
        ``unscale_`` follows it) and by ``synchronize()``; ``step()`` after a
        ``synchronize()`` of its own skips it: without a scaler a non-finite value reaches
        every rank through the allgather of the parameters it corrupts."""
        owned = [s.reduced for s in self._shards if s.reduced.numel()]
        if not self._shards:
            return None
        device = self._shards[0].flat.device
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for reduced in owned:  # (a rank that owns nothing still joins with 0)
            bad += (~torch.isfinite(reduced.sum())).to(device=device, dtype=torch.float32)
        flag = stage(bad)
        reduce_now(self._comm, flag, ReduceOp.SUM, f"{self._name}.overflow")
        poison = torch.where(flag.finish() > 0, float("nan"), 0.0)
        for reduced in owned:
            reduced[:1].add_(poison.to(reduced.dtype))
        return poison

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's ``synchronize(); ...; with skip_synchronize(): step()``: ``step()``
        after ``synchronize()`` never reduces again, so this only keeps such code
        working."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients of every rank's shard by their global norm (as
        ``torch.nn.utils.clip_grad_norm_`` over the whole model); returns the norm."""
        if not self._synchronized:
            self.synchronize()
        grads = [s.reduced for s in self._shards]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((g.abs().max().item() for g in grads if g.numel()), default=0.0)
            total = torch.tensor(self._comm.allreduce(
                torch.tensor([local], dtype=torch.float64).numpy(), op=ReduceOp.MAX,
                name="shard.clip.max")[0])
        else:
            local = sum((g.double().abs() ** norm_type).sum().item() for g in grads)
            total = torch.tensor(float(self._comm.allreduce(
                torch.tensor([local], dtype=torch.float64).numpy(), op=ReduceOp.SUM,
                name="shard.clip.sum")[0]) ** (1.0 / norm_type))
        scale = max_norm / (float(total) + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        return total

    # -- the step --------------------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        """Run ``closure`` (if given), wait for the reduced gradients, step this rank's
        shard, and allgather the updated parameters into every rank's model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_params()  # the last step's gather reads the shard this step writes
        if not self._synchronized:
            self._synchronize(share_overflow=False)
        self._synchronized, self._left = False, {}
        for inner, full in zip(self._inner.param_groups, self._full.param_groups,
                               strict=True):
            for key, value in full.items():
                if key != "params":
                    inner[key] = value
        self._inner.step()
        # in forward's order (the buckets are in backward's): the first layers' weights,
        # which the next forward needs first, are on their way first
        for shard in reversed(self._shards):
            staged = shard.params_staged = stage(shard.flat, reuse=shard.params_staged)
            shard.gathering = (staged, self._comm.allgather_async(
                staged.array[shard.lo:shard.hi], name=f"{shard.plan.name}.param",
                out=staged.array, ready=staged.ready))
        if self.overlap_param_gather:
            self._watch_forwards()
        else:
            self.wait_params()
        return loss

    def _watch_forwards(self) -> None:
        """Install the process-wide forward pre-hook (from construction, so that the first
        forward already finds the modules, until the gathers in flight have arrived)."""
        if self._before_forward_hook is None:
            self._before_forward_hook = \
                torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        """A module's forward waits for the buckets of its own parameters. A module seen for
        the first time that holds any of them, itself or through its children (the whole
        model among them), learns to wait in its ``state_dict()``."""
        if module not in self._modules:
            self._modules.add(module)
            if any(p in self._where for p in module.parameters()):
                me = weakref.ref(self)
                module.register_state_dict_pre_hook(
                    lambda *_: (opt := me()) is not None and opt.wait_params())
        for p in module._parameters.values():
            where = self._where.get(p) if p is not None else None
            if where is not None and where[0].gathering is not None:
                self._wait_gather(where[0])

    def _wait_gather(self, shard: _Shard) -> None:
        staged, handle = shard.gathering
        shard.gathering = None
        handle.wait()
        staged.finish()
        if self._before_forward_hook is not None and \
                all(s.gathering is None for s in self._shards):
            self._before_forward_hook.remove()
            self._before_forward_hook = None

    def wait_params(self) -> None:
        """Wait until every bucket's updated parameters have arrived (``step()`` leaves them
        in flight; forward waits for its own)."""
        error: BaseException | None = None
        for shard in self._shards:
            if shard.gathering is not None:
                try:
                    self._wait_gather(shard)
                except BaseException as exc:  # wait for the rest, then raise the first
                    error = error or exc
        if error is not None:
            raise error

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes make a step (not while a step's are under way)."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if any(s.handle is not None or any(s.passes) for s in self._shards):
            raise RuntimeError("set_backward_passes_per_step() called during a step's "
                               "backward passes; call it after step()")
        self.backward_passes_per_step = passes

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (refused while reductions are in flight)."""
        in_flight = sum(s.handle is not None for s in self._shards)
        if in_flight:
            raise RuntimeError(f"zero_grad() called with {in_flight} gradient buckets in "
                               f"flight; call step() or synchronize() first")
        for shard in self._shards:  # gradients accumulated so far go, as autograd's would
            shard.release()
        self._synchronized, self._left = False, {}
        for group in self._full.param_groups:
            for p in group["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's ordinary state dict, the same on every rank (a collective:
        each rank contributes its shard)."""
        self.wait_params()
        mine = {self._index[p]: {k: v.detach().cpu() if torch.is_tensor(v) else v
                                 for k, v in state.items()}
                for p, state in self._inner.state.items() if state}
        merged: dict[int, Any] = {}
        for part in self._comm.allgather_object(mine, name="shard.state_dict"):
            merged.update(part)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._index[p] for p in g["params"]]}
                  for g in self._full.param_groups]
        return {"state": dict(sorted(merged.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an ordinary (consolidated) state dict: each rank keeps its shard's part."""
        self.wait_params()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != \
                [len(g["params"]) for g in self._full.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this "
                             "optimizer's (a different model or optimizer)")
        for full, saved in zip(self._full.param_groups, groups, strict=True):
            full.update({k: v for k, v in saved.items() if k != "params"})
        inner_state: dict[int, Any] = {}
        inner_groups = []
        j = 0
        for group, saved in zip(self._inner.param_groups, groups, strict=True):
            ids = []
            for p in group["params"]:
                state = state_dict["state"].get(self._index[p])
                if state is not None:
                    inner_state[j] = state
                ids.append(j)
                j += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": ids})
        self._inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after wrapping: the shards are fixed at wrap time."""
        raise NotImplementedError("add parameter groups before wrapping the optimizer")

    def remove_hooks(self) -> None:
        """Detach from the parameters' gradients."""
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
