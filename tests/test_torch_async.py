"""Backend "shoal" honours ``async_op`` and the group timeout on every collective (issue 31,
item 1): two groups whose async gather-type collectives are issued in opposite orders on the
ranks both complete (as with gloo), with the right values; a collective that an absent peer
never joins raises torch's ``DistBackendError`` saying "Timed out" once the group's timeout
has passed, whatever its kind."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


def _init(rank: int, timeout_s: float) -> None:
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    import shoal
    import shoal.torch.backend as b
    torch.set_num_threads(1)
    b.register()
    path = f"{tempfile.gettempdir()}/shoal-{shoal.communicator().job_id}-torchstore"
    dist.init_process_group("shoal", rank=rank, world_size=shoal.size(),
                            store=dist.FileStore(path, shoal.size()),
                            timeout=timedelta(seconds=timeout_s))


def _issue(group, rank: int, n: int, tag: int) -> list:
    """Every gather-type collective on ``group``, async; (work, check) pairs."""
    import torch.distributed as dist
    out = []
    mine = torch.arange(3.0) + 10 * rank + 100 * tag
    gathered = [torch.zeros(3) for _ in range(n)]
    out.append((dist.all_gather(gathered, mine, group=group, async_op=True),
                lambda g=gathered: all(torch.equal(g[r], torch.arange(3.0) + 10 * r + 100 * tag)
                                       for r in range(n))))
    flat = torch.zeros(3 * n)
    out.append((dist.all_gather_into_tensor(flat, mine, group=group, async_op=True),
                lambda f=flat: torch.equal(f, torch.cat([torch.arange(3.0) + 10 * r + 100 * tag
                                                         for r in range(n)]))))
    a2a_in = torch.arange(2.0 * n) + 1000 * rank + tag
    a2a_out = torch.zeros(2 * n)
    out.append((dist.all_to_all_single(a2a_out, a2a_in, group=group, async_op=True),
                lambda o=a2a_out: torch.equal(o, torch.cat([
                    torch.arange(2.0 * rank, 2.0 * rank + 2) + 1000 * r + tag
                    for r in range(n)]))))
    rs_in = torch.arange(2.0 * n) * (rank + 1) + tag
    rs_out = torch.zeros(2)
    total = sum(torch.arange(2.0 * n) * (r + 1) + tag for r in range(n))
    out.append((dist.reduce_scatter_tensor(rs_out, rs_in, group=group, async_op=True),
                lambda o=rs_out, t=total: torch.equal(o, t[2 * rank:2 * rank + 2])))
    outs = [torch.zeros(1) for _ in range(n)]
    out.append((dist.all_to_all(outs, [torch.tensor([float(rank * n + r + tag)])
                                       for r in range(n)], group=group, async_op=True),
                lambda o=outs: all(o[r].item() == r * n + rank + tag for r in range(n))))
    gat = [torch.zeros(2) for _ in range(n)] if rank == 0 else None
    out.append((dist.gather(torch.full((2,), float(rank + tag)), gat, dst=0, group=group,
                            async_op=True),
                lambda g=gat: g is None or all(g[r].tolist() == [r + tag] * 2
                                               for r in range(n))))
    sc = torch.zeros(2)
    src = [torch.full((2,), float(r * 7 + tag)) for r in range(n)] if rank == 0 else None
    out.append((dist.scatter(sc, src, src=0, group=group, async_op=True),
                lambda s=sc: s.tolist() == [rank * 7 + tag] * 2))
    return out


def _opposite_orders(rank: int) -> list[bool]:
    import torch.distributed as dist

    import shoal
    _init(rank, 30.0)
    n = shoal.size()
    groups = [dist.new_group(list(range(n))), dist.new_group(list(range(n)))]
    order = groups if rank % 2 == 0 else groups[::-1]
    works = []
    for g in order:
        works += _issue(g, rank, n, tag=groups.index(g))
    for work, _ in works:
        work.wait()
    checks = [check() for _, check in works]
    dist.destroy_process_group()
    return checks


@pytest.mark.parametrize("n", [2, 3])
def test_async_gathers_of_two_groups_in_opposite_orders(n: int) -> None:
    for checks in run_ranks(_opposite_orders, n, timeout=120):
        assert checks and all(checks), checks


_KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
          "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter",
          "barrier"]


def _call(kind: str, n: int) -> None:
    import torch.distributed as dist
    t = torch.ones(2 * n)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, src=0),
        "reduce": lambda: dist.reduce(t, dst=0),
        "all_gather": lambda: dist.all_gather([torch.zeros(2 * n) for _ in range(n)], t),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(2 * n * n),
                                                                      t),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros(2), t),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(2 * n), t),
        "all_to_all": lambda: dist.all_to_all([torch.zeros(1) for _ in range(n)],
                                              [torch.ones(1) for _ in range(n)]),
        "gather": lambda: dist.gather(t, [torch.zeros(2 * n) for _ in range(n)], dst=0),
        "scatter": lambda: dist.scatter(torch.zeros(2), [torch.ones(2)] * n, src=0),
        "barrier": lambda: dist.barrier(),
    }
    calls[kind]()


def _absent_peer(rank: int) -> dict[str, str]:
    import torch.distributed as dist

    import shoal
    _init(rank, 1.5)
    seen: dict[str, str] = {}
    if rank == 0:  # rank 1 is alive (heartbeats go on) but never joins these
        for kind in _KINDS:
            try:
                _call(kind, shoal.size())
                seen[kind] = "returned"
            except dist.DistBackendError as exc:
                seen[kind] = "timed out" if " Timed out " in f" {exc} " else str(exc)
            except Exception as exc:
                seen[kind] = f"{type(exc).__name__}: {exc}"
    shoal.barrier()  # on shoal's own communicator: rank 1 waits here meanwhile
    return seen


def test_group_timeout_on_every_kind_with_an_absent_peer() -> None:
    seen, _ = run_ranks(_absent_peer, 2, timeout=120, timeout_s=60.0)
    assert seen == {kind: "timed out" for kind in _KINDS}, seen


def _inputs_kept(rank: int) -> list[bool]:
    import torch.distributed as dist
    _init(rank, 30.0)
    checks = []
    x = torch.arange(4.0) + rank
    kept = x.clone()
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, x)  # the real reduce-scatter reads the input in place
    checks += [torch.equal(x, kept), out.tolist() == [1.0 + 2 * rank * 2, 3.0 + 2 * rank * 2]]
    y = torch.tensor([1, 2, 4, 8]) << rank
    kept = y.clone()
    out = torch.zeros(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, y, op=dist.ReduceOp.BOR)  # a full reduction, on a copy
    want = (torch.tensor([1, 2, 4, 8]) | (torch.tensor([1, 2, 4, 8]) << 1))[2 * rank:2 * rank + 2]
    checks += [torch.equal(y, kept), torch.equal(out, want)]
    dist.destroy_process_group()
    return checks


def test_reduce_scatter_tensor_leaves_its_input_alone() -> None:
    for checks in run_ranks(_inputs_kept, 2, timeout=60):
        assert checks == [True] * 4, checks
