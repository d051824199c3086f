"""The device stage (shoal.torch.device) on CPU machines.

- every helper on CPU tensors: the device, dtype and pinning of what it creates;
- the CPU stand-in (``SHOAL_DEVICE_STAGE_CPU``): separate host buffers, the copy to the host
  run by the engine thread (never the submitting thread), a bucket's buffer reused;
- SMDDP's intra-node orchestration with gloo standing in for NCCL, at 2 emulated hosts x 2
  ranks, against numpy (float32, float16, odd lengths, empty);
- device choice (``local_device``), and the CUDA-only parts, which skip without a GPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from harness import run_ranks
from reference import assert_matches, rank_input, reference
from shoal.torch import tensors
from shoal.torch.device import local_device, pinned_empty, placement, staging
from shoal.torch.device.streams import HostLane, lane_for

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (scripts/gpu-check.sh "
                                "runs these on one)")


@pytest.fixture
def stand_in():
    tensors.set_stand_in(True)
    yield
    tensors.set_stand_in(None)


def test_pinned_buffers_are_host_tensors_pinned_where_cuda_is() -> None:
    buf = pinned_empty((3, 5), torch.float16)
    assert buf.device.type == "cpu" and buf.dtype == torch.float16 and buf.shape == (3, 5)
    assert buf.is_pinned() == CUDA


def test_stand_in_stages_through_a_separate_buffer_and_defers_the_copy(stand_in) -> None:
    t = torch.arange(10, dtype=torch.float32)
    s = tensors.stage(t)
    assert isinstance(s, staging.DeviceStaged)
    assert s.host.data_ptr() != t.data_ptr() and s.host.device.type == "cpu"
    assert s.host.dtype == t.dtype and s.host.shape == t.shape
    assert s.host.is_pinned() == CUDA
    assert isinstance(s.lane, HostLane) and s.ready is not None
    t += 1  # the copy has not run: it runs in ready(), as a CUDA copy would still be queued
    s.ready()
    assert s.download.waited_on == [threading.current_thread().name]
    np.testing.assert_array_equal(s.array, np.arange(10, dtype=np.float32) + 1)
    s.array[:] = -1
    assert s.finish() is t
    assert torch.equal(t, torch.full((10,), -1.0))


def test_stand_in_reuses_a_buffer_of_the_same_shape_only(stand_in) -> None:
    a = torch.ones(6)
    first = tensors.stage(a)
    again = tensors.stage(a, reuse=first)
    assert again.host.data_ptr() == first.host.data_ptr()
    other = tensors.stage(torch.ones(7), reuse=first)
    assert other.host.data_ptr() != first.host.data_ptr()
    out = tensors.stage(a, fetch=False)
    assert out.ready is None


def test_stand_in_copy_and_bfloat16(stand_in) -> None:
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    s = tensors.stage(t, copy=True)
    assert s.bf16 and s.array.dtype == np.uint16 and s.tensor is not t
    assert s.tensor.dtype == torch.bfloat16 and s.tensor.device == t.device
    s.ready()
    assert torch.equal(s.host, t)
    back = tensors.result_tensor(s.array.copy(), t, True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_results_and_bytes_land_on_the_like_device(stand_in) -> None:
    like = torch.zeros(2, dtype=torch.int64)
    got = tensors.result_tensor(np.arange(4, dtype=np.int64), like, False)
    assert got.device == like.device and got.dtype == torch.int64
    assert got.data_ptr() != 0 and got.tolist() == [0, 1, 2, 3]
    outs = [torch.zeros(2, dtype=torch.float32), torch.zeros(3, dtype=torch.int16)[::1]]
    raw = np.concatenate([np.array([1, 2], np.float32).view(np.uint8),
                          np.array([7, 8, 9], np.int16).view(np.uint8)])
    tensors.fill_bytes(outs, raw)
    assert outs[0].tolist() == [1.0, 2.0] and outs[1].tolist() == [7, 8, 9]
    wide = torch.zeros(4, 2)[:, 0]  # not contiguous
    tensors.fill_bytes([wide], np.arange(4, dtype=np.float32).view(np.uint8))
    assert wide.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_lanes_are_made_once_per_device_and_refuse_other_kinds() -> None:
    assert lane_for(torch.device("cpu")) is lane_for(torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="meta"):
        lane_for(torch.device("meta"))


def test_local_device_without_gpus_is_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device(3, 4) == torch.device("cpu")


def test_local_device_shares_gpus_and_says_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(placement, "_warned", False)
    with caplog.at_level("WARNING", logger="shoal.torch.device"):
        assert local_device(1, 2) == torch.device("cuda", 0)
        assert local_device(0, 2) == torch.device("cuda", 0)
    assert len([r for r in caplog.records if "share 1 visible GPU" in r.message]) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert local_device(6, 8) == torch.device("cuda", 2)


def test_local_device_honours_a_per_process_cuda_visible_devices(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setattr(placement, "_warned", False)
    with caplog.at_level("WARNING", logger="shoal.torch.device"):
        assert local_device(5, 8) == torch.device("cuda", 0)
    assert not caplog.records


# -- the engine thread, not the caller, waits for the copy --------------------------------------
def _ready_thread(rank: int) -> list[tuple[str, str]]:
    import shoal.torch as hvd
    from shoal.torch.device import streams
    tensors.set_stand_in(True)
    phase = ["setup"]
    seen: list[tuple[str, str]] = []
    original = streams.Download.wait

    def wait(self):  # who waits for a staging copy, and when
        seen.append((threading.current_thread().name, phase[0]))
        original(self)
    streams.Download.wait = wait
    t = torch.full((1000,), float(rank + 1))
    phase[0] = "submit"
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="ready.thread")
    phase[0] = "synchronize"
    assert torch.equal(hvd.synchronize(h), torch.full((1000,), 3.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 200), torch.nn.Linear(200, 20))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    buffers = set()
    for _ in range(3):
        loss = model(torch.randn(8, 30) + rank).sum()
        phase[0] = "backward"
        loss.backward()
        phase[0] = "step"
        opt.step()
        opt.zero_grad()
        buffers |= {b.staged.host.data_ptr() for b in opt._buckets._buckets}
    seen.append(("buffers", str(len(buffers))))
    seen.append(("buckets", str(opt._buckets.count)))
    return seen


def test_device_stage_copies_are_never_waited_for_by_the_submitting_thread() -> None:
    for seen in run_ranks(_ready_thread, 2, bucket_bytes=4096):
        counts = dict(seen[-2:])
        seen = seen[:-2]
        # pinned buffers were allocated once per bucket and reused (the first step's order
        # settles the layout once: at most twice the buckets)
        assert int(counts["buffers"]) <= 2 * int(counts["buckets"]), counts
        assert len(seen) >= 1 + 3 * int(counts["buckets"]), seen
        mine = threading.main_thread().name
        assert not [w for w in seen if w[0] == mine and w[1] in ("submit", "backward")], seen


# -- SMDDP's intra-node path, gloo standing in for NCCL -----------------------------------------
GROUP_CASES = [("float32", "SUM", 1), ("float32", "AVERAGE", 4099), ("float32", "SUM", 0),
               ("float16", "AVERAGE", 1001), ("float16", "SUM", 7), ("float32", "AVERAGE", 3)]


def _device_group(rank: int, stand: bool) -> dict[str, int]:
    import shoal
    from shoal.core.reduction import ReduceOp
    from shoal.torch.device.group import GroupReduction, device_group_for
    tensors.set_stand_in(stand)
    comm = shoal.communicator()
    group = device_group_for(comm, torch.device("cpu"))
    assert group is not None and group.local_size == 2 and group.cross.size == 2
    n = comm.size
    last = None
    for step in range(2):
        for dtype, op, length in GROUP_CASES:
            case = f"group/{dtype}/{op}/{length}"
            inputs = [rank_input(case, r, (length,), dtype, special=False) for r in range(n)]
            flat = torch.from_numpy(inputs[rank].copy())
            red = group.allreduce_async(flat, ReduceOp[op], f"{case}.{step}", reuse=last)
            assert isinstance(red, GroupReduction)
            red.wait()
            got = red.finish()
            assert got is flat
            assert_matches(got.numpy(), reference(inputs, op, dtype), dtype, case, inputs)
            last = red
    # the optimizer's buckets take the path too, and train as one process on the global batch
    import shoal.torch as hvd
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    full = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(n * 4, 9, generator=gen)
    for _ in range(2):
        model(xs[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    grouped = sum(isinstance(b.staged, GroupReduction) for b in opt._buckets._buckets)
    ref = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    with torch.no_grad():
        for p, w in zip(ref.parameters(), full, strict=True):
            p.copy_(w)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        # the mean over ranks of per-rank means = the mean over the global batch here
        ref(xs).pow(2).mean().backward()
        sgd.step()
        sgd.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return {"grouped_buckets": grouped}


@pytest.mark.parametrize("stand", [False, True], ids=["views", "stand-in"])
def test_intra_node_orchestration_over_gloo_matches_numpy(stand: bool) -> None:
    got = run_ranks(_device_group, 4, stand, hosts=["a", "a", "b", "b"], timeout=120,
                    device_group="on", device_group_backend="gloo")
    assert all(g["grouped_buckets"] >= 1 for g in got), got


def _fallback(rank: int) -> bool:
    import shoal
    from shoal.torch.device.group import device_group_for
    return device_group_for(shoal.communicator(), torch.device("cpu")) is None


def test_one_rank_per_host_falls_back_to_the_host_staged_path() -> None:
    assert run_ranks(_fallback, 2, hosts=["a", "b"], device_group="on",
                     device_group_backend="gloo") == [True, True]


@needs_cuda
def test_cuda_lane_orders_copies_with_events() -> None:
    device = torch.device("cuda", 0)
    lane = lane_for(device)
    x = torch.arange(1 << 20, device=device, dtype=torch.float32)
    host = pinned_empty(x.shape, x.dtype)
    assert host.is_pinned()
    download = lane.download(x * 2, host)
    download.wait()
    assert host[5].item() == 10.0
    back = torch.empty_like(x)
    lane.upload(host, back)
    assert torch.equal(back, x * 2)


def _lazy_group(rank: int) -> list[float]:
    import gc
    import os

    import shoal
    from shoal.core.reduction import ReduceOp
    from shoal.torch.device.group import device_group_for
    # gloo connecting at its first collective, as NCCL always does: the group calls the
    # store then, long after it was built
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    comm = shoal.communicator()
    group = device_group_for(comm, torch.device("cpu"))
    assert group is not None
    gc.collect()  # nothing but the group may keep the store's Python half alive
    red = group.allreduce_async(torch.full((10,), float(rank + 1)), ReduceOp.SUM, "lazy")
    red.wait()
    return red.finish().tolist()


def test_a_lazily_connecting_device_group_keeps_its_store() -> None:
    got = run_ranks(_lazy_group, 2, hosts=["a", "a"], timeout=60, device_group="on",
                    device_group_backend="gloo")
    assert got == [[3.0] * 10, [3.0] * 10]


def _branchy(rank: int) -> dict[str, list]:
    import copy

    import shoal
    import shoal.torch as hvd
    from shoal.torch.device.group import device_group_for
    torch.manual_seed(5)
    model = torch.nn.ModuleDict({k: torch.nn.Linear(6, 3) for k in "abc"})
    start = copy.deepcopy(model)
    group = device_group_for(shoal.communicator(), torch.device("cpu"))
    launched: list[str] = []
    submit = group.allreduce_async

    def record(flat, op, name, *a, **k):  # the order this rank issues group collectives in
        launched.append(name)
        return submit(flat, op, name, *a, **k)
    group.allreduce_async = record
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_bytes=1)

    def loss(net: torch.nn.ModuleDict, r: int, x: torch.Tensor) -> torch.Tensor:
        # autograd runs the branch built last first: the ranks' gradients arrive in opposite
        # orders, and c (rank 1 only) is unused on rank 0
        order = "ab" if r == 0 else "cba"
        return sum(net[k](x).square().sum() for k in order)

    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    want = {}
    for r in range(2):
        ref = copy.deepcopy(start)
        loss(ref, r, xs[r]).backward()
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            want[name] = want.get(name, 0) + g / 2
    worst = 0.0
    for _ in range(2):  # the first step, then the settled bucket order
        opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(model.parameters(), start.parameters(), strict=True):
                p.copy_(q)
        loss(model, rank, xs[rank]).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            worst = max(worst, float((p.grad - want[name]).abs().max()))
        with opt.skip_synchronize():
            opt.step()
    return {"launched": launched, "worst": [worst]}


def test_device_group_launches_in_bucket_order_whatever_the_arrival_order() -> None:
    got = run_ranks(_branchy, 2, hosts=["a", "a"], timeout=60, device_group="on",
                    device_group_backend="gloo")
    assert got[0]["launched"] == got[1]["launched"] and len(got[0]["launched"]) == 12
    assert all(g["worst"][0] < 1e-5 for g in got), got


def _reduce_now_threads(rank: int) -> dict[str, list[str]]:
    import shoal
    from shoal.core.reduction import ReduceOp
    tensors.set_stand_in(True)
    comm = shoal.communicator()
    for _ in range(2):  # the names are known after the first pass (the one-round path)
        seen: list[str] = []
        pending = np.ones(1000)

        def ready(seen: list[str] = seen) -> None:
            seen.append(threading.current_thread().name)
        handle = comm.allreduce_async(pending, ReduceOp.SUM, "pending", out=pending,
                                      ready=ready)
        staged = tensors.stage(torch.full((3,), float(rank)), copy=True)
        got = tensors.reduce_now(comm, staged, ReduceOp.SUM, "now")
        handle.wait()
        assert got.tolist() == [1.0] * 3 and pending.tolist() == [2.0] * 1000
    return {"pending_ready_on": seen, "own_copy_waited_on": staged.download.waited_on,
            "me": [threading.current_thread().name]}


def test_reduce_now_leaves_device_waits_and_rounds_to_the_engine_thread() -> None:
    for got in run_ranks(_reduce_now_threads, 2, timeout=60):
        assert got["me"][0] not in got["pending_ready_on"] + got["own_copy_waited_on"], got
        assert got["own_copy_waited_on"] == ["shoal-engine"], got


def test_premul_sum_factor_multiplies_where_the_tensor_is() -> None:
    from shoal.torch.backend import _premultiplied
    t = torch.tensor([1.0, 2.0])
    same, pre = _premultiplied(t, 0.5, in_place=True)  # a number: the core's prescale
    assert same is t and pre == 0.5 and t.tolist() == [1.0, 2.0]
    factor = torch.tensor(3.0)  # a tensor (on a GPU: never read by the host)
    copied, pre = _premultiplied(t, factor, in_place=False)
    assert pre == 1.0 and copied.tolist() == [3.0, 6.0] and t.tolist() == [1.0, 2.0]
    scaled, _ = _premultiplied(t, factor, in_place=True)
    assert scaled is t and t.tolist() == [3.0, 6.0]


def _send_ready(rank: int) -> list[str]:
    import shoal
    comm = shoal.communicator()
    ran: list[str] = []
    if rank == 0:
        data = np.zeros(5)

        def ready() -> None:  # a device copy's wait: the sending thread's, not the caller's
            ran.append(threading.current_thread().name)
            data[:] = 7.0
        comm.send(data, 1, tag=3, ready=ready).wait(10)
        return ran
    got = np.empty(5)
    comm.recv(got, 0, tag=3).wait(10)
    return [str(v) for v in got]


def test_send_waits_for_its_copy_on_the_sending_thread() -> None:
    sender, receiver = run_ranks(_send_ready, 2, timeout=60)
    assert len(sender) == 1 and sender[0].startswith("shoal-p2p-send"), sender
    assert receiver == ["7.0"] * 5


def _backward_orders(rank: int) -> dict[str, int]:
    import shoal.torch as hvd
    from shoal.torch.device.staging import DeviceStaged
    tensors.set_stand_in(True)
    calls: list[str] = []
    original = DeviceStaged.order_after_copy

    def record(self: DeviceStaged) -> None:
        calls.append(threading.current_thread().name)
        original(self)
    DeviceStaged.order_after_copy = record  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_bytes=1)
    counts = {}
    for step in range(2):
        calls.clear()
        model(torch.randn(3, 8)).sum().backward()
        counts[f"during_backward_{step}"] = len(calls)  # before step(): the end of backward
        opt.step()
        opt.zero_grad()
    return counts


def test_the_end_of_backward_orders_the_stream_after_the_bucket_copies() -> None:
    for got in run_ranks(_backward_orders, 2, timeout=60):
        # 4 parameters in 4 buckets, all submitted by the end of backward: each ordered
        assert got == {"during_backward_0": 4, "during_backward_1": 4}, got


def test_shoal_threads_bind_to_the_ranks_device_once(monkeypatch) -> None:
    """A thread of shoal's (engine, completion pool) makes the rank's GPU current before it
    enters a stream of it, so leaving the stream switches no device (a switch back to device
    0 created a CUDA context there in every rank); once per thread."""
    from shoal.torch.device import streams
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, str(d))))

    def bind() -> None:
        for _ in range(3):
            streams.use_device(torch.device("cuda", 3))
    workers = [threading.Thread(target=bind, name=f"shoal-test-{i}") for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    streams.use_device(torch.device("cpu"))  # host tensors: nothing to bind
    assert sorted(calls) == [("shoal-test-0", "cuda:3"), ("shoal-test-1", "cuda:3")]
