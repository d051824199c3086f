"""The rendezvous store (shoal.core.rendezvous): operations, waiting, auth and hostile input."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.core import auth
from shoal.core.errors import AuthenticationError, RendezvousError
from shoal.core.rendezvous import Op, StoreClient, StoreServer

SECRET = bytes.fromhex("5e" * 32)
SMALL_MAX = 4096  # max_value_bytes of the servers that face hostile input
HEADER = struct.Struct("!BIIQ")
T = TypeVar("T")


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(SECRET, max_value_bytes=SMALL_MAX, handshake_timeout=0.5) as srv:
        yield srv


def make_client(srv: StoreServer, **kwargs: Any) -> StoreClient:
    kwargs.setdefault("timeout", 2.0)
    kwargs.setdefault("connect_timeout", 2.0)
    host, port = srv.address
    return StoreClient(host, port, kwargs.pop("secret", SECRET), **kwargs)


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    with make_client(server) as c:
        yield c


def run_threads(n: int, target: Callable[[int], T]) -> list[T | None]:
    """Run target(0..n-1) in threads; re-raise the first failure; results by index."""
    results: list[T | None] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


def raw(srv: StoreServer, handshake: bool = False) -> socket.socket:
    sock = socket.create_connection(srv.address, timeout=2.0)
    if handshake:
        auth.client_handshake(sock, SECRET, b"store")
    return sock


def wait_closed(sock: socket.socket) -> None:
    """Read until the server closes the connection (bounded by the socket timeout)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()


def assert_store_works(srv: StoreServer) -> None:
    with make_client(srv) as c:
        c.set("health", b"ok")
        assert c.get("health") == b"ok"


# -- operations ---------------------------------------------------------------------------------

def test_set_get_add_delete_try_get(client: StoreClient) -> None:
    client.set("a", b"1\x00\xff")
    assert client.get("a") == b"1\x00\xff"
    client.set("a", b"")
    assert client.get("a") == b""
    assert client.try_get("missing") is None
    assert client.add("n", 5) == 5
    assert client.add("n", -2) == 3
    assert client.get("n") == b"3"
    assert client.delete("n") is True
    assert client.delete("n") is False
    assert client.try_get("n") is None
    client.set("ключ/λ", b"unicode key")
    assert client.try_get("ключ/λ") == b"unicode key"
    big = bytes(range(256)) * 16  # exactly SMALL_MAX
    client.set("big", big)
    assert client.get("big") == big
    client.set("text", b"not a number")
    with pytest.raises(RendezvousError, match="does not hold a counter"):
        client.add("text", 1)
    with pytest.raises(ValueError, match="exceeds"):
        client.set("k" * 1025, b"")
    assert client.get("a") == b""  # the connection survived both errors


def test_get_blocks_until_another_client_sets(server: StoreServer, client: StoreClient) -> None:
    def setter() -> None:
        time.sleep(0.2)
        with make_client(server) as other:
            other.set("late", b"here")

    t = threading.Thread(target=setter)
    start = time.monotonic()
    t.start()
    assert client.get("late", timeout=2.0) == b"here"
    t.join(timeout=5)
    assert 0.15 < time.monotonic() - start < 2.0


def test_get_timeout_names_the_key(client: StoreClient) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"'never/set'.*0\.3s"):
        client.get("never/set", timeout=0.3)
    assert time.monotonic() - start < 1.5
    client.set("x", b"y")  # the client is still usable
    assert client.get("x") == b"y"


def test_wait_lists_missing_keys(client: StoreClient) -> None:
    client.set("k0", b"")
    client.set("k2", b"")
    client.wait(["k0", "k2"], timeout=0.5)
    with pytest.raises(RendezvousError, match="still missing") as info:
        client.wait(["k0", "k1", "k2", "k3"], timeout=0.3)
    assert "'k1'" in str(info.value) and "'k3'" in str(info.value)
    assert "'k0'" not in str(info.value) and "'k2'" not in str(info.value)


def test_barrier_and_allgather_across_threads(server: StoreServer) -> None:
    def rank(r: int) -> list[bytes]:
        with make_client(server, rank=r) as c:
            time.sleep(0.05 * r)  # arrive at different times
            c.set(f"arrived/{r}", b"")
            c.barrier("b1", 4, timeout=2.0)
            assert all(c.try_get(f"arrived/{i}") is not None for i in range(4))
            return c.allgather("ag", r, 4, f"value-{r}".encode() * (r + 1), timeout=2.0)

    expected = [f"value-{r}".encode() * (r + 1) for r in range(4)]
    assert run_threads(4, rank) == [expected] * 4


def test_barrier_timeout_says_how_many_arrived(client: StoreClient) -> None:
    client.add("b2/count", 1)  # one other rank already arrived
    with pytest.raises(RendezvousError, match=r"barrier 'b2': only 2 of 3"):
        client.barrier("b2", 3, timeout=0.3)


def test_allgather_names_the_missing_rank(client: StoreClient) -> None:
    client.set("g/1", b"one")
    client.set("g/3", b"three")
    with pytest.raises(RendezvousError, match=r"ranks \[2\] of 4"):
        client.allgather("g", 0, 4, b"zero", timeout=0.3)


def test_concurrent_add_is_atomic(server: StoreServer) -> None:
    def adder(_: int) -> list[int]:
        with make_client(server) as c:
            return [c.add("counter", 1) for _ in range(50)]

    results = run_threads(4, adder)
    seen = sorted(v for r in results for v in r or [])
    assert seen == list(range(1, 201))


# -- authentication and hostile input -----------------------------------------------------------

