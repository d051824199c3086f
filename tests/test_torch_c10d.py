"""What c10d asks of a group's backend (issue 31, item 2), checked against gloo's answers in
the same processes: ``_get_backend``, sequence numbers, the group store, the device types,
``Work.result()``, ``set_timeout``, ``abort``, ``split_group``, and the checks that
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks for."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


def _init(rank: int, **kwargs) -> None:
    import tempfile

    import torch.distributed as dist

    import shoal
    import shoal.torch.backend as b
    torch.set_num_threads(1)
    b.register()
    path = f"{tempfile.gettempdir()}/shoal-{shoal.communicator().job_id}-torchstore"
    dist.init_process_group("shoal", rank=rank, world_size=shoal.size(),
                            store=dist.FileStore(path, shoal.size()), **kwargs)


def _contracts(rank: int) -> dict:
    import torch.distributed as dist
    _init(rank)
    gloo = dist.new_group(backend="gloo")
    shoal_pg = dist.group.WORLD
    cpu = torch.device("cpu")
    out: dict = {}
    for name, pg in (("shoal", shoal_pg), ("gloo", gloo)):
        backend = pg._get_backend(cpu)
        start = pg._get_sequence_number_for_group()
        t = torch.arange(4.0) + rank
        work = dist.all_reduce(t, group=pg, async_op=True)
        work.wait()
        gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t, group=pg)
        dist.broadcast(t, src=0, group=pg)
        out[name] = {
            "backend_has_allreduce": callable(getattr(backend, "allreduce", None)),
            "seq": pg._get_sequence_number_for_group() - start,
            "result": [x.tolist() for x in work.result()],
            "success": work.is_success(), "exception": work.exception(),
            "store": pg.get_group_store() is not None,
            "devices": sorted(str(d) for d in pg._device_types),
            "splitting": bool(backend.supports_splitting),
        }
        try:  # no accelerator here: torch refuses to split gloo and shoal groups alike
            dist.split_group(pg, [[0]])
            out[name]["split_group"] = "split"
        except RuntimeError as exc:
            out[name]["split_group"] = str(exc)
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future_result()
    out["future_result"] = int(fut.wait())
    child = shoal_pg.split_group([1])  # the method torch's split_group calls, members only
    if child is not None:
        x = torch.ones(3)
        dist.all_reduce(x, group=child)
        out["child"] = (child.size(), x.tolist())
    else:
        out["child"] = None
    dist.destroy_process_group()
    return out


def test_backend_contracts_as_gloo_answers() -> None:
    for rank, out in enumerate(run_ranks(_contracts, 2, timeout=120)):
        mine, gloo = out["shoal"], out["gloo"]
        assert mine["backend_has_allreduce"] and gloo["backend_has_allreduce"]
        assert mine["seq"] == gloo["seq"] == 3
        assert mine["result"] == gloo["result"]
        assert mine["success"] and mine["exception"] is None
        assert mine["store"] and gloo["store"]
        assert set(mine["devices"]) == set(gloo["devices"])
        assert mine["splitting"] == gloo["splitting"]
        assert mine["split_group"] == gloo["split_group"]
        assert out["future_result"] == 0
        assert out["child"] == ((1, [1.0, 1.0, 1.0]) if rank == 1 else None)


def _timeout_and_abort(rank: int) -> list[str]:
    from datetime import timedelta

    import torch.distributed as dist

    import shoal
    _init(rank)
    seen = []
    pg = dist.group.WORLD
    pg.set_timeout(timedelta(seconds=1))
    if rank == 0:  # rank 1 lives but does not join: the new timeout bounds the wait
        try:
            dist.all_reduce(torch.ones(2))
            seen.append("returned")
        except dist.DistBackendError as exc:
            seen.append("timed out" if "Timed out" in str(exc) else str(exc))
    shoal.barrier()
    if rank == 1:  # a pending work on rank 1 fails once rank 1 aborts its group
        work = dist.broadcast(torch.ones(2), src=0, async_op=True)
        dist.distributed_c10d._abort_process_group()
        try:
            work.wait()
            seen.append("returned")
        except Exception as exc:
            seen.append(type(exc).__name__)
    return seen


def test_set_timeout_and_abort() -> None:
    seen = run_ranks(_timeout_and_abort, 2, timeout=90, timeout_s=60.0)
    assert seen[0] == ["timed out"], seen
    assert seen[1] and seen[1][0] != "returned", seen


def _detail(rank: int) -> str:
    import os

    import torch.distributed as dist
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    _init(rank)
    try:  # what the DETAIL wrapper checks: ranks that disagree on a shape raise, not hang
        dist.all_reduce(torch.ones(3 + rank))
        return "returned"
    except Exception as exc:
        return type(exc).__name__


def test_debug_detail_mismatch_raises_on_every_rank() -> None:
    assert run_ranks(_detail, 2, timeout=90) == ["CollectiveMismatchError"] * 2
