"""Communicators: values made from (store, rank, size), any number per process.

A :class:`Communicator` meets its peers through a :class:`~shoal.core.store.Store`, learns there
which ranks share a host, their addresses and the job secret, and owns what it builds: the TCP
connections, the shared-memory group, the heartbeat, the engine thread with its name cache, and
the timeline. :meth:`Communicator.close` releases all of it. Sub-communicators over a subset of
ranks are made through a parent (:meth:`Communicator.split`) without a new launcher; torch
process groups and Horovod process sets are built that way. ``shoal.init()`` makes the default
communicator the module-level functions use.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from . import algorithms, config, topology
from .auth import KeyAgreement, secret_bytes, unwrap_secret, wrap_secret
from .collectives import Collectives
from .config import Config
from .engine import Engine
from .errors import AuthenticationError, PeerLostError, ShoalError
from .liveness import MODES, Liveness
from .p2p import P2PHandle, PeerMessages
from .runtime import RUNTIME
from .store import PrefixStore, Store
from .timeline import Timeline
from .transport import Transport
from .transport.shm import DEFAULT_CHUNK, ShmGroup, pipeline_chunk
from .transport.tcp import TcpMesh, choose_streams

__all__ = ["Communicator", "explain_loss", "local_address"]

log = logging.getLogger("shoal")
_keys = itertools.count(1)


def local_address(remote: str, port: int) -> str:
    """The address of the interface that routes to ``remote`` (no packet is sent)."""
    if remote in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((remote, port or 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def explain_loss(store: Store, prefix: str, rank: int, size: int,
                 exc: PeerLostError, abort: Callable[[], None],
                 grace: float = 1.0, settle: float = 0.2) -> PeerLostError:
    """Turn "my neighbour left" into "rank r died".

    A rank that gives up because *its* peer died closes its connections too, so the error a
    rank sees first often names a messenger. So every failing rank reports at the store whom
    it blames *before* it lets its own peers go (``abort``); the lost ranks are those blamed
    by someone that never report themselves. Without a reachable store, ``exc`` is kept.
    """
    found: list[list[int]] = []
    reported = threading.Event()

    def ask() -> None:  # in a thread: a stopped store host must not stop us too
        try:
            store.set(f"{prefix}/{rank}", str(exc.rank).encode())
            reported.set()
            start = time.monotonic()
            while True:
                blamed, silent = set(), []
                for r in range(size):
                    said = store.try_get(f"{prefix}/{r}")
                    if said is None:
                        silent.append(r)
                    elif said != b"None":
                        blamed.add(int(said))
                lost = [r for r in silent if r in blamed]
                waited = time.monotonic() - start
                if (lost and waited > settle) or waited > grace:
                    found.append(lost)
                    return
                time.sleep(0.05)
        except Exception:
            return

    asker = threading.Thread(target=ask, name="shoal-explain-loss", daemon=True)
    asker.start()
    reported.wait(0.5)
    abort()
    asker.join(grace + 2.0)
    if not found or not found[0] or found[0] == [exc.rank]:
        return exc
    lost = found[0]
    return PeerLostError(f"rank {rank}: lost rank{'s' if len(lost) > 1 else ''} "
                         f"{', '.join(map(str, lost))} (it stopped answering; seen here as: "
                         f"{exc})", rank=lost[0])


def _stream_counts(rank: int, peers: list[dict], quiet: bool = False) -> list[int]:
    """TCP connections from ``rank`` to each rank: one on its own host, across hosts the
    fewer of the two ends' choices (:func:`choose_streams` from each end's settings), so
    both ends open the same number whatever their settings."""
    hosts = [p["host"] for p in peers]

    def wanted(r: int) -> int:
        setting, fusion, stripe = peers[r]["streams"]
        remote = sum(h != hosts[r] for h in hosts)
        return choose_streams(setting, fusion // len(hosts), stripe, remote)

    mine = wanted(rank)
    counts = [1 if hosts[r] == hosts[rank] else min(mine, wanted(r)) for r in range(len(hosts))]
    across = [c for r, c in enumerate(counts) if hosts[r] != hosts[rank]]
    if across and not quiet:
        log.info("rank %d: %s TCP stream(s) to each of %d peers on other hosts", rank,
                 "/".join(map(str, sorted(set(across)))), len(across))
    return counts


class Communicator(Collectives):
    """A group of ranks that run collectives together; build with :meth:`create`."""

    def __init__(self, cfg: Config, world: topology.World, transport: Transport,
                 store: Store | None, *, secret: str = "", job_id: str = "local",
                 liveness: Liveness | None = None, p2p: PeerMessages | None = None,
                 closers: Sequence[Callable[[], None]] = ()) -> None:
        self.cfg = cfg
        self.world = world
        self.transport = transport
        self.store = store
        self.secret = secret
        self.job_id = job_id
        self.liveness = liveness
        self._closers = list(closers)
        self._children: dict[tuple[int, ...], int] = {}
        self.p2p = p2p
        self._counter = 0
        self._ordinals: dict[str, int] = {}
        self.key = next(_keys)  # this process's handle on the communicator (never a name)
        self._closed = False
        timeline = Timeline(cfg.timeline, world.rank, cfg.timeline_mark_cycles) \
            if cfg.timeline and (
            world.rank == 0 or "{rank}" in cfg.timeline) else None
        explain = None
        if store is not None and world.size > 1:
            explain = lambda exc, abort: explain_loss(  # noqa: E731
                store, "lost", world.rank, world.size, exc, abort)
        self.engine = Engine(transport, cfg, explain, timeline=timeline)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, store: Store | None, rank: int, size: int, *, cfg: Config | None = None,
               hostname: str | None = None, secret: str | None = None,
               job_id: str | None = None, bind_addr: str | None = None,
               closers: Sequence[Callable[[], None]] = ()) -> Communicator:
        """Meet ``size`` ranks through ``store`` (its keys are this communicator's alone:
        give each communicator a fresh store or :class:`PrefixStore`) as ``rank``.

        ``secret`` authenticates every connection; without one, rank 0 makes one and seals
        it for each rank through the store (Diffie-Hellman: it never lies there readable).
        ``hostname`` decides which ranks share memory (default: this machine's name, or
        ``SHOAL_HOSTNAME``). ``closers`` run when the communicator closes (after its own
        resources), e.g. to close the store.
        """
        cfg = config.load() if cfg is None else cfg
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        host = hostname or cfg.hostname or socket.gethostname()
        if size == 1:
            return cls(cfg, topology.World.single(host), Transport(cfg, topology.World.single(
                host), None, None), store, secret=secret or "", job_id=job_id or "local",
                closers=closers)
        wait = cfg.start_timeout_s
        agreement = None if secret else KeyAgreement()
        if rank == 0:
            store.set("init", json.dumps({
                "uid": secrets.token_hex(4), "job": job_id or "job",
                "dh": None if agreement is None else agreement.public}).encode())
        shared = json.loads(store.get("init", wait))
        uid, job_id = shared["uid"], shared["job"]  # rank 0's job id names the segments
        if agreement is not None:
            secret = _agree_secret(store, rank, size, agreement, shared["dh"], wait)
        key = secret_bytes(secret)
        bind = bind_addr or cfg.bind_addr or "127.0.0.1"
        resources: list[Callable[[], None]] = []
        try:
            liveness = Liveness(rank, key, uid.encode(), bind,
                                interval=cfg.heartbeat_interval_s,
                                timeout=cfg.heartbeat_timeout_s,
                                stall_warning=cfg.stall_warning_s, hard_timeout=cfg.timeout_s)
            resources.append(liveness.close)
            mesh = TcpMesh(rank, size, key, timeout=cfg.timeout_s or 60.0,
                           buffer_bytes=cfg.tcp_buffer_bytes, bind_addr=bind, liveness=liveness,
                           stripe_bytes=cfg.tcp_stripe_bytes)
            resources.append(mesh.close)
            p2p = PeerMessages(rank, size, key, bind_addr=bind, timeout=cfg.timeout_s or None,
                               connect_timeout=wait, buffer_bytes=cfg.tcp_buffer_bytes,
                               liveness=liveness, held_bytes=cfg.p2p_held_bytes)
            resources.append(p2p.close)
            hello = json.dumps({"host": host, "addr": mesh.address[0], "port": mesh.address[1],
                                "hb": liveness.address[1], "hbt": liveness.tcp_address[1],
                                "p2p": p2p.address[1], "pid": os.getpid(),
                                "streams": [cfg.tcp_streams, cfg.fusion_threshold,
                                            cfg.tcp_stripe_bytes]}).encode()
            peers = [json.loads(b) for b in store.allgather("hello", rank, size, hello, wait)]
            world = topology.World.from_hostnames(rank, [p["host"] for p in peers])
            if agreement is not None and rank == 0:
                _say_exposed(world)
            counts = _stream_counts(rank, peers)
            mesh.connect([(p["addr"], p["port"]) for p in peers], wait, counts)
            _start_heartbeats(liveness, cfg, store, peers, wait)
            p2p.start([(p["addr"], p["p2p"]) for p in peers])
            shm = None
            if cfg.shm_enable and world.local_size > 1:
                def barrier(tag: str) -> None:
                    store.barrier(f"node{world.cross_rank}/{tag}", world.local_size, wait)
                # every local rank works out the same chunk: from the most streams any of
                # them opened to another host
                streams = max(max(_stream_counts(r, peers, quiet=True))
                              for r in world.local_ranks)
                chunk = pipeline_chunk(cfg.shm_chunk_bytes, world.local_size, world.cross_size,
                                       streams)
                if chunk != (cfg.shm_chunk_bytes or DEFAULT_CHUNK):
                    log.info("rank %d: shared-memory chunk %d KiB (%d streams across hosts)",
                             rank, chunk >> 10, streams)
                shm = ShmGroup(f"{job_id}-{uid}", world.cross_rank, world.local_rank,
                               world.local_ranks, chunk, cfg.timeout_s or 60.0, barrier,
                               liveness)
                resources.append(shm.close)
            transport = Transport(cfg, world, mesh, shm)
            algorithms.choose(transport, cfg.allreduce_algorithm)
            comm = cls(cfg, world, transport, store, secret=secret, job_id=job_id,
                       liveness=liveness, p2p=p2p, closers=closers)
        except BaseException:
            for release in reversed(resources):
                with contextlib.suppress(Exception):
                    release()
            raise
        try:
            store.barrier("ready", size, wait)
        except BaseException:
            comm.close()
            raise
        return comm

    def split(self, ranks: Sequence[int], *, cfg: Config | None = None) -> Communicator | None:
        """A communicator over ``ranks`` (ranks of this one, in the order given: position i
        becomes rank i). Only the ranks in ``ranks`` need to call it, all with the same list;
        others get ``None``. Made through this communicator's store; the child lives until
        closed, independently of its parent's other children."""
        members = tuple(int(r) for r in ranks)
        if len(set(members)) != len(members) or not all(0 <= r < self.size for r in members):
            raise ValueError(f"rank {self.rank}: sub-communicator ranks {list(members)} must be "
                             f"distinct ranks of this communicator (size {self.size})")
        if self.rank not in members:
            return None
        count = self._children.get(members, 0)
        self._children[members] = count + 1
        if self.store is None:  # a one-rank parent: the child is a one-rank group too
            return Communicator.create(_LocalStore(), 0, 1, cfg=cfg or self.cfg)
        prefix = f"sub/{'.'.join(map(str, members))}/{count}"
        return self.child(members, PrefixStore(self.store, prefix), cfg=cfg)

    def child(self, members: Sequence[int], store: Store, *,
              cfg: Config | None = None) -> Communicator:
        """A communicator over ``members`` (this rank among them) met through ``store``, which
        every member must name alike and no other communicator may use; it inherits this
        one's host identities, secret, job and address. :meth:`split` numbers its stores
        itself."""
        cfg = cfg or self.cfg
        if cfg.heartbeat == "auto" and self.liveness is not None:  # the parent probed
            cfg = cfg.replace(heartbeat=self.liveness.mode)
        return Communicator.create(store, list(members).index(self.rank), len(members),
                                   cfg=cfg, hostname=self.world.hosts[self.rank],
                                   secret=self.secret, job_id=self.job_id,
                                   bind_addr=self.transport.mesh.address[0]
                                   if self.transport.mesh else None)

    def ordinal(self, kind: str) -> int:
        """The next number of ``kind`` on this communicator: 0, 1, ... in the order this rank
        asks, so the same on every rank that asks in the same order. Adapters name long-lived
        collectives with it (a layer's statistics, an optimizer's shards) at first use, where
        a process-wide count would differ between ranks that built different objects."""
        n = self._ordinals.get(kind, 0)
        self._ordinals[kind] = n + 1
        return n

    # -- point to point --------------------------------------------------------------------
    def _peer_messages(self) -> PeerMessages:
        if self.p2p is None:
            raise ShoalError(f"rank {self.rank}: a communicator of one rank has no peers to "
                             f"send to or receive from")
        return self.p2p

    def send(self, array: np.ndarray, dst: int, tag: int = 0,
             ready: Callable[[], None] | None = None) -> P2PHandle:
        """Start sending the bytes of ``array`` to rank ``dst`` (keep ``array`` unchanged
        until the handle is done). Messages to one rank with one tag arrive in order.
        ``ready`` is called on the sending thread before ``array`` is read (a device copy's
        wait, which the caller then never does)."""
        return self._peer_messages().send(array, dst, tag, ready)

    def recv(self, out: np.ndarray, src: int | None = None, tag: int = 0) -> P2PHandle:
        """Start receiving into ``out`` from rank ``src`` (any rank when None); the handle
        resolves to the sender's rank. The sizes in bytes must match the send's."""
        return self._peer_messages().recv(out, src, tag)

    # -- identity --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.world.rank

    @property
    def size(self) -> int:
        """Number of ranks in the communicator."""
        return self.world.size

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm chosen for this topology."""
        return self.transport.algorithm

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being written, if any."""
        return self.engine.timeline

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, algorithm={self.algorithm})"

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Release the engine thread, heartbeat, connections and shared memory (idempotent).
        Pending collectives fail; peers waiting on this rank learn at once."""
        if self._closed:
            return
        self._closed = True
        if self.p2p is not None:
            self.p2p.close()
        self.engine.close()
        if self.liveness is not None:
            self.liveness.close()
        self.transport.close()
        for release in self._closers:
            with contextlib.suppress(Exception):
                release()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _agree_secret(store: Store, rank: int, size: int, agreement: KeyAgreement,
                  leader: int | None, wait: float) -> str:
    """No shared secret was given: rank 0 makes one and seals it for each rank under a key
    agreed with that rank (Diffie-Hellman through the store), so the store never holds it
    readable; the job secret, hex."""
    if leader is None:
        raise AuthenticationError(f"rank {rank}: rank 0 was given a job secret and this rank "
                                  f"was not; set SHOAL_SECRET alike on every rank")
    if rank != 0:
        store.set(f"dh/{rank}", str(agreement.public).encode())
        sealed = store.get(f"sealed/{rank}", wait)
        return unwrap_secret(sealed, agreement.shared(leader), rank).hex()
    job_secret = os.urandom(32)
    for r in range(1, size):
        peer = int(store.get(f"dh/{r}", wait))
        store.set(f"sealed/{r}", wrap_secret(job_secret, agreement.shared(peer), r))
    return job_secret.hex()


def _say_exposed(world: topology.World) -> None:
    """Once per process, on rank 0: what a job without a shared secret is exposed to."""
    if not RUNTIME.say_once("exposed"):
        return
    where = (f"{world.cross_size} hosts" if world.cross_size > 1 else "one host")
    say = log.warning if world.cross_size > 1 else log.info
    say("no SHOAL_SECRET on %s: connections are authenticated with a key rank 0 handed out "
        "through the rendezvous store by Diffie-Hellman. That keeps out whoever only reads "
        "the store or watches the network, but whoever can reach the store while the job "
        "starts can join it as a rank or stand in the middle, and tensors cross the network "
        "unencrypted. Set SHOAL_SECRET or SHOAL_SECRET_FILE alike on every rank (shoalrun "
        "does) to keep strangers out.", where)


def _start_heartbeats(liveness: Liveness, cfg: Config, store: Store, peers: list[dict],
                      wait: float) -> None:
    """Start the heartbeat the way ``SHOAL_HEARTBEAT`` says. ``auto`` tries UDP: when some
    rank did not hear every peer within a few intervals (a network that passes TCP but drops
    UDP), every rank moves to TCP, and rank 0 says so once."""
    mode = cfg.heartbeat.lower()
    if mode not in MODES:
        raise ShoalError(f"SHOAL_HEARTBEAT={cfg.heartbeat!r}: use one of {', '.join(MODES)}")
    liveness.start({r: (p["addr"], p["hb"]) for r, p in enumerate(peers)},
                   {r: (p["addr"], p["hbt"]) for r, p in enumerate(peers)}, mode)
    if mode != "auto":
        return
    probe = min(max(2.0, 2.5 * cfg.heartbeat_interval_s), max(0.5, cfg.heartbeat_timeout_s / 2))
    missing = liveness.udp_heard_all(probe)
    me, size = liveness.rank, len(peers)
    verdicts = [json.loads(b) for b in store.allgather(
        "heartbeat", me, size, json.dumps(missing).encode(), wait)]
    deaf = {r: m for r, m in enumerate(verdicts) if m}
    if not deaf:
        liveness.keep_udp()
        return
    liveness.use_tcp()
    if me == 0:
        pairs = "; ".join(f"rank {r} heard nothing from {', '.join(map(str, m[:8]))}"
                          for r, m in list(deaf.items())[:4])
        log.warning("heartbeats go over TCP: UDP datagrams did not arrive within %.1fs (%s); "
                    "a network that drops UDP, fine for shoal (set SHOAL_HEARTBEAT=tcp to skip "
                    "the probe)", probe, pairs)


class _LocalStore(Store):
    """An in-process store, for one-rank communicators."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self._data[key] = bytes(value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        if key not in self._data:
            raise ShoalError(f"key {key!r} is not in this one-process store")
        return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def add(self, key: str, delta: int) -> int:
        value = int(self._data.get(key, b"0")) + delta
        self._data[key] = str(value).encode()
        return value

    def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def __repr__(self) -> str:
        return f"_LocalStore({len(self._data)} keys)"

