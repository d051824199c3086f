"""Elastic training, written once for every framework: state, the reset loop, and the worker's
side of ``shoalrun``'s elastic mode.

Horovod's model (``horovod.common.elastic``), with its names and meanings:

* a :class:`State` holds what training needs to continue; ``commit()`` saves a copy (and
  checks whether hosts were added or removed: it drains the state's queue of notices,
  ``_host_messages``, which a daemon thread fills from the driver's store,
  :mod:`.host_updates`), ``restore()`` goes back to the last commit, ``sync()`` sends rank 0's
  state to every rank, and ``reset()`` (for subclasses) runs after every reset, before it;
* :func:`run_fn` wraps the training function: when a peer is lost mid-step
  (:class:`~shoal.PeerLostError`, a :class:`ShoalError` from inside a collective) the state is
  restored to the last commit; when hosts changed (:class:`HostsUpdatedInterrupt`, raised by
  ``commit()`` / ``check_host_updates()`` on every rank at the same step) it is kept; either
  way shoal is shut down, the worker joins the next world, the reset callbacks run, and the
  function is called again after ``sync()``.

The elastic driver (``shoalrun --min-np ... --host-discovery-script ...``,
:mod:`shoal.runner.elastic`) publishes each world in its rendezvous store under
:data:`WORLD_KEY`: a version and the members (worker ids) in rank order. A worker knows its id
from ``SHOAL_ELASTIC_ID``; :func:`join_world` waits for a world newer than the last one it was
part of, and initialises shoal as its member (shared memory and store keys are per world).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import api
from .auth import secret_bytes
from .errors import CollectiveMismatchError, RendezvousError, ShoalError, ShoalTimeoutError
from .host_updates import HostUpdateResult, Notifier, update_result
from .runtime import RUNTIME
from .store import Store

__all__ = ["ELASTIC_ID_VAR", "FORMED_KEY", "WORLD_KEY", "HostUpdateResult", "HostsUpdatedInterrupt",
           "ObjectState", "State", "WorldPlan", "elastic_job", "join_world", "reset", "run_fn",
           "world_broken", "world_version"]

#: The worker's id in an elastic job (``host:slot``); set by the elastic driver.
ELASTIC_ID_VAR = "SHOAL_ELASTIC_ID"
#: The store key under which the driver publishes the current world (JSON).
WORLD_KEY = "elastic/world"
#: the version of the last world that formed (its rank 0 joined), for the driver: a world
#: that has not formed when the job finishes never will
FORMED_KEY = "elastic/formed"
_F = TypeVar("_F", bound=Callable[..., Any])
_log = logging.getLogger("shoal.elastic")
_store_lock = threading.RLock()  # one store client serves the training thread and the notifier
_joined: tuple[str, ...] = ()  # the members of the world this worker last joined


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Hosts were added to or removed from the job: every rank raises it at the same commit,
    the state is kept (it is the commit), and the job resets into the new world.
    ``skip_sync``: no new worker needs the state (only removals)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


@dataclass(frozen=True)
class WorldPlan:
    """One world of an elastic job, as the driver publishes it."""

    version: int
    members: tuple[str, ...]  # worker ids, in rank order
    hosts: tuple[str, ...]  # each member's host
    added: bool = False  # some member is new in this world (it needs the state)

    def to_json(self) -> bytes:
        """The published form."""
        return json.dumps({"version": self.version, "members": list(self.members),
                           "hosts": list(self.hosts), "added": self.added}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WorldPlan:
        """Parse the published form."""
        d = json.loads(data)
        return cls(int(d["version"]), tuple(d["members"]), tuple(d["hosts"]),
                   bool(d.get("added")))


def _store() -> Any:
    """This worker's client of the driver's store: one connection for the process (a commit
    every step must not open a connection each time); a new one after a failure."""
    from .rendezvous import StoreClient

    with _store_lock:
        client = RUNTIME.elastic_store
        if client is None:
            key = secret_bytes(os.environ["SHOAL_SECRET"])
            client = RUNTIME.elastic_store = StoreClient(
                os.environ["SHOAL_RENDEZVOUS_ADDR"], int(os.environ["SHOAL_RENDEZVOUS_PORT"]),
                key, timeout=10.0, connect_timeout=10.0)
        return client


def _drop_store() -> None:
    with _store_lock:
        client, RUNTIME.elastic_store = RUNTIME.elastic_store, None
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def _read_plan(store: Any) -> WorldPlan | None:
    try:
        with _store_lock:  # none yet (a worker may start before the first world): None
            data = store.try_get(WORLD_KEY)
    except (ShoalTimeoutError, TimeoutError, KeyError):
        return None
    except Exception:  # the connection broke: the next call connects again
        _drop_store()
        raise
    return WorldPlan.from_json(data) if data else None


def elastic_job() -> bool:
    """Whether this process is a worker of shoalrun's elastic mode."""
    return bool(os.environ.get(ELASTIC_ID_VAR))


