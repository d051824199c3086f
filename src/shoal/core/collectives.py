"""The collectives of a communicator, on numpy arrays (mixed into
:class:`~shoal.core.communicator.Communicator`; the module-level API calls them on the default
one).

Requests are fused and ordered by the communicator's engine: ranks may submit them in any order,
but every rank must submit the same names with the same shapes, dtypes and ops. Argument errors
are raised before anything is submitted, so they leave the communicator usable.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from .adasum import adasum_tree
from .compression import Codec, Compression
from .engine import Engine, Kind, Request
from .reduction import ReduceOp, check_array, check_rows, narrow, reduce_into, scale, widen

__all__ = ["Collectives", "Handle"]


class Handle:
    """The pending result of an asynchronous collective."""

    def __init__(self, engine: Engine, future: Future,
                 then: Callable[[Any], Any] | None = None) -> None:
        self._engine = engine
        self._future = future
        self._then = then
        self._value: Any = None
        self._got = False

    def done(self) -> bool:
        """True once the result (or error) is ready."""
        return self._future.done()

    def wait(self, timeout: float | None = None, *, drive: bool | None = None) -> Any:
        """Block until done; return the result or raise the collective's error.
        ``drive=False``: never run engine rounds on this thread (see ``Engine.wait``)."""
        value = self._engine.wait(self._future, timeout, drive)
        if self._then is None:
            return value
        if not self._got:  # the finishing step (post-scaling, slicing) runs once
            self._value, self._got = self._then(value), True
        return self._value

    def exception(self) -> BaseException | None:
        """The collective's error once it is done (None if it succeeded)."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` when the collective completes. It may run on the engine's
        thread: keep it short, and never wait on another collective inside it."""
        self._future.add_done_callback(lambda _f: fn(self))


# (shape, dtype, op, codec, bf16) of an allreduce that passed check_array -> (logical dtype,
# description); what check_array looks at besides is the type and contiguity, checked anew
_CHECKED: dict[tuple, tuple[str, str]] = {}


def _storage(array: np.ndarray, dtype: str) -> np.ndarray:
    flat = array if array.ndim == 1 else array.reshape(-1)
    return flat.view(np.uint16) if dtype == "bfloat16" else flat


def _output(array: np.ndarray, out: np.ndarray | None, name: str, rank: int) -> np.ndarray:
    """An allreduce's output: ``out`` once checked to match ``array``, else a new array."""
    if out is None:
        return np.empty_like(array)
    if out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous:
        raise ValueError(f"rank {rank}: output for {name!r} must be a C-contiguous "
                         f"{array.dtype} array of shape {array.shape}")
    return out


def _shape(array: np.ndarray) -> str:
    return "(" + ", ".join(map(str, array.shape)) + ")"


def _postscale(dst: np.ndarray, factor: float,
               dtype: str) -> Callable[[Any], Any] | None:
    """The finishing step that scales a result in place (None when there is nothing to do)."""
    if factor == 1.0:
        return None

    def then(result: Any) -> Any:
        scale(dst, factor, dtype)
        return result
    return then


def _when_ready(ready: Callable[[], None] | None,
                work: Callable[[], None]) -> Callable[[], None] | None:
    """Run ``work``, which reads a request's input, once the input may be read: at once
    when nothing is pending on it, else after ``ready`` on the thread that moves the data
    (a device stage's copy to host is still in flight at submission)."""
    if ready is None:
        work()
        return None

    def both() -> None:
        ready()
        work()
    return both


