"""What a valid program may do and what a bad argument may not break (issue 30, items 2, 3
and 7): a rank holding a pending request while it computes is not stuck; a bad argument
raises on its rank and consumes nothing; long-lived collectives are named by the
communicator, not by process-wide counters."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harness import run_ranks


def _held_while_computing(rank: int) -> list[float]:
    import shoal
    a, b = np.full(5, rank + 1.0), np.full(3, 10.0 * (rank + 1))
    if rank == 0:
        handle = shoal.allreduce_async(a, name="A")
        time.sleep(3.0)  # computing, past the stall warning, holding A
        rb = shoal.allreduce(b, name="B")
        ra = handle.wait()
    else:
        rb = shoal.allreduce(b, name="B")
        ra = shoal.allreduce(a, name="A")
    return [float(ra[0]), float(rb[0])]


def test_async_request_held_while_computing_is_not_a_mismatch() -> None:
    out = run_ranks(_held_while_computing, 2, stall_warning_s=1.0, timeout=60)
    assert out == [[1.5, 15.0], [1.5, 15.0]]


def _joined_then_diverged(rank: int) -> tuple[str, str]:
    import shoal
    if rank == 0:
        shoal.join()
        return ("joined", "")
    try:  # ranks 1 and 2 diverge while rank 0 has joined: an error, not a hang
        shoal.allreduce(np.ones(4), name=f"only-on-{rank}")
    except shoal.CollectiveMismatchError as exc:
        shoal.join()
        return ("mismatch", str(exc))
    return ("no error", "")


def test_mismatch_among_ranks_not_joined_is_reported() -> None:
    out = run_ranks(_joined_then_diverged, 3, stall_warning_s=1.0, timeout=60)
    assert out[0][0] == "joined"
    for status, text in out[1:]:
        assert status == "mismatch", out
        assert "only-on-1" in text and "only-on-2" in text and "not joined" in text


def _bad_argument(rank: int, kind: str) -> list[float]:
    import shoal
    x = np.arange(6, dtype=np.float32) + rank
    if rank == 1:  # a bad call, caught by the program: it must consume nothing
        with pytest.raises((ValueError, TypeError)) as info:
            if kind == "allreduce":
                shoal.allreduce(np.ones(3, dtype=object))
            elif kind == "broadcast":
                shoal.broadcast(x.copy(), root_rank=7)
            elif kind == "allgather":
                shoal.allgather(np.float32(1.0))
            elif kind == "alltoall":
                shoal.alltoall(np.ones(5, np.float32))
            elif kind == "reducescatter":
                shoal.reducescatter(x, splits=[1, 1])
        assert "rank 1" in str(info.value)
    # then every rank's unnamed calls still pair up, and the results are right
    got = [float(shoal.allreduce(x, op=shoal.Sum)[0])]
    got.append(float(shoal.broadcast(x.copy(), root_rank=0)[1]))
    got.append(float(shoal.allgather(x[:2])[-1]))
    return got


@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "allgather", "alltoall",
                                  "reducescatter"])
def test_bad_argument_raises_on_its_rank_and_consumes_nothing(kind: str) -> None:
    # a stall would take stall_shutdown_s; the bound below is far shorter
    out = run_ranks(_bad_argument, 2, kind, stall_warning_s=2.0, stall_shutdown_s=8.0,
                    timeout=40)
    assert out == [[1.0, 1.0, 2.0]] * 2


def _uneven_layers(rank: int) -> list[float]:
    import torch

    import shoal.torch as hvd
    hvd.init()
    if rank == 0:  # an extra model only rank 0 builds (an evaluation copy), never trained
        hvd.SyncBatchNorm(4)
        extra = torch.nn.Linear(3, 3)
        hvd.ShardedOptimizer(torch.optim.SGD(extra.parameters(), lr=0.1),
                             named_parameters=extra.named_parameters())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), hvd.SyncBatchNorm(4))
    opt = hvd.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    return [float(model[1].running_mean.sum()), float(model[0].weight.sum())]


def test_names_come_from_the_communicator_not_process_counters() -> None:
    pytest.importorskip("torch")
    out = run_ranks(_uneven_layers, 2, stall_warning_s=2.0, stall_shutdown_s=10.0,
                    timeout=60)
    assert out[0] == pytest.approx(out[1], abs=1e-6)
