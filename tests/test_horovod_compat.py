"""Horovod's PyTorch semantics on shoal.torch: process sets, join, reduce-scatter and grouped
ops, autograd rules, the compressor interface, sparse gradients (shoal's own tests of what
Horovod's suite checks; CI cannot fetch that suite)."""

from __future__ import annotations

import warnings
import zlib

import pytest

torch = pytest.importorskip("torch")
from harness import INIT_ARGS, run_ranks  # noqa: E402


def _rand(tag: str, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return torch.randn(shape, generator=g)


def _process_sets(rank: int) -> str:
    import shoal.torch as hvd
    n = hvd.size()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    even_set, odd_set = hvd.add_process_set(evens), hvd.add_process_set(odds)
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == rank
    mine, members = (even_set, evens) if rank % 2 == 0 else (odd_set, odds)
    assert mine.included() and mine.size() == len(members)
    assert mine.rank() == members.index(rank)
    other = odd_set if mine is even_set else even_set
    assert not other.included() and other.rank() is None
    with pytest.raises(ValueError, match="exists already"):
        hvd.add_process_set(evens)
    # collectives of disjoint sets at once; broadcast roots are global ranks
    h = hvd.allreduce_async(_rand("ps", rank, (7,)), op=hvd.Sum, name="x", process_set=mine)
    got = hvd.broadcast(torch.full((3,), float(rank)), root_rank=members[-1],
                        process_set=mine)
    assert got.tolist() == [float(members[-1])] * 3
    want = sum(_rand("ps", r, (7,)) for r in members)
    torch.testing.assert_close(hvd.synchronize(h), want)
    gathered = hvd.allgather(torch.tensor([[rank]]), process_set=mine)
    assert gathered.flatten().tolist() == members
    assert hvd.broadcast_object({"r": rank}, root_rank=members[0], process_set=mine) == \
        {"r": members[0]}
    hvd.barrier(process_set=mine)
    with pytest.raises(RuntimeError, match="not a member"):
        hvd.allreduce(torch.ones(2), process_set=other)
    assert hvd.remove_process_set(odd_set) and hvd.remove_process_set(even_set)
    assert not hvd.remove_process_set(even_set) and not hvd.remove_process_set(
        hvd.global_process_set)
    # static sets, given at init
    hvd.shutdown()
    static = hvd.ProcessSet(range(1, n))
    hvd.init(**INIT_ARGS, process_sets=[static])
    assert static.process_set_id == 1 and static.included() == (rank > 0)
    if static.included():
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=static).item()
        assert got == n - 1
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_process_sets(n: int) -> None:
    assert run_ranks(_process_sets, n, timeout=90) == ["ok"] * n


def _join(rank: int) -> str:
    import shoal.torch as hvd
    n = hvd.size()
    for first in range(n):
        a = torch.arange(-7, 8, dtype=torch.int32).reshape(3, 5) * (rank + 1)
        b = _rand("j", rank, (4,))
        if rank == first:
            last = hvd.join()
        else:
            got_a = hvd.allreduce(a, name="a")  # average, the joined rank contributing zeros
            got_b = hvd.allreduce(b, op=hvd.Max, name="b")  # its neutral: the minimum
            with pytest.raises(RuntimeError, match="joined"):
                hvd.allgather(torch.ones(1, 2), name="g")
            last = hvd.join()
            total = sum(torch.arange(-7, 8, dtype=torch.int64).reshape(3, 5) * (r + 1)
                        for r in range(n) if r != first)
            assert torch.equal(got_a, torch.trunc(total / n).to(torch.int32))  # by the full n
            want_b = torch.stack([_rand("j", r, (4,)) for r in range(n) if r != first]).amax(0)
            torch.testing.assert_close(got_b, want_b)
        assert last != first or n == 1
        assert hvd.allgather_object(last) == [last] * n
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # the job goes on
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_join_with_uneven_work(n: int) -> None:
    assert run_ranks(_join, n, timeout=90) == ["ok"] * n