class Collectives:
    """Collective operations over ``self.engine`` (provided by the communicator)."""

    engine: Engine
    _counter: int = 0
    _epoch: int = 0

    def _auto_name(self, kind: str, name: str | None) -> str:
        """The name an unnamed collective would get, for the messages of argument checks;
        nothing is consumed (:meth:`_take_name` does that once the arguments passed)."""
        if name:
            return name
        epoch = self.engine.epoch
        count = (self._counter if epoch == self._epoch else 0) + 1
        return f"{kind}.noname.{epoch}.{count}" if epoch else f"{kind}.noname.{count}"

    def _take_name(self, kind: str, name: str | None) -> str:
        """Unnamed collectives are numbered in call order (the same on every rank that makes
        the same calls), counted only once their arguments passed, so a bad argument raises
        on its rank and leaves the numbering as it was; after ranks were found diverged the
        numbering restarts everywhere, so a caught error does not leave later unnamed calls
        unmatched."""
        if name:
            return name
        epoch = self.engine.epoch
        if epoch != self._epoch:
            self._epoch, self._counter = epoch, 0
        self._counter += 1
        return f"{kind}.noname.{epoch}.{self._counter}" if epoch else \
            f"{kind}.noname.{self._counter}"

    #: every collective starts at once, none waiting the engine's fusion cycle: for a
    #: communicator whose callers have each call be a collective of its own (a torch process
    #: group). Horovod's API keeps the cycle, within which a second request of a name still
    #: pending is refused, as Horovod's own background thread does.
    start_at_once = False

    def _chain(self, req: Request, result: Any, wake: bool,
               then: Callable[[Any], Any] | None = None) -> Handle:
        """Submit ``req``; the handle resolves to ``result`` (the caller's own array, not the
        flat storage view the engine works on), passed through ``then`` if given."""
        req.result = result
        if self.start_at_once:
            req.fused = True
        finish = None if wake or not self.engine.small_bytes else self._one_round(req)
        rows = req.extra if req.kind is Kind.ALLGATHER else None  # the same, or no one round
        if finish is not None and self.engine.small_request(req, finish, rows):
            return Handle(self.engine, req.future, then)
        return Handle(self.engine, self.engine.submit(req, wake=wake), then)

    def _one_round(self, req: Request) -> Callable[[list[np.ndarray]], None] | None:
        """How a synchronous broadcast, reduce-scatter or allgather makes its result from
        every rank's payload in a one-round attempt (:meth:`Engine.small_request`), or None
        for the kinds that do not take it."""
        me = self.engine.rank
        if req.kind is Kind.ALLGATHER and req.out is None:  # (into out=: the general way)
            rows, n = req.extra, self.engine.size

            def gather(parts: list[np.ndarray]) -> None:
                out = np.empty((n * rows, *req.trailing), req.array.dtype)
                flat = out.reshape(-1)
                step = parts[0].size
                for r, part in enumerate(parts):
                    flat[r * step:(r + 1) * step] = part
                req.out = out
            return gather
        if req.kind is Kind.BROADCAST:
            if me == req.root:
                return lambda parts: None
            out, root = req.out, req.root
            return lambda parts: np.copyto(out, parts[root])
        if req.kind is Kind.REDUCESCATTER:
            lo, hi = req.extra[me], req.extra[me + 1]
            out, op, dtype, n = req.out, req.op, req.dtype, self.engine.size

            def block(parts: list[np.ndarray]) -> None:
                reduce_into(out, [p[lo:hi] for p in parts[1:]], op, dtype, first=parts[0][lo:hi],
                            divide_by=n if op == ReduceOp.AVERAGE else 0)
            return block
        return None

    def allreduce_async(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                        name: str | None = None, out: np.ndarray | None = None,
                        compression: Codec = Compression.none, *, bf16: bool = False,
                        fused: bool = False, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, ready: Callable[[], None] | None = None,
                        _wake: bool = True) -> Handle:
        """Start combining ``array`` across ranks; returns a :class:`Handle` at once.

        ``prescale_factor`` multiplies the input before the reduction (in ``out``, so
        ``array`` is left alone unless it is ``out``), ``postscale_factor`` the result
        (integers in float64, half precision in float32, as Horovod scales).
        ``bf16=True`` marks a 16-bit integer array as holding bfloat16 words (how adapters hand
        over bfloat16 tensors when ``ml_dtypes`` is not installed). ``fused=True`` says the
        caller has fused its tensors already (a gradient bucket): the engine starts it at once
        instead of waiting ``cycle_time_ms`` for more requests to fuse it with.

        ``ready`` (every ``_async`` collective takes it) is called, once, on the thread about
        to read ``array``, before it does: a device stage passes a wait for its device-to-host
        copy, so the caller's thread never waits for the device.
        """
        op = ReduceOp(op)
        if op == ReduceOp.ADASUM:
            return self._adasum_async(array, name, out, compression, bf16, prescale_factor,
                                      postscale_factor, ready, _wake)
        name, dtype, desc, out, src, dst = self._allreduce_args(array, op, name, out,
                                                                compression, bf16)
        if prescale_factor != 1.0:
            source = src

            def prescale() -> None:
                if dst is not source and dst.ctypes.data != source.ctypes.data:
                    np.copyto(dst, source)
                scale(dst, prescale_factor, dtype)
            ready = _when_ready(ready, prescale)
            src = dst
        req = Request(Kind.ALLREDUCE, name, src, dst, dtype, desc, op=op, codec=compression,
                      fused=fused, ready=ready)
        return self._chain(req, out, _wake, _postscale(dst, postscale_factor, dtype))

    def _adasum_async(self, array: np.ndarray, name: str | None, out: np.ndarray | None,
                      compression: Codec, bf16: bool, prescale_factor: float,
                      postscale_factor: float, ready: Callable[[], None] | None,
                      wake: bool) -> Handle:
        """``allreduce(op=Adasum)`` (:mod:`shoal.core.adasum`): every rank's tensor gathered,
        then the same pairwise tree computed on every rank."""
        rank = self.engine.rank
        given, name = name, self._auto_name("allreduce", name)
        what = f"allreduce tensor {name!r}"
        dtype = check_array(array, what, rank, None, bf16)
        if dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise TypeError(f"rank {rank}: {what} has dtype {dtype}; op Adasum combines "
                            f"gradients by their dot products and needs a floating-point "
                            f"tensor")
        if compression is not Compression.none:
            raise ValueError(f"rank {rank}: {what}: op Adasum takes no compression (its dot "
                             f"products need the gradients as they are); drop compression=")
        out = _output(array, out, name, rank)
        src = _storage(array, dtype)
        if prescale_factor != 1.0:  # into a copy, once the input is ready
            source, src = src, np.empty_like(src)

            def prescale() -> None:
                np.copyto(src, source)
                scale(src, prescale_factor, dtype)
            ready = _when_ready(ready, prescale)
        rows = src.reshape(1, -1)
        req = Request(Kind.ALLGATHER, self._take_name("allreduce", given), rows, None, dtype,
                      f"allreduce shape={_shape(array)} dtype={dtype} op=Adasum",
                      extra=1, trailing=(rows.shape[1],), ready=ready)
        dst = _storage(out, dtype)

        def combine(gathered: np.ndarray) -> np.ndarray:
            result = adasum_tree(widen(gathered, dtype) if dtype == "bfloat16" else gathered)
            narrow(result.astype(np.float32) if dtype == "bfloat16" else result, dst, dtype)
            scale(dst, postscale_factor, dtype)
            return out
        return self._chain(req, None, wake, combine)

    def _allreduce_args(self, array: np.ndarray, op: ReduceOp, name: str | None,
                        out: np.ndarray | None, compression: Codec, bf16: bool
                        ) -> tuple[str, str, str, np.ndarray, np.ndarray, np.ndarray]:
        """Checked arguments of an allreduce: name, logical dtype, description, output, and
        the flat storage views of input and output."""
        rank = self.engine.rank
        given, name = name, self._auto_name("allreduce", name)
        checked = None
        if type(array) is np.ndarray and array.flags.c_contiguous:
            key = (array.shape, array.dtype, op, compression.name, bf16)
            checked = _CHECKED.get(key)
        if checked is None:  # checking and formatting cost more than a small reduction
            dtype = check_array(array, f"allreduce tensor {name!r}", rank, op, bf16)
            if len(_CHECKED) > 4096:
                _CHECKED.clear()
            checked = _CHECKED[key] = dtype, (
                f"allreduce shape={_shape(array)} dtype={dtype} op={op.name.capitalize()} "
                f"compression={compression.name}")
        dtype, desc = checked
        out = _output(array, out, name, rank)
        src, dst = _storage(array, dtype), _storage(out, dtype)
        return self._take_name("allreduce", given), dtype, desc, out, src, dst

    def allreduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                  name: str | None = None, out: np.ndarray | None = None,
                  compression: Codec = Compression.none, *, bf16: bool = False) -> np.ndarray:
        """Combine ``array`` across all ranks (average by default); returns a new array unless
        ``out`` is given (``out=array`` reduces in place).

        Up to ``SHOAL_ONE_ROUND_BYTES`` on one host, a name seen before completes in
        one synchronisation round (:mod:`shoal.core.engine.small`)."""
        op = op if type(op) is ReduceOp else ReduceOp(op)
        if compression is Compression.none and self.engine.small_bytes and \
                op != ReduceOp.ADASUM:
            args = self._allreduce_args(array, op, name, out, compression, bf16)
            name, dtype, desc, out, src, dst = args
            if self.engine.allreduce_small(name, desc, src, dst, op, dtype):
                return out
        return self.allreduce_async(array, op, name, out, compression, bf16=bf16,
                                    _wake=False).wait()

    def _rows_request(self, kind: Kind, array: np.ndarray, name: str | None,
                      extra_of: Callable[[str], Any],
                      ready: Callable[[], None] | None = None) -> Request:
        engine = self.engine
        given, name = name, self._auto_name(kind.value, name)
        dtype = check_array(array, f"{kind.value} tensor {name!r}", engine.rank)
        check_rows(array.ndim, kind.value, name, engine.rank)
        trailing = tuple(array.shape[1:])
        desc = f"{kind.value} shape=(*, {', '.join(map(str, trailing))}) dtype={dtype}"
        extra, flat = extra_of(name), _storage(array, dtype)
        return Request(kind, self._take_name(kind.value, given), flat, None, dtype, desc,
                       extra=extra, trailing=trailing, ready=ready)

    def allgather_async(self, array: np.ndarray, name: str | None = None, *,
                        out: np.ndarray | None = None,
                        ready: Callable[[], None] | None = None,
                        _wake: bool = True) -> Handle:
        """Start concatenating every rank's array along dimension 0 (lengths may differ).
        ``out`` (C-contiguous, the array's dtype and trailing shape, as many rows as all
        ranks together) receives the result in place of a new array; this rank's rows may
        already lie in it, where they belong."""
        def rows(name: str) -> int:
            if out is not None and (out.dtype != array.dtype or out.shape[1:] != array.shape[1:]
                                    or not out.flags.c_contiguous):
                raise ValueError(f"rank {self.engine.rank}: allgather output for "
                                 f"{name!r} must be a C-contiguous {array.dtype} array of "
                                 f"shape (*, {', '.join(map(str, array.shape[1:]))})")
            return int(array.shape[0])
        req = self._rows_request(Kind.ALLGATHER, array, name, rows, ready)
        if out is not None:
            req.out = _storage(out, req.dtype).reshape(out.shape)
        return self._chain(req, out, _wake, None if out is not None else
                           lambda flat: flat.view(array.dtype)
                           if array.dtype != flat.dtype else flat)

    def allgather(self, array: np.ndarray, name: str | None = None, *,
                  out: np.ndarray | None = None) -> np.ndarray:
        """Concatenate every rank's array along dimension 0 (lengths may differ per rank)."""
        return self.allgather_async(array, name, out=out, _wake=False).wait()

    def alltoall(self, array: np.ndarray, splits: Any = None,
                 name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Send ``splits[i]`` rows of ``array`` to rank ``i`` and gather what every rank sent
        here; returns ``(data, received splits)``. Without ``splits`` the rows divide evenly."""
        return self.alltoall_async(array, splits, name, _wake=False).wait()

    def alltoall_async(self, array: np.ndarray, splits: Any = None, name: str | None = None,
                       *, ready: Callable[[], None] | None = None,
                       _wake: bool = True) -> Handle:
        """Start :meth:`alltoall`; the handle resolves to ``(data, received splits)``."""
        engine = self.engine

        def check(name: str) -> list[int]:
            rows, n = array.shape[0], engine.size
            if splits is None:
                if rows % n:
                    raise ValueError(f"rank {engine.rank}: alltoall tensor {name!r} has {rows} "
                                     f"rows, not divisible by {n} ranks; pass splits=")
                return [rows // n] * n
            got = [int(s) for s in splits]
            if len(got) != n or min(got) < 0 or sum(got) != rows:
                raise ValueError(f"rank {engine.rank}: alltoall splits {got} for {name!r} must "
                                 f"be {n} non-negative counts summing to {rows}")
            return got
        req = self._rows_request(Kind.ALLTOALL, array, name, check, ready)

        def then(result: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            data, recv = result
            return (data.view(array.dtype) if array.dtype != data.dtype else data), recv
        return self._chain(req, None, _wake, then)

    def broadcast_async(self, array: np.ndarray, root_rank: int, name: str | None = None, *,
                        ready: Callable[[], None] | None = None,
                        _wake: bool = True) -> Handle:
        """Start overwriting ``array`` with ``root_rank``'s values; returns a :class:`Handle`."""
        engine = self.engine
        given, name = name, self._auto_name("broadcast", name)
        dtype = check_array(array, f"broadcast tensor {name!r}", engine.rank)
        if not 0 <= root_rank < engine.size:
            raise ValueError(f"rank {engine.rank}: root_rank {root_rank} is not a rank of this "
                             f"communicator (size {engine.size})")
        flat = _storage(array, dtype)
        name = self._take_name("broadcast", given)
        desc = f"broadcast shape={_shape(array)} dtype={dtype} root={root_rank}"
        req = Request(Kind.BROADCAST, name, flat, flat, dtype, desc, root=root_rank,
                      ready=ready)
        return self._chain(req, array, _wake)

    def broadcast(self, array: np.ndarray, root_rank: int,
                  name: str | None = None) -> np.ndarray:
        """Overwrite ``array`` with ``root_rank``'s values on every rank, in place; returns
        it."""
        return self.broadcast_async(array, root_rank, name, _wake=False).wait()

    def reducescatter_async(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                            name: str | None = None, *, bf16: bool = False,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            splits: Any = None, out: np.ndarray | None = None,
                            ready: Callable[[], None] | None = None,
                            _wake: bool = True) -> Handle:
        """Start :meth:`reducescatter`; the handle resolves to this rank's block.
        ``splits`` (rows per rank, the same on every rank) sets the blocks instead of
        Horovod's even division; ``out`` (C-contiguous, this rank's block's shape) receives
        the block in place of a new array."""
        engine = self.engine
        op = ReduceOp(op)
        given, name = name, self._auto_name("reducescatter", name)
        check_rows(getattr(array, "ndim", None), "reducescatter", name, engine.rank)
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                      ReduceOp.PRODUCT):
            raise NotImplementedError(f"rank {engine.rank}: reducescatter does not support op "
                                      f"{op.name}; use Sum, Average, Min, Max or Product")
        dtype = check_array(array, f"reducescatter tensor {name!r}", engine.rank, op, bf16)
        rows, n = array.shape[0], engine.size
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        if splits is None:
            base, extra = divmod(rows, n)
            starts = [r * base + min(r, extra) for r in range(n + 1)]
        else:
            counts = [int(c) for c in splits]
            if len(counts) != n or min(counts) < 0 or sum(counts) != rows:
                raise ValueError(f"rank {engine.rank}: reducescatter splits {counts} for "
                                 f"{name!r} must be {n} non-negative counts summing to {rows}")
            starts = np.cumsum([0, *counts]).tolist()
        bounds = [s * row for s in starts]
        me = engine.rank
        shape = (starts[me + 1] - starts[me], *array.shape[1:])
        if out is None:
            out = np.empty(shape, array.dtype)
        elif out.shape != shape or out.dtype != array.dtype or not out.flags.c_contiguous:
            raise ValueError(f"rank {engine.rank}: reducescatter output for {name!r} must "
                             f"be a C-contiguous {array.dtype} array of shape {shape}")
        src = _storage(array, dtype)
        if prescale_factor != 1.0:
            source, src = src, np.empty_like(src)
            scaled = src

            def prescale() -> None:
                np.copyto(scaled, source)
                scale(scaled, prescale_factor, dtype)
            ready = _when_ready(ready, prescale)
        dst = _storage(out, dtype)
        name = self._take_name("reducescatter", given)
        desc = (f"reducescatter shape={_shape(array)} dtype={dtype} "
                f"op={op.name.capitalize()}" + (f" splits={starts}" if splits is not None
                                                 else ""))
        req = Request(Kind.REDUCESCATTER, name, src, dst, dtype, desc, op=op, extra=bounds,
                      ready=ready)
        return self._chain(req, out, _wake, _postscale(dst, postscale_factor, dtype))

    def reducescatter(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                      name: str | None = None, **kwargs: Any) -> np.ndarray:
        """Reduce, then keep this rank's block of the first dimension (earlier ranks get the
        extra rows when it does not divide evenly, as in Horovod)."""
        return self.reducescatter_async(array, op, name, _wake=False, **kwargs).wait()

    def join(self) -> int:
        """Say this rank has no more work (uneven data): until every rank has joined, it takes
        part in the allreduces the others still run with neutral contributions (zeros for
        sums and averages, which still divide by the full size). Returns the last rank to
        join, the same on every rank. Other collectives fail while some rank has joined."""
        return self.engine.wait(self.engine.join())

    def barrier(self) -> None:
        """Wait until every rank reaches the barrier."""
        self.allreduce(np.zeros(1, np.int32), ReduceOp.SUM, name="shoal.barrier")

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
        """Send a picklable object from ``root_rank`` to every rank (peers are
        authenticated)."""
        me = self.engine.rank
        if not 0 <= root_rank < self.engine.size:
            raise ValueError(f"rank {me}: root_rank {root_rank} is not a rank of this "
                             f"communicator (size {self.engine.size})")
        payload = np.frombuffer(pickle.dumps(obj), np.uint8) if me == root_rank \
            else np.empty(0, np.uint8)
        name = self._take_name("broadcast_object", name)
        length = self.broadcast(np.array([payload.size], np.int64), root_rank,
                                name=f"{name}.len")
        if me != root_rank:
            payload = np.empty(int(length[0]), np.uint8)
        self.broadcast(payload, root_rank, name=f"{name}.data")
        return obj if me == root_rank else pickle.loads(payload.tobytes())

    def allgather_object(self, obj: Any, name: str | None = None) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        name = self._take_name("allgather_object", name)
        lengths = self.allgather(np.array([payload.size], np.int64), name=f"{name}.len")
        data = self.allgather(payload, name=f"{name}.data")
        offsets = np.cumsum([0, *lengths.tolist()])
        return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes())
                for r in range(self.engine.size)]
