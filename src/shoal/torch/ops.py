"""Horovod's PyTorch collectives over shoal's engine.

Naming rule, stated once (Horovod's): a trailing ``_`` works in place, ``_async`` returns a
handle at once (``synchronize(handle)`` waits and returns the tensor, ``poll(handle)`` says
whether it is done). Every collective is implemented once, in :func:`_allreduce_async` and its
siblings; the public names are thin combinations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import shoal
from shoal.core.compression import Codec, Compression
from shoal.core.ops import ReduceOp, no_process_sets, resolve_op

from .tensors import Staged, stage

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "oob_allreduce",
    "poll",
    "reducescatter",
    "synchronize",
]

Average, Sum, Min, Max, Product, Adasum = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.ADASUM)


@dataclass
class TorchHandle:
    """What the ``_async`` functions return; pass it to :func:`synchronize` / :func:`poll`."""

    handles: list[shoal.Handle]
    staged: list[Staged]
    post: float = 1.0
    grouped: bool = False

    def done(self) -> bool:
        """True once every part has completed."""
        return all(h.done() for h in self.handles)

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        """Wait, write results back, apply the post-scale; return the tensor(s)."""
        for h in self.handles:
            h.wait()
        out = []
        for s in self.staged:
            t = s.finish()
            if self.post != 1.0:
                t.mul_(self.post)
            out.append(t)
        return out if self.grouped else out[0]


def _allreduce_async(tensors: Sequence[torch.Tensor], *, inplace: bool, name: str | None,
                     op: ReduceOp, compression: Codec, prescale_factor: float,
                     postscale_factor: float, grouped: bool) -> TorchHandle:
    staged, handles = [], []
    for i, t in enumerate(tensors):
        s = stage(t, copy=not inplace)
        if prescale_factor != 1.0:
            s.host.mul_(prescale_factor)
        part = None if name is None else (f"{name}.{i}" if grouped else name)
        handles.append(shoal.allreduce_async(s.array, op=op, name=part, out=s.array,
                                             compression=compression, bf16=s.bf16))
        staged.append(s)
    return TorchHandle(handles, staged, postscale_factor, grouped)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, compression: Codec = Compression.none,
                    process_set: Any = None) -> TorchHandle:
    """Start reducing a copy of ``tensor`` across ranks (Average by default)."""
    no_process_sets(process_set)
    return _allreduce_async([tensor], inplace=False, name=name, op=resolve_op(average, op),
                            compression=compression, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, grouped=False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, compression: Codec = Compression.none,
                     process_set: Any = None) -> TorchHandle:
    """Start reducing ``tensor`` in place."""
    no_process_sets(process_set)
    return _allreduce_async([tensor], inplace=True, name=name, op=resolve_op(average, op),
                            compression=compression, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, grouped=False)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Codec = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """A reduced copy of ``tensor``."""
    return allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                           compression, process_set).wait()


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, compression: Codec = Compression.none,
               process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            compression, process_set).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            compression: Codec = Compression.none,
                            process_set: Any = None) -> TorchHandle:
    """Start reducing copies of several tensors together (they are fused)."""
    no_process_sets(process_set)
    return _allreduce_async(tensors, inplace=False, name=name, op=resolve_op(average, op),
                            compression=compression, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, grouped=True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             compression: Codec = Compression.none,
                             process_set: Any = None) -> TorchHandle:
    """Start reducing several tensors in place, together."""
    no_process_sets(process_set)
    return _allreduce_async(tensors, inplace=True, name=name, op=resolve_op(average, op),
                            compression=compression, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, grouped=True)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Codec = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Reduced copies of several tensors."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                   postscale_factor, compression, process_set).wait()


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       compression: Codec = Compression.none,
                       process_set: Any = None) -> list[torch.Tensor]:
    """Reduce several tensors in place."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, compression, process_set).wait()


def oob_allreduce(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """SMDDP's out-of-band allreduce for statistics (loss, accuracy): the average, as a copy."""
    return allreduce(tensor, op=ReduceOp.AVERAGE, name=name)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> TorchHandle:
    """Concatenation of every rank's tensor along dim 0 (handle; sizes may differ)."""
    no_process_sets(process_set)
    s = stage(tensor)
    data = shoal.allgather(s.array, name=name)
    out = torch.from_numpy(data).view(torch.bfloat16) if s.bf16 else torch.from_numpy(data)
    out = out.to(tensor.device)
    return _Done(out)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0 (sizes may differ)."""
    return allgather_async(tensor, name, process_set).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> TorchHandle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place."""
    no_process_sets(process_set)
    s = stage(tensor)
    return TorchHandle([shoal.broadcast_async(s.array, root_rank, name)], [s])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> TorchHandle:
    """Start broadcasting into a copy of ``tensor``."""
    no_process_sets(process_set)
    s = stage(tensor, copy=True)
    return TorchHandle([shoal.broadcast_async(s.array, root_rank, name)], [s])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """A copy of ``root_rank``'s ``tensor``."""
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None,
             name: str | None = None,
             process_set: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter row blocks of ``tensor`` to every rank, gather theirs: (data, received splits)."""
    no_process_sets(process_set)
    s = stage(tensor)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    data, recv = shoal.alltoall(s.array, splits, name=name)
    out = torch.from_numpy(data).view(torch.bfloat16) if s.bf16 else torch.from_numpy(data)
    return out.to(tensor.device), torch.from_numpy(recv)


def reducescatter(tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE,
                  name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Reduce across ranks and keep this rank's block of dim 0."""
    no_process_sets(process_set)
    s = stage(tensor, copy=True)
    shoal.allreduce(s.array, op=op, name=name, out=s.array, bf16=s.bf16)
    base, extra = divmod(tensor.shape[0], shoal.size())
    r = shoal.rank()
    start = r * base + min(r, extra)
    return s.finish()[start:start + base + (r < extra)].clone()


class _Done(TorchHandle):
    """A handle for a result computed eagerly."""

    def __init__(self, result: torch.Tensor) -> None:
        super().__init__([], [])
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


def synchronize(handle: TorchHandle) -> torch.Tensor | list[torch.Tensor]:
    """Wait for an ``_async`` handle; return its tensor(s)."""
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """Whether an ``_async`` handle has completed."""
    return handle.done()


def barrier(process_set: Any = None) -> None:
    """Wait until every rank arrives."""
    no_process_sets(process_set)
    shoal.barrier()


def join(device: int = -1) -> int:
    """Wait until every rank has joined; return the last rank to join.

    Unlike Horovod's, collectives submitted by ranks that have not joined yet are not
    completed with zeros from the joined ones: finish (or skip) the step on every rank first.
    """
    import time
    stamp = torch.tensor([time.time(), float(shoal.rank())], dtype=torch.float64)
    everyone = allgather(stamp.view(1, 2), name="shoal.join")
    return int(everyone[int(torch.argmax(everyone[:, 0])), 1])

