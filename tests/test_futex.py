"""Futex sleeping on shared memory: a waiter returns when the word differs, at its timeout, and
when another process wakes it; a rank of one host that waits long for a peer sleeps instead of
burning its core."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from harness import run_ranks
from shoal.core.transport import futex

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="futexes are Linux-only")


def _word() -> tuple[mmap.mmap, np.ndarray, int]:
    shared = mmap.mmap(-1, 4096)  # MAP_SHARED: a forked child sees the same page
    words = np.ndarray((512,), np.int64, buffer=shared)
    return shared, words, words.ctypes.data


def _returns(*args: object, within: float = 10) -> bool:
    """Whether ``futex.wait(*args)`` returns within ``within`` s (its timeouts here are 60 s)."""
    thread = threading.Thread(target=futex.wait, args=args, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive()


def test_wait_returns_at_once_when_the_word_differs() -> None:
    _shared, words, address = _word()
    words[0] = 7
    assert _returns(address, 6, 60.0)


def test_wait_compares_the_low_half_of_a_64_bit_word() -> None:
    _shared, words, address = _word()
    words[0] = (5 << 32) | 3
    assert _returns(address, (5 << 32) | 4, 60.0)  # differs in the low half
    assert not _returns(address, 3, 60.0, within=1)  # the same low half: it sleeps
    futex.wake(address)


def test_wait_ends_at_its_timeout() -> None:
    _shared, _words, address = _word()
    assert _returns(address, 0, 0.05)


def _sleeper(words: np.ndarray, address: int) -> None:
    words[1] = 1
    while words[0] == 0:
        futex.wait(address, 0, 60.0)
    words[2] = 1


def test_wake_reaches_a_sleeping_process() -> None:
    _shared, words, address = _word()
    child = multiprocessing.get_context("fork").Process(target=_sleeper, args=(words, address))
    child.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until the child sleeps in the kernel
            with open(f"/proc/{child.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if words[1] == 1 and state == "S":
                break
            time.sleep(0.01)
        words[0] = 1
        futex.wake(address)
        child.join(30)  # unwoken, the child would sleep 60 s
        assert child.exitcode == 0 and words[2] == 1
    finally:
        if child.is_alive():
            child.kill()


def _late_peer(rank: int) -> float:
    import shoal
    x = np.ones(1000, np.float32)
    shoal.allreduce(x, name="warm")
    start = time.process_time()
    for _ in range(40):  # rank 0 waits about 20 ms for rank 1, forty times
        if rank == 1:
            time.sleep(0.02)
        shoal.allreduce(x, name="late")
    return time.process_time() - start


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="more ranks than cores: waiters yield")
def test_a_rank_waiting_for_a_late_peer_sleeps() -> None:
    cpu = run_ranks(_late_peer, 2, timeout=60)
    # polling or yielding through each wait would keep rank 0's core busy for most of 0.8 s
    assert cpu[0] < 0.15, f"rank 0 used {cpu[0]:.2f} s of CPU waiting 0.8 s for its peer"
