"""The rendezvous store: a small authenticated key-value store over TCP (no pickle, ever).

After the HMAC handshake of :mod:`shoal.core.auth` (role ``b"store"``) a request is ``!BIIQ``
(op, key length, value length, timeout ms) + key + value; a response is ``!BI`` (status, value
length) + value. Waiting requests block on the server until satisfied or their own timeout
expires. A frame that breaks the protocol closes its connection and counts as refused.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from . import auth
from .errors import PeerLostError, RendezvousError
from .netutil import connect, recv_exact, tune_socket
from .store import Store

__all__ = ["MAX_KEY_BYTES", "MAX_VALUE_BYTES", "Op", "Status", "StoreClient", "StoreClosedError",
           "StoreServer"]

log = logging.getLogger("shoal.rendezvous")

ROLE = b"store"
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 64 << 20
_REQUEST = struct.Struct("!BIIQ")
_RESPONSE = struct.Struct("!BI")
_MAX_WAIT_S = 30 * 86400.0  # longer waits are clamped (and stay far below threading.TIMEOUT_MAX)
_HINT = "rank 0 or the launcher probably exited"


class Op(enum.IntEnum):
    """Request op codes. ``GET`` with timeout 0 is a non-blocking lookup."""

    SET = 1
    GET = 2
    ADD = 3  # value: decimal delta; answers the new decimal value
    DELETE = 4
    WAIT = 5  # like GET, but answers no value
    WAIT_AT_LEAST = 6  # value: decimal target for the counter at key; on timeout answers it


class Status(enum.IntEnum):
    """Response status codes."""

    OK = 0
    NOT_FOUND = 1
    TIMEOUT = 2
    CLOSED = 3  # the server is shutting down
    ERROR = 4  # well-formed but impossible request; value: UTF-8 reason


class StoreClosedError(RendezvousError):
    """The store went away (its host shut it down or died) while this client used it."""


class _RefusedError(Exception):
    """A failed handshake or a frame that breaks the protocol: the connection is refused."""


def _counter(raw: bytes) -> int | None:
    """A short decimal integer (short: int <-> str never hits Python's digit limit) or None."""
    try:
        return int(raw) if len(raw) <= 32 else None
    except ValueError:
        return None


class StoreServer:
    """Serves the store from daemon threads: one accepts, one per connection serves."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *,
                 max_value_bytes: int = MAX_VALUE_BYTES, handshake_timeout: float = 5.0) -> None:
        self._secret, self._host, self._port = secret, host, port
        self._max_value, self._handshake_timeout = max_value_bytes, handshake_timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed, self._refused = False, 0
        self._lock = threading.Lock()  # guards _conns and _refused
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def start(self) -> StoreServer:
        """Bind (with ``SO_REUSEADDR``), listen and serve from daemon threads; returns ``self``."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:  # create_server sets SO_REUSEADDR (on POSIX) and closes the socket on failure
            sock = socket.create_server((self._host, self._port), family=family, backlog=128)
        except OSError as exc:
            raise RendezvousError(f"cannot serve the rendezvous store on {self._host}:"
                                  f"{self._port}: {exc} (is the port already in use?)") from exc
        sock.settimeout(0.2)  # the accept loop polls, so close() never races a blocked accept()
        self._listener = sock
        self._acceptor = threading.Thread(target=self._accept_loop, args=(sock,),
                                          name="shoal-store-accept", daemon=True)
        self._acceptor.start()
        return self

    def __enter__(self) -> StoreServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` actually bound (the real port even when 0 was asked for)."""
        if self._listener is None:
            raise RendezvousError("the rendezvous store has not been started")
        return self._listener.getsockname()[:2]

    @property
    def refused(self) -> int:
        """How many connections were refused (failed authentication or a bad frame)."""
        with self._lock:
            return self._refused

    def close(self) -> None:
        """Stop accepting, wake every waiter (they answer CLOSED), close all connections."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._acceptor is not None:
            self._acceptor.join(timeout=2.0)
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:  # wakes blocked readers; woken waiters can still send their answer
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + 2.0
        for sock, thread in conns.items():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            sock.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        with listener:
            while not self._closed:
                try:
                    sock, addr = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    log.error("rendezvous store stopped accepting connections: %s", exc)
                    return
                peer = f"{addr[0]}:{addr[1]}"
                thread = threading.Thread(target=self._serve, args=(sock, peer),
                                          name=f"shoal-store-{peer}", daemon=True)
                with self._lock:  # close() joins this thread before it looks at _conns
                    self._conns[sock] = thread
                thread.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            tune_socket(sock)
            sock.settimeout(self._handshake_timeout)
            try:
                auth.server_handshake(sock, self._secret, ROLE)
            except (RendezvousError, OSError) as exc:  # wrong secret, garbage, silence
                raise _RefusedError(exc) from None
            sock.settimeout(None)
            while not self._closed and (request := self._read_request(sock)) is not None:
                status, value = self._execute(*request)
                sock.sendall(_RESPONSE.pack(status, len(value)) + value)
        except _RefusedError as exc:
            if not self._closed:  # a connection cut by close() is not a misbehaving client
                with self._lock:
                    self._refused += 1
                log.warning("refused connection from %s: %s", peer, exc)
        except (OSError, PeerLostError):
            pass  # the client went away between requests or while we answered
        except Exception:
            log.exception("internal error while serving %s; closing its connection", peer)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _read_request(self, sock: socket.socket) -> tuple[Op, str, bytes, float] | None:
        """Read and validate one frame; ``None`` on a clean close between frames."""
        if not (head := sock.recv(_REQUEST.size)):
            return None
        try:
            if len(head) < _REQUEST.size:
                head += recv_exact(sock, _REQUEST.size - len(head))
            code, key_len, value_len, timeout_ms = _REQUEST.unpack(head)
            if code not in Op.__members__.values():
                raise _RefusedError(f"unknown op code {code}")
            op = Op(code)
            if key_len > MAX_KEY_BYTES:
                raise _RefusedError(f"key of {key_len} bytes exceeds {MAX_KEY_BYTES} bytes")
            if value_len > self._max_value:
                raise _RefusedError(f"value of {value_len} bytes exceeds max_value_bytes="
                                    f"{self._max_value}")
            if value_len and op not in (Op.SET, Op.ADD, Op.WAIT_AT_LEAST):
                raise _RefusedError(f"{op.name} takes no value but {value_len} bytes came")
            body = recv_exact(sock, key_len + value_len) if key_len + value_len else b""
        except PeerLostError:
            raise _RefusedError("connection closed in the middle of a frame") from None
        value = body[key_len:]
        try:
            key = body[:key_len].decode()
            if op in (Op.ADD, Op.WAIT_AT_LEAST) and _counter(value) is None:
                raise ValueError("expected a short decimal integer")
        except ValueError as exc:  # includes UnicodeDecodeError
            raise _RefusedError(f"malformed {op.name} request: {exc}") from None
        return op, key, value, min(timeout_ms / 1000.0, _MAX_WAIT_S)

    def _count(self, key: str) -> int | None:
        return _counter(self._data.get(key, b"0"))

    def _wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        return bool(self._cond.wait_for(lambda: self._closed or ready(), timeout)) and ready()

    def _execute(self, op: Op, key: str, value: bytes, timeout: float) -> tuple[Status, bytes]:
        with self._cond:
            if op is Op.SET:
                self._data[key] = value
                self._cond.notify_all()
                return Status.OK, b""
            if op is Op.DELETE:
                return (Status.NOT_FOUND if self._data.pop(key, None) is None else Status.OK), b""
            if op is Op.ADD:
                count = self._count(key)
                if count is None:
                    return Status.ERROR, f"key {key!r} does not hold a counter".encode()
                self._data[key] = str(count + int(value)).encode()  # value was validated
                self._cond.notify_all()
                return Status.OK, self._data[key]
            if op in (Op.GET, Op.WAIT):
                if self._wait(lambda: key in self._data, timeout):
                    return Status.OK, self._data[key] if op is Op.GET else b""
            else:  # Op.WAIT_AT_LEAST
                target = int(value)
                if self._wait(lambda: (self._count(key) or 0) >= target, timeout):
                    return Status.OK, b""
                value = str(self._count(key) or 0).encode()
            return (Status.CLOSED if self._closed else Status.TIMEOUT), value


class StoreClient(Store):
    """A thread-safe connection to a :class:`StoreServer`: one request in flight at a time
    (a blocking call holds it, so threads that wait concurrently want clients of their own)."""

    def __init__(self, addr: str, port: int, secret: bytes, *, timeout: float = 30.0,
                 connect_timeout: float = 120.0, rank: int | None = None) -> None:
        self.addr, self.port, self.timeout = addr, port, timeout
        self._who = f"rank {rank}: " if rank is not None else ""
        self._where = f"the rendezvous store at {addr}:{port}"
        self._lock, self._closed = threading.Lock(), False
        self._sock = self._connect(secret, connect_timeout)

    def _connect(self, secret: bytes, connect_timeout: float) -> socket.socket:
        """Connect and authenticate, retrying with back-off while the server is not up yet."""
        deadline = time.monotonic() + connect_timeout
        delay, last = 0.05, "none"
        while (left := deadline - time.monotonic()) > 0:
            sock: socket.socket | None = None
            try:
                sock = connect(self.addr, self.port, min(left, self.timeout))
                tune_socket(sock)
                auth.client_handshake(sock, secret, ROLE)
                return sock
            except BaseException as exc:
                if sock is not None:
                    sock.close()
                if not isinstance(exc, OSError):  # AuthenticationError: retrying cannot help
                    raise
                last = str(exc) or type(exc).__name__  # refused, reset, timed out: retry
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)
        raise RendezvousError(
            f"{self._who}could not reach {self._where} within {connect_timeout:g}s (last error: "
            f"{last}); check that rank 0 or shoalrun is running, that SHOAL_RENDEZVOUS_ADDR/"
            "SHOAL_RENDEZVOUS_PORT point at it and that no firewall blocks the port")

    def _request(self, op: Op, key: str, value: bytes, wait: float,
                 what: str) -> tuple[Status, bytes]:
        """One request/response; CLOSED and ERROR answers become :class:`RendezvousError`."""
        key_b = key.encode()
        if len(key_b) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"{what}: key ({len(key_b)} bytes) or value ({len(value)} bytes) "
                             f"exceeds the limit ({MAX_KEY_BYTES} / {MAX_VALUE_BYTES} bytes)")
        wait = min(max(wait, 0.0), _MAX_WAIT_S)
        head = _REQUEST.pack(op, len(key_b), len(value), int(wait * 1000)) + key_b
        with self._lock:
            if self._closed:
                raise RendezvousError(f"{self._who}{what}: this store client is closed")
            try:
                self._sock.settimeout(wait + self.timeout)
                self._sock.sendall(head + value)
                code, n = _RESPONSE.unpack(recv_exact(self._sock, _RESPONSE.size, "store"))
                value = recv_exact(self._sock, n, "store") if n else b""
            except (OSError, PeerLostError) as exc:
                closed_here, self._closed = self._closed, True
                self._sock.close()
                if closed_here:
                    problem = "the client was closed"
                elif isinstance(exc, TimeoutError):
                    problem = f"{self._where} did not answer within {wait + self.timeout:g}s"
                else:
                    problem = f"{self._where} went away ({_HINT}): {exc}"
                raise StoreClosedError(f"{self._who}{what}: {problem}") from None
        if code == Status.CLOSED:
            raise StoreClosedError(f"{self._who}{what}: {self._where} shut down ({_HINT})")
        if code == Status.ERROR or code not in Status.__members__.values():
            reason = value.decode(errors="replace") or f"unknown status {code}"
            raise RendezvousError(f"{self._who}{what}: {self._where} answered: {reason}")
        return Status(code), value

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and wake its waiters."""
        self._request(Op.SET, key, bytes(value), 0.0, f"setting key {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting (on the server) up to ``timeout`` for it to appear."""
        wait = self.timeout if timeout is None else timeout
        status, value = self._request(Op.GET, key, b"", wait, f"waiting for key {key!r}")
        if status is not Status.OK:
            raise RendezvousError(f"{self._who}key {key!r} did not appear in {self._where} "
                                  f"within {wait:g}s (whoever sets it is slow, stuck or dead)")
        return value

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` at once if it does not exist."""
        status, value = self._request(Op.GET, key, b"", 0.0, f"reading key {key!r}")
        return value if status is Status.OK else None

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the decimal counter at ``key`` (missing: 0); new value."""
        _, value = self._request(Op.ADD, key, str(int(delta)).encode(), 0.0,
                                 f"adding to key {key!r}")
        return int(value)

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        status, _ = self._request(Op.DELETE, key, b"", 0.0, f"deleting key {key!r}")
        return status is Status.OK

    def _gather(self, op: Op, keys: Sequence[str], wait: float,
                what: str) -> tuple[list[bytes], list[int]]:
        """Wait (on the server) up to ``wait`` for all keys: (answers, indexes still missing)."""
        deadline, values = time.monotonic() + wait, []
        for i, key in enumerate(keys):
            status, value = self._request(op, key, b"", deadline - time.monotonic(), what)
            if status is not Status.OK:
                return values, [i] + [j for j in range(i + 1, len(keys)) if self._request(
                    Op.WAIT, keys[j], b"", 0.0, what)[0] is not Status.OK]
            values.append(value)
        return values, []

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Wait until every key exists; the error lists the keys still missing."""
        wait = self.timeout if timeout is None else timeout
        missing = [repr(keys[i]) for i in self._gather(Op.WAIT, keys, wait, "waiting")[1]]
        if missing:
            raise RendezvousError(f"{self._who}keys still missing from {self._where} after "
                                  f"{wait:g}s: {', '.join(missing)}")

    def barrier(self, name: str, size: int, timeout: float | None = None) -> None:
        """Wait until ``size`` callers reached barrier ``name`` (use each name only once)."""
        wait, key = self.timeout if timeout is None else timeout, f"{name}/count"
        self.add(key, 1)
        status, value = self._request(Op.WAIT_AT_LEAST, key, str(int(size)).encode(), wait,
                                      f"waiting in barrier {name!r}")
        if status is not Status.OK:
            raise RendezvousError(
                f"{self._who}barrier {name!r}: only {value.decode()} of {size} ranks arrived "
                f"within {wait:g}s (the others are probably slow, stuck or dead)")

    def allgather(self, name: str, rank: int, size: int, value: bytes,
                  timeout: float | None = None) -> list[bytes]:
        """Publish ``value`` as ``rank``'s share of ``name``; every rank's share, by rank."""
        wait = self.timeout if timeout is None else timeout
        self.set(f"{name}/{rank}", value)
        keys = [f"{name}/{r}" for r in range(size)]
        values, missing = self._gather(Op.GET, keys, wait, f"allgather {name!r}")
        if missing:
            raise RendezvousError(
                f"{self._who}allgather {name!r}: ranks {missing} of {size} did not publish "
                f"within {wait:g}s (they are probably slow, stuck or dead)")
        return values

    def close(self) -> None:
        """Close the connection (idempotent; wakes a request blocked in another thread)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
