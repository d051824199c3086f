"""Errors that end one collective, not the job; liveness apart from progress; bounded state;
half precision averages that do not overflow; checkpoints that survive a kill."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from harness import INIT_ARGS, run_ranks

# -- clean errors leave shoal usable ---------------------------------------------------------


def _mismatch_then_work(rank: int) -> str:
    import shoal
    n = shoal.size()
    for bad in ("shape", "dtype", "op", "root", "kind"):
        x = np.ones(3 + (rank if bad == "shape" else 0),
                    np.float32 if bad != "dtype" or rank == 0 else np.float64)
        with pytest.raises(shoal.CollectiveMismatchError, match="disagree"):
            if bad == "root":
                shoal.broadcast(x, root_rank=rank % n, name=f"bad.{bad}")
            elif bad == "kind" and rank == 1:
                shoal.broadcast(x, root_rank=0, name=f"bad.{bad}")
            else:
                shoal.allreduce(x, shoal.Min if bad == "op" and rank else shoal.Sum,
                                name=f"bad.{bad}")
        # the next collective works, the same name included
        got = shoal.allreduce(np.arange(5.0) * (rank + 1), shoal.Sum, name=f"bad.{bad}")
        np.testing.assert_allclose(got, np.arange(5.0) * sum(range(1, n + 1)))
    with pytest.raises(ValueError, match="already in flight"):
        h = shoal.allreduce_async(np.ones(2), name="dup")
        shoal.allreduce_async(np.ones(2), name="dup")
    h.wait()
    with pytest.raises(TypeError):
        shoal.allreduce([1, 2, 3])  # not an array
    assert shoal.allreduce(np.array([1.0]), shoal.Sum).tolist() == [float(n)]
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_caught_mismatch_is_followed_by_correct_collectives(n: int) -> None:
    assert run_ranks(_mismatch_then_work, n, timeout=60) == ["ok"] * n


def _different_names(rank: int) -> str:
    import shoal
    start = time.monotonic()
    with pytest.raises(shoal.CollectiveMismatchError, match="cannot match") as info:
        shoal.allreduce(np.ones(4), name=f"only.on.rank{rank}")
    waited = time.monotonic() - start
    assert "only.on.rank0" in str(info.value) and f"only.on.rank{shoal.size() - 1}" in \
        str(info.value)
    assert waited < 10, waited
    # different kinds under different names, too; then the job goes on
    with pytest.raises(shoal.CollectiveMismatchError, match="cannot match"):
        if rank == 0:
            shoal.broadcast(np.ones(2), root_rank=0, name="b")
        else:
            shoal.allgather(np.ones((1, 2)), name="g")
    # diverged unnamed calls: rank 0 made one the others did not; after the error the
    # numbering restarts on every rank, so later unnamed calls match again
    with pytest.raises(shoal.CollectiveMismatchError, match="cannot match"):
        shoal.allreduce(np.ones(2)) if rank == 0 else shoal.allreduce(np.ones(2), name="o")
    return shoal.allreduce(np.array([rank]), shoal.Sum).tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_different_names_raise_on_every_rank(n: int) -> None:
    want = [[sum(range(n))]] * n
    assert run_ranks(_different_names, n, timeout=60, stall_warning_s=1.0) == want


def _busy_rank(rank: int, sleep_s: float) -> list[float]:
    import shoal
    if rank == 1:
        time.sleep(sleep_s)  # a long evaluation or checkpoint: alive, busy
    return shoal.allreduce(np.array([float(rank)]), shoal.Sum).tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_busy_rank_is_waited_for(n: int) -> None:
    # three times the heartbeat timeout, with no hard limit: the job finishes
    got = run_ranks(_busy_rank, n, 3.0, timeout=60, timeout_s=0.0, heartbeat_interval_s=0.2,
                    heartbeat_timeout_s=1.0, stall_warning_s=0.5)
    assert got == [[float(sum(range(n)))]] * n


def _frozen(rank: int, victim: int) -> tuple[str, float]:
    import shoal
    shoal.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        shoal.allreduce(np.ones(8), name="after.freeze")
    except shoal.PeerLostError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.parametrize(("n", "hosts"), [(2, None), (3, ["a", "b", "b"])])
def test_sigstop_is_detected_and_named(n: int, hosts) -> None:
    victim = n - 1
    outcomes = run_ranks(_frozen, n, victim, hosts=hosts, timeout=40, expect_errors=True,
                         timeout_s=0.0, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0,
                         hung=[victim])
    assert outcomes[victim] is None  # it never reported: the harness killed it
    for rank in range(n):
        if rank == victim:
            continue
        status, (text, waited) = outcomes[rank]
        assert status == "ok", outcomes[rank]
        assert f"{victim}" in text and ("heartbeat" in text or "lost" in text), text
        assert waited < 15, waited


def _lost_then_reinit(rank: int) -> list[float]:
    import shoal
    n = shoal.size()
    if rank == n - 1:
        shoal.barrier()
        os._exit(3)  # dies without a word
    shoal.barrier()
    with pytest.raises(shoal.PeerLostError):
        for _ in range(50):
            shoal.allreduce(np.ones(4), name="lost")
            time.sleep(0.05)
    with pytest.raises(shoal.ShoalError):
        shoal.allreduce(np.ones(4), name="after")  # broken until rebuilt
    shoal.shutdown()
    shoal.init(**{**INIT_ARGS, "size": n - 1})  # the survivors, a fresh communicator
    return shoal.allreduce(np.array([1.0 + rank]), shoal.Sum).tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_shutdown_and_init_after_a_lost_peer(n: int) -> None:
    outcomes = run_ranks(_lost_then_reinit, n, timeout=60, expect_errors=True,
                         heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    want = float(sum(range(1, n)))
    assert outcomes[:n - 1] == [("ok", [want])] * (n - 1), outcomes


# -- bounded state ---------------------------------------------------------------------------


def _many_unnamed(rank: int, calls: int) -> tuple[int, int]:
    import shoal
    engine = shoal.communicator().engine
    for i in range(calls):
        x = np.array([i, rank], np.int64)
        got = shoal.allreduce(x, shoal.Sum) if i % 3 else shoal.broadcast(x.copy(), 0)
        assert got[0] == (i * shoal.size() if i % 3 else i)
        if i % 1000 == 0:  # named ones interleaved stay correct across evictions
            assert shoal.allreduce(np.ones(2), shoal.Sum, name="named").tolist() == \
                [shoal.size()] * 2
    return len(engine.names.by_id), len(engine.names.last)


def test_name_cache_stays_bounded_after_10000_unnamed_calls() -> None:
    sizes = run_ranks(_many_unnamed, 2, 10_000, timeout=180, name_cache_size=512)
    assert sizes[0] == sizes[1]
    assert all(0 < s <= 512 for s in sizes[0]), sizes


# -- half precision ----------------------------------------------------------------------------


def _half_average(rank: int) -> dict[str, list[float]]:
    import ml_dtypes

    import shoal
    out = {}
    for dtype in (np.float16, ml_dtypes.bfloat16):
        x = np.full(1000, 40000.0, dtype)  # the sum (80000) does not fit float16
        out[np.dtype(dtype).name] = sorted({float(v) for v in shoal.allreduce(x)})
        out[f"{np.dtype(dtype).name}-in"] = [float(x[0])]
    # partial sums (80000) overflow float16 where the sum does not: on every path, native
    # float16 and float32 sent as fp16, the sum must come out right
    values = [40000.0, -30000.0] if shoal.size() == 2 else \
        [40000.0, 40000.0, -40000.0, -30000.0][:shoal.size()]
    for kind, dtype, codec in (("sum-partial", np.float16, "none"),
                               ("sum-partial-wire", np.float32, "fp16")):
        x = np.full(100, values[rank], dtype)
        got = shoal.allreduce(x, shoal.Sum, name=kind,
                              compression=shoal.core.compression.Compression.by_name(codec))
        out[kind] = [*sorted({float(v) for v in got}), sum(values)]
    x = np.full(999, 40000.0, np.float32)
    out["fp16-wire"] = sorted({float(v) for v in shoal.allreduce(
        x, compression=shoal.core.compression.Compression.fp16)})
    return out


@pytest.mark.parametrize(("algorithm", "n", "hosts"), [
    ("shm", 2, None), ("ring", 2, None), ("ring", 3, None),
    ("hierarchical", 4, ["a", "a", "b", "b"]), ("auto", 2, ["a", "b"])])
def test_half_average_of_40000_is_40000(algorithm: str, n: int, hosts) -> None:
    pytest.importorskip("ml_dtypes")
    got = run_ranks(_half_average, n, hosts=hosts, timeout=60, allreduce_algorithm=algorithm)
    for per_rank in got:
        assert per_rank["float16"] == [40000.0]
        assert per_rank["bfloat16"] == per_rank["bfloat16-in"]  # 39936: bfloat16's 40000
        assert per_rank["fp16-wire"] == [40000.0]
        for kind in ("sum-partial", "sum-partial-wire"):
            got, want = per_rank[kind][:-1], per_rank[kind][-1]
            assert got == [want], (kind, got, want)


# -- checkpoints -------------------------------------------------------------------------------


class _SlowToPickle:
    """Stalls the pickler halfway through a checkpoint, so it can be killed mid-write."""

    def __reduce__(self):
        time.sleep(60)
        return (dict, ())


def _write_checkpoints(path: str) -> None:
    import torch

    from apps.efficientnet.runtime.checkpoint import save_checkpoint
    save_checkpoint(path, {"step": 1, "weights": torch.arange(1000.0)})
    print("first", flush=True)
    save_checkpoint(path, {"step": 2, "weights": torch.zeros(1 << 20), "x": _SlowToPickle()})


def test_kill_during_checkpoint_write_keeps_previous(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from apps.efficientnet.runtime.checkpoint import load_checkpoint
    path = tmp_path / "ckpt.pt"
    proc = mp.get_context("spawn").Process(target=_write_checkpoints, args=(str(path),))
    proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the second write has begun: its temporary file is open
        tmps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        if path.exists() and tmps:
            time.sleep(0.5)  # well inside it (the pickler stalls in _SlowToPickle)
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the second checkpoint write never started")
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    state = load_checkpoint(path)
    assert state["step"] == 1
    torch.testing.assert_close(state["weights"], torch.arange(1000.0))
