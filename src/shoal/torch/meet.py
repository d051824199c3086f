"""Meeting through a store that outlives its writers: torchrun's.

torchrun's agents keep one TCPStore across restarts of the worker group, so a restarted
worker finds the keys of the group before it, and the agents do not even agree on how many
restarts there were: the agent whose worker died counts one, an agent that restarted only
because a new member was waiting counts none (seen with ``--nnodes 2``). No key in such a
store tells a worker whether its writer is of this round or of the last.

What does tell is liveness: an agent stops all its workers before the next round begins, so
a process that answers is of this round. The group's rank 0 therefore serves a fresh shoal
store and writes its address and a nonce (the beacon) into the torch store; every other rank
reads the beacon, connects, proves the key and checks that the store holds the beacon's
nonce. A beacon of the last round points at a dead process (or, by chance, at a live store
of another group, whose nonce differs): the rank reads the beacon again until it is fresh,
within the start timeout. The fresh store holds this round's keys only.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable

from shoal.core.errors import AuthenticationError, PeerLostError, RendezvousError
from shoal.core.rendezvous import StoreClient, StoreServer
from shoal.core.store import Store

__all__ = ["meet_fresh"]

_BEACON = "shoal/fresh-store"


def meet_fresh(store: Store, rank: int, bind_addr: str, key: bytes, timeout: float
               ) -> tuple[StoreClient, list[Callable[[], None]]]:
    """A store of this round's keys only, met through ``store`` (whose keys may be stale);
    and what closes it (client first, then rank 0's server)."""
    closers: list[Callable[[], None]] = []
    if rank == 0:
        server = StoreServer(key, host=bind_addr, port=0).start()
        closers.append(server.close)
        nonce = secrets.token_hex(8)
        client = StoreClient(bind_addr, server.address[1], key, timeout=timeout,
                             connect_timeout=timeout, rank=rank)
        client.set("nonce", nonce.encode())
        store.set(_BEACON, f"{bind_addr} {server.address[1]} {nonce}".encode())
        return client, [client.close, *closers]
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"rank {rank}: rank 0 of this group never published a live "
                                  f"store within {timeout:g}s (only beacons of an earlier "
                                  f"round answered, or none)")
        beacon = store.get(_BEACON, left)
        host, port, nonce = beacon.decode().split()
        client = None
        try:
            client = StoreClient(host, int(port), key, timeout=min(2.0, left),
                                 connect_timeout=min(2.0, left), rank=rank)
            if client.get("nonce", min(2.0, left)).decode() == nonce:
                client.timeout = timeout
                return client, [client.close]
        except (OSError, AuthenticationError, PeerLostError, RendezvousError):
            pass
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        time.sleep(0.1)  # the last round's beacon: read again until rank 0 overwrites it
