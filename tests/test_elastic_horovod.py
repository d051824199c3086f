"""Elastic training as Horovod's users wrote it: the sampler's ``processed_num`` and its state,
``State.reset()`` called on every reset, the queue of host notices (``_host_messages``,
``on_hosts_updated``) that ``commit()`` drains, the notifier that fills it, and the
``HOROVOD_*`` variables of an elastic worker."""

from __future__ import annotations

import os
import threading

import pytest

from harness import run_ranks
from shoal.core import api
from shoal.core.elastic import HostsUpdatedInterrupt, ObjectState, WorldPlan, _export_horovod_env
from shoal.core.host_updates import HostUpdateResult, Notifier, update_result

torch = pytest.importorskip("torch")

from shoal.torch.elastic import ElasticSampler  # noqa: E402


def _world(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    """The sampler reads the world from the API; here, a world without processes."""
    monkeypatch.setattr(api, "is_initialized", lambda: True)
    monkeypatch.setattr(api, "rank", lambda: rank)
    monkeypatch.setattr(api, "size", lambda: size)


def test_sampler_counts_processed_samples_as_horovod_does() -> None:
    sampler = ElasticSampler(list(range(16)), shuffle=True)
    assert sampler.processed_num == 0 and len(sampler) == 16
    for batch_idx in range(3):
        sampler.record_batch(batch_idx, 2)
        assert sampler.processed_num == 2 * (batch_idx + 1)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 6}
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sampler.state_dict()["epoch"] == 1


def test_workers_shards_cover_the_order_and_a_count_says_what_is_done(monkeypatch) -> None:
    data = list(range(30))
    shards = []
    for rank in range(3):
        _world(monkeypatch, rank, 3)
        shards.append(list(ElasticSampler(data, seed=7)))
    assert sorted(i for s in shards for i in s) == data  # 30 samples, 10 per worker
    # two batches of 2 on each of 3 workers: the first 12 indices of the epoch's order
    _world(monkeypatch, 0, 3)
    sampler = ElasticSampler(data, seed=7)
    sampler.record_batch(0, 2)
    sampler.record_batch(1, 2)
    done = {i for s in shards for i in s[:4]}
    assert sampler.processed_num == 12 and set(sampler.processed_indices) == done
    # a reset into a world of 2: the rest of the epoch, shared out, padded to equal shards
    state = sampler.state_dict()
    rest = []
    for rank in range(2):
        _world(monkeypatch, rank, 2)
        s = ElasticSampler(data, seed=7)
        s.load_state_dict(state)
        rest.append(list(s))
        assert len(s) == 9
    assert set(rest[0]) | set(rest[1]) == set(data) - done
    assert not (set(rest[0]) | set(rest[1])) & done


def _sampler_state(rank: int) -> tuple[int, int, list[int]]:
    from shoal.torch.elastic import ElasticSampler, TorchState
    sampler = ElasticSampler(list(range(8)), shuffle=False)
    state = TorchState(sampler=sampler, epoch=0)
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)
    state.restore()  # back to the commit: one batch on each of 2 workers
    restored = sampler.processed_num
    for _ in range(rank):  # the ranks drift apart; sync makes them rank 0's
        sampler.record_batch(1, 2)
    state.sync()
    return restored, state.sampler.processed_num, list(sampler)


def test_torch_state_commits_restores_and_syncs_the_sampler() -> None:
    (r0, n0, rest0), (r1, n1, rest1) = run_ranks(_sampler_state, 2, timeout=60)
    assert r0 == r1 == 4 and n0 == n1 == 4
    assert sorted(rest0 + rest1) == [4, 5, 6, 7]


class _Counting(ObjectState):
    def __init__(self) -> None:
        super().__init__(lambda obj: obj, lambda: 0, epoch=0)
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_on_reset_calls_reset_then_the_callbacks() -> None:
    state = _Counting()
    seen: list[int] = []
    state.register_reset_callbacks([lambda: seen.append(state.resets)])
    state.on_hosts_updated(3, HostUpdateResult.added)
    state.on_reset()
    assert state.resets == 1 and seen == [1]
    assert state._host_messages.empty()  # the old world's notices are gone


def test_commit_raises_on_a_newer_notice_and_skips_the_sync_after_removals_only() -> None:
    state = _Counting()
    state.commit()  # nothing queued
    state.on_hosts_updated(5, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync
    state.on_hosts_updated(4, HostUpdateResult.added)  # older than the last acted on
    state.commit()
    state.on_hosts_updated(6, HostUpdateResult.removed)
    state.on_hosts_updated(7, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert not info.value.skip_sync and state._last_updated_timestamp == 7


def test_update_result_flags() -> None:
    assert update_result(["a:0", "b:0"], ["a:0"], False) == HostUpdateResult.removed
    assert update_result(["a:0"], ["a:0", "b:0"], False) == HostUpdateResult.added
    assert update_result(["a:0", "b:0"], ["a:0", "c:0"], False) == HostUpdateResult.mixed
    assert update_result(["a:0"], ["a:0"], True) == HostUpdateResult.added


def test_notifier_queues_each_newer_world_once_from_its_thread() -> None:
    worlds = [None, (3, HostUpdateResult.added)]
    notifier = Notifier(lambda: worlds[-1])
    state = _Counting()
    got = threading.Event()
    state.on_hosts_updated = lambda t, r: (ObjectState.on_hosts_updated(state, t, r), got.set())
    notifier.register(state)
    try:
        assert got.wait(10), "the polling thread queued nothing"
        notifier.poll()
        notifier.poll()
        assert state._host_messages.qsize() == 1
        worlds.append((4, HostUpdateResult.removed))
        notifier.poll()
        assert [state._host_messages.get()[0] for _ in range(2)] == [3, 4]
    finally:
        notifier.stop()


def test_an_elastic_worker_gets_horovods_variables(monkeypatch) -> None:
    for k in list(os.environ):
        if k.startswith("HOROVOD_"):
            monkeypatch.delenv(k)
    plan = WorldPlan(2, ("a:0", "b:0", "b:1"), ("a", "b", "b"))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    _export_horovod_env(plan, 2, 1, 2)
    got = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    assert got == {"HOROVOD_HOSTNAME": "b", "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3",
                   "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                   "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}


def test_a_retried_error_is_logged_on_one_line(monkeypatch, caplog) -> None:
    """A framework's many-line error (TensorFlow's op errors carry a block of graph context)
    says its first line at warning level; the whole error goes to debug."""
    import logging

    from shoal.core import elastic
    from shoal.core.errors import PeerLostError
    monkeypatch.setattr(api, "is_initialized", lambda: True)
    monkeypatch.setenv(elastic.ELASTIC_ID_VAR, "localhost:0")
    calls: list[str] = []

    class _State:
        def sync(self) -> None:
            calls.append("sync")

        def restore(self) -> None:
            calls.append("restore")

        def on_reset(self) -> None:
            calls.append("reset")

    def train(state: _State) -> str:
        if "restore" not in calls:
            raise PeerLostError("rank 1 was lost\n\t [[{{node allreduce}}]]\n\t block")
        return "done"

    wrapped = elastic.run_fn(train, reset_fn=lambda: None)
    with caplog.at_level(logging.DEBUG, logger="shoal.elastic"):
        assert wrapped(_State()) == "done"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        "elastic: PeerLostError: rank 1 was lost [...]; back to the last commit, joining the "
        "next world"]
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)
    assert calls == ["sync", "restore", "reset", "sync"]