def _reductions_and_grads(rank: int) -> str:
    import shoal.torch as hvd
    n = hvd.size()
    x = _rand("rs", rank, (2 * n + 1, 3))
    every = torch.stack([_rand("rs", r, (2 * n + 1, 3)) for r in range(n)])
    base, extra = divmod(2 * n + 1, n)
    start = rank * base + min(rank, extra)
    mine = slice(start, start + base + (rank < extra))
    got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    torch.testing.assert_close(got, every.sum(0)[mine])
    grouped = hvd.grouped_reducescatter([x, x[:, :1]], op=hvd.Average)
    torch.testing.assert_close(grouped[1], every.mean(0)[mine][:, :1])
    with pytest.raises((RuntimeError, ValueError)):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(RuntimeError):  # NotImplementedError is a RuntimeError
        hvd.reducescatter(x, op=hvd.Adasum)
    parts = hvd.grouped_allgather([torch.full((rank + 1, 2), float(rank)), torch.ones(1)])
    assert parts[0].shape == (n * (n + 1) // 2, 2) and parts[1].shape == (n,)
    assert hvd.alltoall(torch.arange(float(n))).tolist() == [float(rank)] * n
    # gradients, with Horovod's rules
    t = x.clone().requires_grad_()
    hvd.allreduce(t, op=hvd.Sum).sum().backward()
    torch.testing.assert_close(t.grad, torch.full_like(x, float(n)))
    t = torch.ones(rank + 1, 2, requires_grad=True)
    (hvd.allgather(t) * 2).sum().backward()
    torch.testing.assert_close(t.grad, torch.full((rank + 1, 2), 2.0))
    t = torch.ones(3, requires_grad=True)
    hvd.broadcast(t, root_rank=0).sum().backward()
    assert t.grad.tolist() == ([1.0] * 3 if rank == 0 else [0.0] * 3)
    t = torch.ones(n * 2, requires_grad=True)
    out, _ = hvd.alltoall(t, splits=[2] * n)
    (out * 3).sum().backward()
    assert t.grad.tolist() == [3.0] * (2 * n)
    t = torch.ones(n, 2, requires_grad=True)
    hvd.reducescatter(t, op=hvd.Sum).sum().backward()
    torch.testing.assert_close(t.grad, torch.full((n, 2), float(n)))
    outs = hvd.grouped_allreduce([t, t * 2], op=hvd.Average)
    assert len(outs) == 2 and outs[1].requires_grad
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_reducescatter_grouped_and_autograd(n: int) -> None:
    assert run_ranks(_reductions_and_grads, n, timeout=90) == ["ok"] * n


class _Halve:
    """A user's compressor: sends values halved, restores them."""

    @staticmethod
    def compress(tensor):
        return tensor / 2, "halved"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "halved"
        return tensor * 2


def _compression_sparse_optimizer(rank: int) -> str:
    import shoal.torch as hvd
    n = hvd.size()
    c, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == \
        torch.float64
    i, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.int32))
    assert i.dtype == torch.int32
    x = _rand("c", rank, (5,))
    want = torch.stack([_rand("c", r, (5,)) for r in range(n)]).mean(0)
    torch.testing.assert_close(hvd.allreduce(x, compression=_Halve()), want)
    torch.testing.assert_close(hvd.allreduce(x, compression=hvd.Compression.fp16), want,
                               rtol=1e-2, atol=1e-2)
    # sparse: allgather of indices and values equals the dense allreduce
    dense = torch.zeros(6, 2)
    dense[rank % 6] = float(rank + 1)
    got = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Average)()
    torch.testing.assert_close(got.to_dense(), hvd.allreduce(dense, name="dn"))
    # an nn.Embedding(sparse=True) trains; both ways agree with the dense reference
    results = []
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense,
                                       compression=_Halve())
        emb(torch.tensor([rank, rank + 1, 9])).sum().backward()
        opt.step()
        results.append(emb.weight.detach().clone())
    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 3)
    counts = torch.zeros(10)
    for r in range(n):
        counts[[r, r + 1, 9]] += 1
    torch.testing.assert_close(results[0], ref.weight.detach() - counts[:, None] / n)
    torch.testing.assert_close(results[1], results[0])
    # a process set: members reduce, the others step on their own gradients
    evens = hvd.add_process_set(list(range(0, n, 2)))
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   process_set=evens)
    model(torch.full((1, 2), float(rank + 1))).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in seen)
    members = list(range(0, n, 2))
    want = -sum(r + 1.0 for r in members) / len(members) if rank in members else -(rank + 1.0)
    assert model.weight.flatten().tolist() == [want, want]
    assert hvd.remove_process_set(evens)
    assert not any([hvd.mpi_built(), hvd.ccl_built(), hvd.ddl_built(), hvd.rocm_built(),
                    hvd.mpi_enabled()])
    assert hvd.gloo_built() and hvd.gloo_enabled()  # shoal plays gloo's part
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_compression_sparse_and_process_set_optimizer(n: int) -> None:
    assert run_ranks(_compression_sparse_optimizer, n, timeout=90) == ["ok"] * n


def test_duplicate_parameter_names_are_refused_before_init() -> None:
    import shoal.torch as hvd
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="appears twice"):
        hvd.DistributedOptimizer(opt, named_parameters=[*a.named_parameters(),
                                                        *b.named_parameters()])
