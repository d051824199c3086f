"""The engine's parts one by one, without the loop: the name cache, the stall inspector and
the executor (on a one-rank transport, whose collectives are exact copies)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from shoal.core import config, topology
from shoal.core.engine.executor import Executor
from shoal.core.engine.names import NameCache
from shoal.core.engine.negotiator import decide, encode
from shoal.core.engine.requests import Kind, Request
from shoal.core.engine.stalls import StallInspector
from shoal.core.errors import ShoalTimeoutError
from shoal.core.reduction import ReduceOp
from shoal.core.transport import Transport

AR = "allreduce float32 (4,) Sum none"


def _req(name: str, kind: Kind = Kind.ALLREDUCE, desc: str = AR, n: int = 4,
         dtype: str = "float32", extra: object = None) -> Request:
    a = np.arange(n, dtype=dtype)
    return Request(kind, name, a, np.empty_like(a), dtype, desc, op=ReduceOp.SUM,
                   extra=extra)


def _round(cache: NameCache, names: list[str], round_: int) -> None:
    """One two-rank round in which both ranks propose ``names``, applied to ``cache``."""
    bits, new = cache.split([_req(nm) for nm in names])
    blob = encode(bits, new, 0)
    d = decide([blob, blob], cache.by_id, cache.entries, rank=0, pending=names,
               stall_warning_s=60.0)
    cache.apply(d, round_)


# -- the name cache ------------------------------------------------------------------------
def test_a_name_is_sent_in_full_once_then_as_one_bit() -> None:
    cache = NameCache(64)
    bits, new = cache.split([_req("a"), _req("b")])
    assert bits.size == 0 and [e[0] for e in new] == ["a", "b"]
    _round(cache, ["a", "b"], 1)
    assert cache.by_id == ["a", "b"] and cache.entries["b"] == (1, AR) and len(cache) == 2
    bits, new = cache.split([_req("b")])
    assert list(bits) == [False, True] and new == []


def test_a_changed_description_or_a_per_call_kind_is_sent_in_full() -> None:
    cache = NameCache(64)
    _round(cache, ["a", "g"], 1)
    other = "allreduce float32 (8,) Sum none"
    bits, new = cache.split([_req("a", desc=other), _req("g", kind=Kind.ALLGATHER, extra=3)])
    assert not bits.any() and [(e[0], e[1], e[2]) for e in new] == [("a", other, None),
                                                                     ("g", AR, 3)]


def test_eviction_keeps_the_most_recently_used_and_renumbers_alike() -> None:
    caches = [NameCache(16), NameCache(16)]  # two ranks' caches see the same rounds
    for cache in caches:
        for i in range(20):
            _round(cache, [f"n{i:02d}"], i + 1)
        _round(cache, ["n00"], 21)  # used again: the most recent
        cache.evict()
    kept = caches[0].by_id
    assert len(kept) == 12 and "n00" in kept and "n01" not in kept and "n19" in kept
    assert kept == caches[1].by_id and caches[0].entries == caches[1].entries
    assert [caches[0].entries[nm][0] for nm in kept] == list(range(12))
    assert caches[0].last[caches[0].entries["n00"][0]] == 21 and caches[0].last.size == 12


def test_the_one_round_use_counts_as_a_use() -> None:
    cache = NameCache(16)
    for i in range(17):
        _round(cache, [f"n{i:02d}"], i + 1)
    cache.last[cache.entries["n00"][0]] = 99  # as the one-round path records a use
    cache.evict()
    assert "n00" in cache.by_id and "n01" not in cache.by_id


# -- the stall inspector ---------------------------------------------------------------------
def test_only_a_blocked_rank_with_an_old_request_is_stuck() -> None:
    stalls = StallInspector(config.load(stall_warning_s=0.05), 0)
    old = _req("old")
    old.enqueued -= 1.0
    assert not stalls.stuck([old])  # pending while it computes: not stuck
    with stalls.blocking():
        assert not stalls.stuck([old])  # blocked only just now
        time.sleep(0.1)
        assert stalls.stuck([old]) and not stalls.stuck([_req("new")])
        with stalls.blocking():  # a wait inside a wait keeps the outer one's start
            assert stalls.stuck([old])
        assert stalls.stuck([old])
    assert not stalls.stuck([old])


def test_blocked_waits_are_per_thread() -> None:
    stalls = StallInspector(config.load(stall_warning_s=0.05), 0)
    old = _req("old")
    old.enqueued -= 1.0
    entered, leave = threading.Event(), threading.Event()

    def blocked() -> None:
        with stalls.blocking():
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=blocked)
    t.start()
    entered.wait(5)
    time.sleep(0.1)
    assert stalls.stuck([old])
    leave.set()
    t.join(5)
    assert not stalls.stuck([old])


def test_an_overdue_request_is_named_once_then_fails_past_the_shutdown_limit(
        caplog: pytest.LogCaptureFixture) -> None:
    stalls = StallInspector(config.load(stall_warning_s=0.01, stall_shutdown_s=5.0), 3)
    req = _req("grad.w")
    req.missing = (1, 2)
    req.enqueued -= 1.0
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        assert stalls.check([req]) is None
        assert stalls.check([req]) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'grad.w'" in warnings[0] and "[1, 2]" in warnings[0] \
        and warnings[0].startswith("rank 3:")
    req.enqueued -= 10.0
    error = stalls.check([req])
    assert isinstance(error, ShoalTimeoutError) and "'grad.w'" in str(error) \
        and "SHOAL_STALL_SHUTDOWN_S=5" in str(error)


# -- the executor ------------------------------------------------------------------------------
def _executor(**knobs: object) -> Executor:
    cfg = config.load(**knobs)
    world = topology.World.single("here")
    return Executor(Transport(cfg, world, None, None), cfg)


def test_allreduces_fuse_per_dtype_and_op_up_to_the_threshold() -> None:
    ex = _executor(fusion_threshold=64)
    reqs = [_req(f"f{i}", n=4) for i in range(5)]  # 16 bytes each: 4 per buffer
    reqs += [_req("d", dtype="float64", desc="allreduce float64 (4,) Sum none")]
    ex.run(reqs, {}, 0.0, 0.0)
    assert ex.buffers == 3  # f0..f3, f4, d (another dtype: a buffer of its own)
    for req in reqs:
        assert req.future.done()
        np.testing.assert_array_equal(req.future.result(), req.array)


def test_fusion_keeps_the_decided_order_so_a_large_tensor_splits_buffers() -> None:
    ex = _executor(fusion_threshold=64)
    done: list[str] = []
    reqs = [_req("small"), _req("big", n=100), _req("small2")]
    for req in reqs:
        req.future.add_done_callback(lambda f, nm=req.name: done.append(nm))
    ex.run(reqs, {}, 0.0, 0.0)
    assert ex.buffers == 3 and done == ["small", "big", "small2"]


def test_other_kinds_run_one_by_one_with_every_ranks_extras() -> None:
    ex = _executor()
    gather = _req("g", kind=Kind.ALLGATHER, n=6, extra=3)
    gather.trailing, gather.out = (2,), None
    bcast = _req("b", kind=Kind.BROADCAST)
    ex.run([gather, bcast], {"g": {0: 3}}, 0.0, 0.0)
    assert ex.buffers == 0
    np.testing.assert_array_equal(gather.future.result(), gather.array.reshape(3, 2))
    np.testing.assert_array_equal(bcast.future.result(), bcast.array)


def test_an_allgather_output_of_the_wrong_size_fails_that_request_only() -> None:
    ex = _executor()
    gather = _req("g", kind=Kind.ALLGATHER, n=4, extra=4)
    gather.out = np.empty(5, np.float32)
    ok = _req("ok")
    ex.run([gather, ok], {"g": {0: 4}}, 0.0, 0.0)
    with pytest.raises(ValueError, match="'g' has 5 rows; the ranks sent 4"):
        gather.future.result()
    np.testing.assert_array_equal(ok.future.result(), ok.array)