def world_version() -> int:
    """The version of the world this worker last joined (-1: none)."""
    return RUNTIME.elastic_version


def join_world(timeout: float | None = None) -> WorldPlan:
    """Wait for a published world newer than the last one joined that names this worker,
    and initialise shoal as its member; the plan.

    Raises:
        ShoalTimeoutError: no such world within ``timeout`` (default: the elastic timeout,
            ``SHOAL_ELASTIC_TIMEOUT_S``, 600 s); the driver has dropped this worker.
    """
    me = os.environ.get(ELASTIC_ID_VAR)
    if not me:
        raise ShoalError(f"not an elastic worker: {ELASTIC_ID_VAR} is not set (start the job "
                         f"with shoalrun --min-np/--max-np or --host-discovery-script)")
    wait = timeout if timeout is not None else float(
        os.environ.get("SHOAL_ELASTIC_TIMEOUT_S", "600"))
    deadline = time.monotonic() + wait
    newest = RUNTIME.elastic_version
    while True:
        plan = _read_plan(_store())
        if plan is not None and plan.version > newest and me in plan.members:
            rank = plan.members.index(me)
            host = plan.hosts[rank]
            local = [i for i, h in enumerate(plan.hosts) if h == host]
            base = os.environ.get("SHOAL_JOB_ID", "elastic")
            # a world may be replaced while its members meet (a worker still starting when
            # the hosts changed again): the meeting gives up then, and this joins the newer
            RUNTIME.store_guard = functools.partial(_WorldGuard, version=plan.version)
            try:
                api.init(rank=rank, size=len(plan.members), local_rank=local.index(rank),
                         local_size=len(local), hostname=host,
                         job_id=f"{base}-w{plan.version}",
                         store_prefix=f"elastic/w{plan.version}", serve_store=False)
                break
            except WorldSupersededError as exc:
                _log.info("elastic worker %s: %s", me, exc)
                newest = plan.version
            finally:
                RUNTIME.store_guard = None
        if time.monotonic() > deadline:
            raise ShoalTimeoutError(f"elastic worker {me}: no world named it within "
                                    f"{wait:g}s (the driver dropped it?)")
        time.sleep(0.05)
    if rank == 0:  # every member has joined: init returns only then
        with contextlib.suppress(Exception), _store_lock:
            _store().set(FORMED_KEY, str(plan.version).encode())
    global _joined
    if not _joined:
        _export_horovod_env(plan, rank, local.index(rank), len(local))
    RUNTIME.elastic_version, _joined = plan.version, plan.members
    return plan


class WorldSupersededError(ShoalError):
    """The driver published a newer world while this worker met the others of an older
    one."""


class _WorldGuard(Store):
    """The store a world's members meet at, which gives up a wait (WorldSupersededError)
    once the driver has published a newer world: some members will never come."""

    SLICE_S = 0.25

    def __init__(self, inner: Store, version: int) -> None:
        self.inner, self.version = inner, version

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def try_get(self, key: str) -> bytes | None:
        return self.inner.try_get(key)

    def add(self, key: str, delta: int) -> int:
        return self.inner.add(key, delta)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        from .rendezvous import StoreClosedError
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.SLICE_S if deadline is None else min(self.SLICE_S,
                                                             deadline - time.monotonic())
            try:
                return self.inner.get(key, max(left, 0.01))
            except RendezvousError as exc:
                if isinstance(exc, StoreClosedError):
                    raise
                plan = _read_plan(_store())
                if plan is not None and plan.version > self.version:
                    raise WorldSupersededError(
                        f"world {self.version} was replaced by world {plan.version} before "
                        f"its members met (waiting for {key!r})") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise


def _export_horovod_env(plan: WorldPlan, rank: int, local_rank: int, local_size: int) -> None:
    """The ``HOROVOD_*`` variables horovodrun gives a worker, as of the first world it joins
    (Horovod sets them when it starts a worker and never changes them; scripts read
    ``HOROVOD_RANK`` as the rank a worker started with)."""
    hosts = list(dict.fromkeys(plan.hosts))
    host = plan.hosts[rank]
    os.environ.update({
        "HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(len(plan.members)), "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size), "HOROVOD_CROSS_RANK": str(hosts.index(host)),
        "HOROVOD_CROSS_SIZE": str(len(hosts))})