def test_wrong_secret_is_refused(server: StoreServer,
                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    with pytest.raises(AuthenticationError, match="SHOAL_SECRET"):
        make_client(server, secret=b"not the secret")
    assert server.refused == 1
    assert "refused connection from 127.0.0.1:" in caplog.text
    assert "does not know the job secret" in caplog.text
    assert_store_works(server)


def test_garbage_before_handshake(server: StoreServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    sock = raw(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 80)
    wait_closed(sock)
    assert server.refused == 1
    assert "bad magic bytes" in caplog.text
    assert_store_works(server)


def test_silent_client_times_out(server: StoreServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    sock = raw(server)  # says nothing; handshake_timeout is 0.5 s
    start = time.monotonic()
    wait_closed(sock)
    assert 0.3 < time.monotonic() - start < 2.0
    assert server.refused == 1
    assert "did not answer the challenge" in caplog.text


@pytest.mark.parametrize(("frame", "reason"), [
    (HEADER.pack(Op.SET, 3, SMALL_MAX + 1, 0) + b"key", "exceeds max_value_bytes"),
    (HEADER.pack(Op.GET, 5000, 0, 0), "exceeds 1024 bytes"),
    (HEADER.pack(200, 1, 0, 0) + b"k", "unknown op code 200"),
    (HEADER.pack(Op.GET, 1, 4, 0) + b"kabcd", "takes no value"),
    (HEADER.pack(Op.ADD, 1, 3, 0) + b"kabc", "malformed ADD"),
    (HEADER.pack(Op.SET, 2, 0, 0) + b"\xff\xfe", "malformed SET request: 'utf-8' codec"),
], ids=["big-value", "big-key", "unknown-op", "unexpected-value", "bad-delta", "bad-utf8"])
def test_bad_frame_after_handshake(server: StoreServer, caplog: pytest.LogCaptureFixture,
                                   frame: bytes, reason: str) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    with make_client(server) as bystander:
        bystander.set("before", b"1")
        sock = raw(server, handshake=True)
        sock.sendall(frame)  # an oversized payload is never sent: the server must not wait for it
        wait_closed(sock)
        assert server.refused == 1
        assert reason in caplog.text and "refused connection from 127.0.0.1:" in caplog.text
        assert bystander.get("before") == b"1"  # other connections are unaffected


def test_truncated_frame_then_close(server: StoreServer,
                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    sock = raw(server, handshake=True)
    sock.sendall(HEADER.pack(Op.SET, 10, 100, 0) + b"trunc")
    sock.shutdown(socket.SHUT_WR)
    wait_closed(sock)
    assert server.refused == 1
    assert "middle of a frame" in caplog.text
    assert_store_works(server)


def test_clean_close_between_frames_is_not_refused(server: StoreServer) -> None:
    with make_client(server) as c:
        c.set("k", b"v")
    sock = raw(server, handshake=True)
    sock.shutdown(socket.SHUT_WR)
    wait_closed(sock)
    assert server.refused == 0
    assert_store_works(server)


def test_random_bytes_never_crash_the_server(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shoal.rendezvous")
    frames = st.builds(
        lambda op, klen, vlen, ms, tail: HEADER.pack(op, klen, vlen, ms) + tail,
        st.integers(0, 8), st.integers(0, 1100), st.integers(0, SMALL_MAX + 10),
        st.integers(0, 50), st.binary(max_size=300))
    data = st.one_of(st.binary(max_size=300), frames, st.lists(frames, max_size=3).map(b"".join))

    with StoreServer(SECRET, max_value_bytes=SMALL_MAX, handshake_timeout=0.5) as srv:
        @settings(max_examples=50, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(data)
        def feed(payload: bytes) -> None:
            sock = raw(srv, handshake=True)
            sock.sendall(payload)
            sock.close()

        feed()
        assert_store_works(srv)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- connection life cycle ----------------------------------------------------------------------

def test_client_retries_until_server_is_up() -> None:
    with socket.socket() as probe:  # a port that is free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    got: list[bytes] = []

    def early_client() -> bytes:
        with StoreClient("127.0.0.1", port, SECRET, timeout=2.0, connect_timeout=5.0) as c:
            return c.get("ready", timeout=2.0)

    t = threading.Thread(target=lambda: got.append(early_client()))
    t.start()
    time.sleep(0.3)
    with StoreServer(SECRET, port=port) as srv:
        assert srv.address == ("127.0.0.1", port)
        with make_client(srv) as c:
            c.set("ready", b"yes")
        t.join(timeout=5)
    assert got == [b"yes"]


def test_connect_timeout_names_the_address() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port}.*SHOAL_RENDEZVOUS_ADDR"):
        StoreClient("127.0.0.1", port, SECRET, timeout=1.0, connect_timeout=0.5, rank=3)
    assert time.monotonic() - start < 2.0


def test_close_wakes_a_waiting_get(server: StoreServer, client: StoreClient) -> None:
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            client.get("never", timeout=5.0)
        except RendezvousError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    server.close()
    t.join(timeout=3)
    assert not t.is_alive() and time.monotonic() - start < 2.5
    assert len(errors) == 1 and "shut down" in str(errors[0])
    server.close()  # idempotent


def test_lost_server_is_a_rendezvous_error(server: StoreServer, client: StoreClient) -> None:
    host, port = server.address
    server.close()
    with pytest.raises(RendezvousError, match=rf"{host}:{port}.*(went away|shut down)"):
        client.set("k", b"v")
    with pytest.raises(RendezvousError, match="closed"):
        client.get("k")
