"""Gradient buckets: one reduction per group of parameters instead of one per parameter.

A model such as EfficientNet-B0 has over two hundred parameter tensors, most of them small;
handing each to the engine costs a Python round trip, a negotiation bit and a handle per
tensor, which on a CPU worker is a visible share of the step. :class:`Buckets` packs the
gradients into flat buffers of about ``bucket_bytes`` each, in the order backward produces them
(reverse registration order first; the order actually seen in the first step from then on, as
rank 0 saw it, so all ranks agree), and submits a bucket the moment its last gradient arrives.

After the reduction each parameter's ``.grad`` *is* a view of its slice of the bucket (what
DDP calls ``gradient_as_bucket_view``), so when gradients are zeroed in place rather than set to
None, backward accumulates straight into the buffer and the copy-in disappears.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.core.collectives import Handle
from shoal.core.gradients import predivide
from shoal.core.process_sets import communicator_for
from shoal.core.reduction import ReduceOp

from .collectives import sparse_allreduce_async
from .compression import user_compressor as _user_compressor
from .compression import wire_codec
from .device.group import GroupReduction, device_group_for
from .tensors import Staged, stage, staged_on_device

__all__ = ["Buckets", "auto_bucket_bytes"]

#: Bucket size when reductions should overlap backward.
OVERLAP_BUCKET_BYTES = 2 << 20


def auto_bucket_bytes(device_types: set[str], local_size: int, threads: int, cores: int,
                      fusion_threshold: int) -> int:
    """The bucket size when the user sets none (``SHOAL_BUCKET_BYTES=0``, the default).

    Small buckets (2 MiB) let reductions run while backward computes: right when the compute is
    on an accelerator and the CPU, which reduces, is otherwise idle (the SMDDP design), or when
    the host has cores to spare. But when the gradients live in host memory and this host's
    workers already keep every core busy (``local_size x threads >= cores``), a reduction
    during backward only takes turns with it on the same cores, and the lock-step shared-memory
    rounds wait for descheduled peers: measured here (EfficientNet-B0, 32 px, batch 8, 2
    workers on 2 cores) 2 MiB buckets gave 136 images/s, one bucket after backward 159. Then
    the buckets are as large as a fusion buffer and the reduction follows backward.
    """
    if device_types - {"cpu"}:
        return OVERLAP_BUCKET_BYTES
    if local_size * max(1, threads) >= max(1, cores):
        return max(fusion_threshold, OVERLAP_BUCKET_BYTES)
    return OVERLAP_BUCKET_BYTES


@dataclass
class _Bucket:
    """Parameters sharing one flat buffer (same device and dtype), and its reduction."""

    name: str
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    padded: torch.Tensor                            # ``flat`` at its head, padded for a
    #                                                 device group's shards (else ``flat``)
    views: list[torch.Tensor]                       # each parameter's slice, in its shape
    marks: set[int] = field(default_factory=set)    # which gradients have arrived this step
    handle: Handle | GroupReduction | None = None
    ctx: Any = None                                 # a user compressor's context
    staged: Staged | GroupReduction | None = None   # this step's, lends buffers to the next


class Buckets:
    """The gradient buckets of one optimizer; see the module docstring."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: dict[torch.nn.Parameter, str],
                 bucket_bytes: int, compression: Any, op: ReduceOp,
                 predivide: float, process_set: Any = None,
                 sparse_as_dense: bool = False) -> None:
        self._params = list(params)   # registration order; the reverse is the first guess
        self._process_set = process_set
        self._comm = communicator_for(process_set)
        self._sparse_as_dense = sparse_as_dense
        self._sparse: dict[torch.nn.Parameter, Any] = {}  # sparse gradients in flight
        self._sparse_later: list[torch.nn.Parameter] = []  # device ones, sent from finish()
        self._densified: set[torch.nn.Parameter] = set()  # sparse ones reduced as dense
        self._names = names
        self._bucket_bytes = max(1, int(bucket_bytes))
        self._compression = wire_codec(compression)
        self._user = compression if _user_compressor(compression) else None
        self._op = op
        self._predivide = predivide
        self._generation = 0
        self._arrival: list[int] | None = []   # first step's order; None once settled
        self._index = {p: i for i, p in enumerate(self._params)}
        devices = [p.device for p in self._params if p.device.type != "cpu"]
        self._group = device_group_for(self._comm, devices[0] if devices else
                                       torch.device("cpu"))
        # a device group (NCCL) matches collectives by the order they are issued, not by
        # name: then buckets launch strictly in bucket order on every rank, as DDP's reducer
        # does, whatever order this rank's gradients arrive in (the engine matches names)
        self._in_order = self._group is not None
        self._next = 0  # the first bucket not launched yet, when launching in order
        # gradients staged through the device stage are read by copies on the copy stream
        # while backward ends; whatever the caller queues after backward may write them
        # (GradScaler's unscale_ before synchronize()), so at the end of backward the
        # compute stream waits for those copies (a stream wait, as DDP finalises backward)
        self._staged_on_device = any(staged_on_device(p) for p in self._params)
        self._order_queued = False
        self._build(list(reversed(range(len(self._params)))))

    # -- layout ----------------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """(Re)build the buckets over the parameters in ``order``; only between steps."""
        groups: dict[tuple[torch.device, torch.dtype], list[list[int]]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for i in order:
            p = self._params[i]
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            runs = groups.setdefault(key, [[]])
            if runs[-1] and sizes[key] + nbytes > self._bucket_bytes:
                runs.append([])
                sizes[key] = 0
            runs[-1].append(i)
            sizes[key] = sizes.get(key, 0) + nbytes
        self._buckets: list[_Bucket] = []
        self._where: dict[torch.nn.Parameter, tuple[_Bucket, int]] = {}
        # buckets ordered by when their first parameter is expected, whatever their dtype
        position = {i: k for k, i in enumerate(order)}
        runs = sorted((run for rs in groups.values() for run in rs),
                      key=lambda r: position[r[0]])
        for k, run in enumerate(runs):
            ps = [self._params[i] for i in run]
            offsets, total = [], 0
            for p in ps:
                offsets.append(total)
                total += p.numel()
            grouped = self._group is not None
            padded = torch.zeros(self._group.padded_numel(total) if grouped else total,
                                 dtype=ps[0].dtype, device=ps[0].device)
            flat = padded[:total] if grouped else padded
            views = [flat[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, ps,
                                                                          strict=True)]
            b = _Bucket(f"grad.bucket.g{self._generation}.{k}", ps, offsets, flat, padded,
                        views)
            self._buckets.append(b)
            for j, p in enumerate(ps):
                self._where[p] = (b, j)
        self._generation += 1

    @property
    def count(self) -> int:
        """How many buckets there are now."""
        return len(self._buckets)

    @property
    def on_device(self) -> bool:
        """Whether gradients go through the device stage (waits must not drive rounds on
        autograd's thread)."""
        return self._staged_on_device or self._group is not None

    @property
    def in_flight(self) -> int:
        """How many buckets have been submitted and not yet waited for."""
        return sum(b.handle is not None for b in self._buckets)

    # -- one step --------------------------------------------------------------------------
    def arrived(self, p: torch.nn.Parameter) -> None:
        """``p.grad`` is final for this step: copy it into its bucket; submit a full bucket.

        The caller makes sure this happens once per parameter and step."""
        b, j = self._where[p]
        grad = p.grad
        view = b.views[j]
        if self._staged_on_device and not self._order_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._order_queued = True
        if grad.is_sparse and not self._sparse_as_dense:
            # Horovod's way: allgather indices and values; the bucket carries zeros for it.
            # Coalescing a device tensor reads its size on the host: that waits for the
            # device, so it happens in step() (finish), not in backward
            if grad.device.type == "cpu":
                self._sparse[p] = sparse_allreduce_async(
                    grad, f"grad.sparse.{self._names[p]}", self._op, self._process_set)
            else:
                self._sparse_later.append(p)
            view.zero_()
        elif grad.is_sparse:  # sparse_as_dense: reduced dense, handed back sparse
            view.copy_(grad.to_dense())
            self._densified.add(p)
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        b.marks.add(j)
        if self._arrival is not None:
            self._arrival.append(self._index[p])
        if not self._in_order:
            if len(b.marks) == len(b.params):
                self._submit(b)
            return
        while self._next < len(self._buckets):
            head = self._buckets[self._next]
            if len(head.marks) < len(head.params):
                break
            self._submit(head)
            self._next += 1

    def _after_backward(self) -> None:
        """At the end of backward (autograd's callback): the current stream waits for the
        copies of the buckets submitted so far (see ``__init__``)."""
        self._order_queued = False
        for b in self._buckets:
            if b.handle is not None and b.staged is not None:
                b.staged.order_after_copy()

    def _submit(self, b: _Bucket) -> None:
        op, prescale, _ = predivide(self._op, self._predivide, self._comm.size)
        if b.padded is not b.flat and self._user is None and \
                op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            # SMDDP's shape: reduce-scatter among the host's GPUs, the shard across hosts
            assert self._group is not None
            if prescale != 1.0:
                b.flat.mul_(prescale)
            b.handle = b.staged = self._group.allreduce_async(
                b.flat, op, b.name, self._compression, padded=b.padded, reuse=b.staged)
            return
        if self._user is not None:  # a user's compressor: around the reduction, as Horovod
            squeezed, b.ctx = self._user.compress(b.flat)
            s = stage(squeezed, copy=squeezed.data_ptr() == b.flat.data_ptr(), reuse=b.staged)
        else:
            s = stage(b.flat, reuse=b.staged)
        # a bucket is fused already: started at once, not held back a cycle to fuse more
        b.handle = self._comm.allreduce_async(s.array, op=op, name=b.name, out=s.array,
                                              compression=self._compression, bf16=s.bf16,
                                              prescale_factor=prescale, ready=s.ready,
                                              fused=True)
        b.staged = s

    def finish(self, drive: bool | None = None) -> None:
        """Submit what backward left incomplete, wait for every bucket and point each
        ``.grad`` at its reduced slice. A parameter backward did not reach this step is
        reduced with the gradient it holds, or zeros if it has none (Horovod's rule).
        ``drive=False``: wait without running the engine's rounds on this thread (autograd's
        own, at the end of a backward that staged device tensors)."""
        for b in self._buckets:
            if b.handle is None:
                for j, p in enumerate(b.params):
                    if j in b.marks:
                        continue
                    if p.grad is None or p.grad.is_sparse:
                        b.views[j].zero_()
                    elif p.grad.data_ptr() != b.views[j].data_ptr():
                        b.views[j].copy_(p.grad)
                self._submit(b)
        self._next = 0
        self._order_queued = False  # a backward that raised never ran its callback
        for p in self._sparse_later:
            self._sparse[p] = sparse_allreduce_async(p.grad, f"grad.sparse.{self._names[p]}",
                                                     self._op, self._process_set)
        self._sparse_later.clear()
        _, _, post = predivide(self._op, self._predivide, self._comm.size)
        error: BaseException | None = None
        for b in self._buckets:
            assert b.handle is not None and b.staged is not None
            try:
                b.handle.wait(drive=drive)
            except BaseException as exc:  # wait for the rest, then raise the first failure
                error = error or exc
                continue
            finally:
                b.handle = None
                b.marks.clear()
            if self._user is not None:
                b.flat.copy_(self._user.decompress(b.staged.finish(), b.ctx))
            else:
                b.staged.finish()
            if post != 1.0:
                b.flat.mul_(post)
            for j, p in enumerate(b.params):
                if p in self._sparse:
                    continue
                if p in self._densified:
                    p.grad = b.views[j].to_sparse()
                elif p.grad is None or p.grad.is_sparse or \
                        p.grad.data_ptr() != b.views[j].data_ptr():
                    p.grad = b.views[j]
        for p, result in self._sparse.items():
            try:
                p.grad = result()
            except BaseException as exc:
                error = error or exc
        self._sparse.clear()
        self._densified.clear()
        if error is not None:
            raise error
        self._settle_order()

    def _settle_order(self) -> None:
        """After the first step, rebuild along the order backward really produced gradients,
        as rank 0 saw it (every rank must bucket alike)."""
        if self._arrival is None:
            return
        seen, self._arrival = self._arrival, None
        order = list(dict.fromkeys(seen))
        reached = set(order)
        order += [i for i in reversed(range(len(self._params))) if i not in reached]
        order = self._comm.broadcast_object(order, root_rank=0,
                                            name="shoal.torch.buckets.order")
        current = [self._index[p] for b in self._buckets for p in b.params]
        if order != current:
            grads = {p: p.grad for p in self._params}
            self._build(order)
            for p, g in grads.items():  # keep the reduced values, now in the new buffers
                if g is not None and not g.is_sparse:
                    b, j = self._where[p]
                    b.views[j].copy_(g)
                    p.grad = b.views[j]

    def describe(self) -> list[dict[str, Any]]:
        """Each bucket's name, parameter names and size in bytes (for logs and tests)."""
        return [{"name": b.name, "params": [self._names[p] for p in b.params],
                 "bytes": b.flat.numel() * b.flat.element_size()} for b in self._buckets]
