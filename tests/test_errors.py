"""Bad input is a clear, typed error on every rank: never a hang, never a wrong answer."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from harness import run_ranks

LAYOUTS = {"1host-3": dict(n=3), "2x2": dict(n=4, hosts=["a", "a", "b", "b"]),
           "ring-3": dict(n=3, allreduce_algorithm="ring")}


def _mismatch(rank: int, kind: str) -> None:
    import shoal
    odd = rank == shoal.size() - 1  # only the last rank differs (on the other node in 2x2)
    shoal.allreduce(np.ones(5, np.float32), name="warm-up")
    if kind == "shape":
        shoal.allreduce(np.ones(6 if odd else 5, np.float32), name="grad")
    elif kind == "dtype":
        shoal.allreduce(np.ones(5, np.float64 if odd else np.float32), name="grad")
    elif kind == "op":
        shoal.allreduce(np.ones(5, np.float32), op=shoal.Max if odd else shoal.Sum, name="grad")
    elif kind == "collective":
        if odd:
            shoal.broadcast(np.ones(5, np.float32), 0, name="grad")
        else:
            shoal.allreduce(np.ones(5, np.float32), name="grad")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "collective"])
def test_mismatch_raises_on_every_rank(layout: str, kind: str) -> None:
    spec = dict(LAYOUTS[layout])
    n = spec.pop("n")
    outcomes = run_ranks(_mismatch, n, kind, expect_errors=True, timeout=40, **spec)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} hung"
        status, (etype, text) = outcome
        assert status == "err" and etype == "CollectiveMismatchError", (rank, outcome)
        assert f"ranks [{n - 1}]" in text, text  # names the odd rank out
        assert "grad" in text


def _lonely(rank: int) -> list[str]:
    """Rank 0 submits a tensor rank 1 never does: a warning names it and rank 1."""
    import logging

    import shoal
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("shoal.engine").addHandler(Collect())
    if rank == 0:
        lonely = shoal.allreduce_async(np.ones(3), name="lonely")
    shoal.allreduce(np.ones(3), name="common")
    if rank == 0:
        with pytest.raises(TimeoutError):
            lonely.wait(timeout=2.5)
    else:
        time.sleep(3.0)  # computing, nothing submitted: waited for, not a mismatch
    shoal.barrier()  # rank 1 stays until rank 0 has seen the warning
    return seen


def test_stalled_tensor_is_reported_by_name() -> None:
    seen, _ = run_ranks(_lonely, 2, stall_warning_s=1.0, timeout=60)
    assert any("'lonely'" in m and "ranks [1]" in m for m in seen), seen


def _diverge(rank: int) -> str:
    import shoal
    shoal.allreduce(np.ones(4), name=f"only-on-{rank}")
    return "completed"


def test_stall_shutdown_fails_instead_of_hanging() -> None:
    outcomes = run_ranks(_diverge, 3, expect_errors=True, timeout=60, stall_warning_s=5.0,
                         stall_shutdown_s=2.0)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} hung"
        status, (etype, _text) = outcome
        assert status == "err" and etype in ("ShoalTimeoutError", "PeerLostError"), outcome
    texts = " ".join(o[1][1] for o in outcomes)
    assert "stalled" in texts and "only-on-" in texts


def _bad_input(rank: int) -> str:
    import shoal
    with pytest.raises(ValueError, match=r"rank \d+: allreduce tensor 'strided' is not "
                                         r"C-contiguous.*ascontiguousarray"):
        shoal.allreduce(np.ones((4, 4), np.float32)[:, ::2], name="strided")
    with pytest.raises(TypeError, match="complex64, which shoal cannot reduce"):
        shoal.allreduce(np.ones(3, np.complex64), name="cplx")
    with pytest.raises(TypeError, match=r"must be a numpy\.ndarray"):
        shoal.allreduce([1.0, 2.0], name="list")
    with pytest.raises(TypeError, match=r"bool.*Sum"):
        shoal.allreduce(np.ones(3, bool), op=shoal.Sum, name="flags")
    with pytest.raises(ValueError, match="root_rank 7"):
        shoal.broadcast(np.ones(3), 7)
    with pytest.raises(ValueError, match="splits"):
        shoal.alltoall(np.ones(4), splits=[1, 1], name="a2a")
    # the job is still healthy: the checks ran before any communication
    return str(shoal.allreduce(np.full(2, rank, np.float64), op=shoal.Sum).tolist())


def test_bad_input_is_a_clear_local_error() -> None:
    assert run_ranks(_bad_input, 2) == ["[1.0, 1.0]"] * 2


def _wrong_secret(rank: int) -> str:
    import shoal
    shoal.allreduce(np.ones(2))
    return "joined"


def test_wrong_secret_is_refused() -> None:
    outcomes = run_ranks(_wrong_secret, 2, expect_errors=True, timeout=40, start_timeout_s=4,
                         rank_settings={1: {"secret": "00" * 16}})
    status, (etype, text) = outcomes[1]
    assert status == "err" and etype == "AuthenticationError", outcomes[1]
    assert "secret" in text
    status, (etype, _text) = outcomes[0]
    assert status == "err" and etype == "RendezvousError", outcomes[0]  # waited, then gave up


def _dies(rank: int, nbytes: int) -> str:
    import shoal
    x = np.ones(nbytes // 4, np.float32)
    shoal.allreduce(x, name="warm-up")
    if rank == shoal.size() - 1:
        os._exit(17)  # a crash: no shutdown, no goodbye
    try:
        shoal.allreduce(x, name="after-death")
    except shoal.PeerLostError as exc:
        return f"lost {exc.rank}"
    return "no error"


@pytest.mark.parametrize("layout", ["1host-3", "2x2", "ring-3"])
def test_dead_peer_is_peer_lost_error(layout: str) -> None:
    spec = dict(LAYOUTS[layout])
    n = spec.pop("n")
    outcomes = run_ranks(_dies, n, 1 << 20, expect_errors=True, timeout=40, timeout_s=5, **spec)
    for rank in range(n - 1):
        assert outcomes[rank] is not None, f"rank {rank} hung"
        status, value = outcomes[rank]
        assert status == "ok" and value.startswith("lost"), (rank, outcomes[rank])