def reset() -> WorldPlan:
    """Leave the current world (shut shoal down) and join the next one."""
    api.shutdown()
    return join_world()


def latest_plan() -> WorldPlan | None:
    """The newest world the driver has published (None outside an elastic job)."""
    if not os.environ.get(ELASTIC_ID_VAR):
        return None
    return _read_plan(_store())


def _newer_world() -> tuple[int, HostUpdateResult] | None:
    plan = latest_plan()
    if plan is None or plan.version <= RUNTIME.elastic_version:
        return None
    return plan.version, update_result(_joined, plan.members, plan.added)


#: queues each newer world on the elastic states of this worker (Horovod's notifications)
NOTIFIER = Notifier(_newer_world)


class State:
    """What training needs to continue after a reset; see the module docstring.

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank; ``get_rank()`` this rank.
    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object, self._rank = bcast_object, get_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        # Horovod's: the driver's notices of changed hosts, (timestamp, HostUpdateResult)
        self._host_messages: queue.Queue[tuple[int, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp = 0
        if elastic_job():
            NOTIFIER.register(self)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after every reset (to rescale the learning rate, say)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After joining a new world (the reset loop calls this): forget the notices of the
        old one, :meth:`reset`, then the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        """Queue a notice that the hosts changed (the next commit raises
        :class:`HostsUpdatedInterrupt`)."""
        self._host_messages.put((timestamp, update_res))

    def reset(self) -> None:
        """Reset objects after a reset event, before the sync (subclasses override it)."""

    def commit(self) -> None:
        """Save the state, then check for added or removed hosts (which raises
        :class:`HostsUpdatedInterrupt` on every rank)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when a notice of changed hosts
        newer than the last one acted on is queued; all ranks agree (rank 0's view is
        broadcast). A change that only removed hosts skips the sync that follows."""
        if self._rank() == 0 and elastic_job():
            NOTIFIER.poll()  # rank 0 asks the driver now, not at the notifier's next poll
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last, update = timestamp, update | result
        prev, self._last_updated_timestamp, update = self._bcast_object(
            (prev, last, int(update)))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(skip_sync=update == HostUpdateResult.removed)

    def save(self) -> None:
        """Keep a copy of the state (in memory)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable attributes (``ObjectState(bcast, rank, epoch=0, batch=0)``):
    ``state.epoch`` reads and writes them; ``sync()`` broadcasts them from rank 0."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        """Copy the attributes."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to the last commit."""
        self._set_attrs()

    def sync(self) -> None:
        """Rank 0's attributes everywhere (and saved as the commit)."""
        if self._saved_state:
            self.save()
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line: the message's first line, cut at ``limit`` characters
    (TensorFlow's op errors carry a block of graph context after it)."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    more = len(lines) > 1 or len(text) > limit
    return f"{type(exc).__name__}: {text[:limit]}" + (" [...]" if more else "")


def _retryable(exc: BaseException) -> bool:
    """A loss inside a collective (the communicator is closed): retry in a new world. A
    mismatch or a bad argument is the program's, not the world's: no retry."""
    return isinstance(exc, ShoalError) and not isinstance(exc, CollectiveMismatchError)


def world_broken() -> bool:
    """Whether the current communicator failed (a peer was lost): whatever error a framework
    wrapped that failure in, the job must reset."""
    comm = api.default_communicator()
    return comm is not None and comm.engine.broken is not None


def run_fn(func: _F, reset_fn: Callable[[], Any] = reset,
           retryable: Callable[[BaseException], bool] | None = None) -> _F:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic reset loop (Horovod's
    ``run_fn``): restore on a lost peer, keep on a hosts update, reset, sync, call again.
    ``retryable`` says which errors are a lost world (default: shoal's own, and any error
    raised while the communicator is broken)."""
    retry = retryable or (lambda exc: _retryable(exc) or world_broken())

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not api.is_initialized():
            if os.environ.get(ELASTIC_ID_VAR):
                join_world()
            else:
                api.init()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:
                if not retry(exc) or not os.environ.get(ELASTIC_ID_VAR):
                    raise
                _log.warning("elastic: %s; back to the last commit, joining the next world",
                             one_line(exc))
                _log.debug("elastic: the error in full", exc_info=exc)
                state.restore()
                skip_sync = False
            reset_fn()
            state.on_reset()

    return wrapper  # type: ignore[return-value]
