"""Point-to-point messages (send/recv) between two ranks of a communicator.

Each pair of ranks talks over its own two-rank child communicator (shared memory on one host,
its own TCP connections across hosts), made on first use, on a background thread: a send or
receive never blocks its caller, and a ring of sends issued before their receives cannot
deadlock while pairs are set up. A message is a broadcast from the sender over the pair,
named by direction, tag and message number, so messages of one direction and tag match in
the order they were posted (MPI's non-overtaking rule), and a size mismatch is a
:class:`~shoal.core.errors.CollectiveMismatchError` that names both sides.

A receive from any source learns its sender through the parent's store: every send counts
itself there (one store round trip, on a key per sender, receiver and tag, so the store does
not grow), and the receive takes the next message of the first sender whose count is ahead of
what this rank has received from it. Receives of one tag are resolved in the order posted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ShoalTimeoutError
from .store import PrefixStore

if TYPE_CHECKING:
    from .collectives import Handle
    from .communicator import Communicator

__all__ = ["P2PHandle", "PeerMessages"]


class P2PHandle:
    """A pending send or receive: completes when its collective over the pair does.

    Same interface as :class:`~shoal.core.collectives.Handle`; its result is the number of
    the rank the message came from (the peer, for a send).
    """

    def __init__(self) -> None:
        self._future: Future = Future()
        self.source: int | None = None

    def _follow(self, inner: Handle, source: int) -> None:
        self.source = source

        def done(h: Handle) -> None:
            exc = h.exception()
            if exc is not None:
                self._future.set_exception(exc)
            else:
                self._future.set_result(source)
        inner.add_done_callback(done)

    def _fail(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    def done(self) -> bool:
        """True once the message has moved (or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until done; the peer's rank, or raise the error."""
        try:
            return self._future.result(timeout)
        except TimeoutError as exc:
            raise ShoalTimeoutError(f"point-to-point message not done after {timeout}s "
                                    f"(is the peer posting the matching send/recv?)") from exc

    def exception(self) -> BaseException | None:
        """The error once done (None if it succeeded)."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[P2PHandle], None]) -> None:
        """Call ``fn(handle)`` when done (possibly on a background thread)."""
        self._future.add_done_callback(lambda _f: fn(self))


class PeerMessages:
    """The point-to-point state of one communicator (see the module's docstring)."""

    POLL_S = 0.002  # first pause between looks at the store for a receive from any source

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._lock = threading.Lock()
        self._pairs: dict[int, Future] = {}
        self._sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent
        self._taken: dict[tuple[int, int], int] = {}  # (src, tag) -> messages received
        self._last_recv: dict[int, Future] = {}  # tag -> resolution of the last receive
        self._pool = ThreadPoolExecutor(max_workers=max(2, comm.size + 2),
                                        thread_name_prefix="shoal-p2p")
        self._closed = False

    # -- pairs -----------------------------------------------------------------------------
    def _pair(self, peer: int) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"rank {self._comm.rank}: the communicator is closed")
            fut = self._pairs.get(peer)
            if fut is None:
                fut = self._pool.submit(self._make_pair, peer)
                self._pairs[peer] = fut
            return fut

    def _make_pair(self, peer: int) -> Communicator:
        comm = self._comm
        low, high = sorted((comm.rank, peer))
        store = PrefixStore(comm.store, f"p2p/{low}.{high}").clone()  # waits in parallel
        try:
            return comm.child((low, high), store, closers=[store.close])
        except BaseException:
            store.close()
            raise

    def _check(self, peer: int, what: str) -> None:
        comm = self._comm
        if not 0 <= peer < comm.size or peer == comm.rank:
            raise ValueError(f"rank {comm.rank}: cannot {what} rank {peer}: it must be another "
                             f"rank of this communicator (size {comm.size})")

    @staticmethod
    def _name(src: int, dst: int, tag: int, number: int) -> str:
        return f"p2p.{src}>{dst}.{tag}.{number}"

    def _start(self, handle: P2PHandle, peer: int, make: Callable[[Communicator], Handle],
               source: int) -> None:
        def go(fut: Future) -> None:
            try:
                handle._follow(make(fut.result()), source)
            except BaseException as exc:
                handle._fail(exc)
        self._pair(peer).add_done_callback(go)

    # -- the operations --------------------------------------------------------------------
    def send(self, data: np.ndarray, dst: int, tag: int = 0) -> P2PHandle:
        """Send the bytes of ``data`` (contiguous; kept alive until done) to rank ``dst``."""
        self._check(dst, "send to")
        comm = self._comm
        with self._lock:
            number = self._sent.get((dst, tag), 0)
            self._sent[(dst, tag)] = number + 1
        if comm.store is not None:  # what a receive from any source looks for
            comm.store.add(f"p2p/sent/{comm.rank}>{dst}/{tag}", 1)
        raw = _bytes(data)
        name = self._name(comm.rank, dst, tag, number)
        handle = P2PHandle()
        self._start(handle, dst, lambda pair: pair.broadcast_async(
            raw, pair_rank(comm.rank, dst), name=name), dst)
        return handle

    def recv(self, out: np.ndarray, src: int | None = None, tag: int = 0,
             timeout: float | None = None) -> P2PHandle:
        """Receive into ``out`` (contiguous) from rank ``src``, or from any rank if None."""
        if src is not None:
            self._check(src, "receive from")
        raw = _bytes(out)
        handle = P2PHandle()
        resolved: Future = Future()
        with self._lock:
            before = self._last_recv.get(tag)
            self._last_recv[tag] = resolved

        def resolve(_: Any = None) -> None:
            try:
                source = src if src is not None else self._any_source(tag, timeout)
                with self._lock:
                    number = self._taken.get((source, tag), 0)
                    self._taken[(source, tag)] = number + 1
            except BaseException as exc:
                resolved.set_result(None)
                handle._fail(exc)
                return
            resolved.set_result(None)
            name = self._name(source, self._comm.rank, tag, number)
            me = self._comm.rank
            self._start(handle, source, lambda pair: pair.broadcast_async(
                raw, pair_rank(source, me), name=name), source)

        if src is not None and (before is None or before.done()):
            resolve()
        elif src is not None:
            before.add_done_callback(resolve)
        else:  # a store wait: off the caller's thread, after the receives posted before it
            start = before if before is not None else _done_future()
            start.add_done_callback(lambda _f: self._pool.submit(resolve))
        return handle

    def _any_source(self, tag: int, timeout: float | None) -> int:
        comm = self._comm
        if comm.store is None:
            raise RuntimeError(f"rank {comm.rank}: a receive from any source needs a "
                               f"communicator of more than one rank")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = self.POLL_S
        peers = [r for r in range(comm.size) if r != comm.rank]
        while True:
            for peer in peers:
                sent = comm.store.add(f"p2p/sent/{peer}>{comm.rank}/{tag}", 0)
                with self._lock:
                    if sent > self._taken.get((peer, tag), 0):
                        return peer
            if self._closed:
                raise RuntimeError(f"rank {comm.rank}: the communicator closed while a "
                                   f"receive from any source was waiting")
            if deadline is not None and time.monotonic() > deadline:
                raise ShoalTimeoutError(f"rank {comm.rank}: no message with tag {tag} arrived "
                                        f"from any rank within {timeout}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def close(self) -> None:
        """Close every pair's communicator."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for fut in pairs:
            if fut.done() and fut.exception() is None:
                fut.result().close()


def pair_rank(rank: int, peer: int) -> int:
    """``rank``'s rank in the two-rank communicator it shares with ``peer``."""
    return 0 if rank < peer else 1


def _bytes(array: np.ndarray) -> np.ndarray:
    if not array.flags.c_contiguous:
        raise ValueError("point-to-point buffers must be contiguous")
    return array.reshape(-1).view(np.uint8)


def _done_future() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut
