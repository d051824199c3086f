"""Raw TCP throughput between two emulated nodes over one or several connections.

The physical limits a cluster benchmark divides by, measured with nothing of shoal's in the
way: one flow shows a per-flow cap (:class:`~shoal.bench.netns.EmulatedCluster`'s
``flow_cap``), many flows together show the link. The receiver runs inside the destination
node's namespace and the sender inside the source's; every connection presents a random token
before the receiver reads a byte of payload (the receiver's port is open for the probe only,
but a port that reads unauthenticated data is what the project does not ship).
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .netns import EmulatedCluster

__all__ = ["probe"]

_TOKEN_ENV = "SHOAL_FLOW_TOKEN"
_TOKEN_BYTES = 32
_CHUNK = 1 << 20


def probe(cluster: EmulatedCluster, src: int, dst: int, streams: int, nbytes: int,
          timeout: float = 120.0) -> float:
    """Bytes per second from node ``src`` to node ``dst`` over ``streams`` TCP connections
    carrying ``nbytes`` in all, timed by the sender from its first byte to the receiver's
    acknowledgement of the last."""
    if streams < 1 or nbytes < streams:
        raise ValueError(f"probe: streams={streams}, nbytes={nbytes}: need 1 <= streams <= "
                         "nbytes")
    token = secrets.token_hex(_TOKEN_BYTES // 2)
    env = {**os.environ, _TOKEN_ENV: token}
    here = [sys.executable, "-m", "shoal.bench.flows"]
    server = subprocess.Popen(cluster.command(dst, [*here, "serve", cluster.addresses[dst],
                                                    str(streams), str(timeout)]),
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"probe: the receiver on node {dst} did not start")
        sender = subprocess.run(cluster.command(src, [*here, "send", cluster.addresses[dst],
                                                      port, str(streams), str(nbytes),
                                                      str(timeout)]),
                                capture_output=True, text=True, env=env, timeout=timeout,
                                check=False)
        if sender.returncode != 0:
            raise RuntimeError(f"probe: the sender on node {src} failed: "
                               f"{sender.stderr.strip()[-500:]}")
        return float(sender.stdout.strip())
    finally:
        server.kill()
        server.wait(timeout=30)


def _serve(addr: str, streams: int, timeout: float) -> None:
    token = os.environ[_TOKEN_ENV].encode()
    with socket.create_server((addr, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        listener.settimeout(timeout)
        served = 0
        while served < streams:
            conn, _ = listener.accept()
            conn.settimeout(5.0)  # a stranger that sends nothing holds the receiver 5 s
            try:
                ok = hmac.compare_digest(_read_exactly(conn, _TOKEN_BYTES), token)
            except OSError:
                ok = False
            if not ok:
                conn.close()  # dropped before any payload is read
                continue
            conn.settimeout(timeout)
            threading.Thread(target=_drain, args=(conn,), daemon=True).start()
            served += 1
        time.sleep(timeout)  # the parent kills the receiver once the sender reports


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            break
        got += part
    return got


def _drain(conn: socket.socket) -> None:
    buf = bytearray(_CHUNK)
    with conn:
        while conn.recv_into(buf):
            pass
        conn.sendall(b"!")


def _send(addr: str, port: int, streams: int, nbytes: int, timeout: float) -> None:
    token = os.environ[_TOKEN_ENV].encode()
    conns = [socket.create_connection((addr, port), timeout=timeout) for _ in range(streams)]
    for conn in conns:
        conn.sendall(token)
    payload = memoryview(bytearray(_CHUNK))
    shares = [nbytes // streams + (i < nbytes % streams) for i in range(streams)]
    errors: list[BaseException] = []

    def one(conn: socket.socket, share: int) -> None:
        try:
            while share > 0:
                n = min(share, _CHUNK)
                conn.sendall(payload[:n])
                share -= n
            conn.shutdown(socket.SHUT_WR)
            if conn.recv(1) != b"!":
                raise ConnectionError("the receiver closed before acknowledging")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c, s)) for c, s in zip(conns, shares,
                                                                          strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for conn in conns:
        conn.close()
    if errors:
        raise errors[0]
    print(nbytes / elapsed)


def main(argv: Sequence[str]) -> None:
    """``serve ADDR STREAMS TIMEOUT`` or ``send ADDR PORT STREAMS NBYTES TIMEOUT``."""
    if argv[0] == "serve":
        _serve(argv[1], int(argv[2]), float(argv[3]))
    elif argv[0] == "send":
        _send(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), float(argv[5]))
    else:
        raise SystemExit(f"shoal.bench.flows: unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
