"""The negotiator alone: a pure function from every rank's proposal and the name cache to one
decision; no threads, sockets or engine."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.core.engine.negotiator import JOINED, STUCK, decide, encode
from shoal.core.errors import CollectiveMismatchError, ShoalError

AR = "allreduce float32 (4,) Sum none"
AR8 = "allreduce float32 (8,) Sum none"
BC = "broadcast float32 (4,) root=0"


def _cache(names: list[str], desc: str = AR) -> tuple[list[str], dict[str, tuple[int, str]]]:
    return list(names), {nm: (i, desc) for i, nm in enumerate(names)}


def _bits(n: int, *on: int) -> np.ndarray:
    bits = np.zeros(n, bool)
    bits[list(on)] = True
    return bits


def _decide(blobs: list[bytes], by_id: list[str], cache: dict, pending: list[str],
            rank: int = 0):
    return decide(blobs, by_id, cache, rank=rank, pending=pending, stall_warning_s=60.0)


def test_steady_state_runs_the_common_cached_names_in_cache_order() -> None:
    by_id, cache = _cache(["a", "b", "c"])
    blob = encode(_bits(3, 2, 0), [], 0)
    d = _decide([blob, blob], by_id, cache, ["c", "a"])
    assert d.order == ["a", "c"] and list(d.ran_ids) == [0, 2]
    assert not (d.refused or d.fresh or d.missing)


def test_new_names_join_the_cache_sorted_and_the_same_for_every_rank() -> None:
    by_id, cache = _cache(["a"])
    blobs = [encode(_bits(1, 0), [["z", AR, 1], ["m", AR, 2]], 0),
             encode(_bits(1, 0), [["m", AR, 3], ["z", AR, 4]], 0)]
    decisions = [_decide(blobs, by_id, cache, ["a", "m", "z"], rank=r) for r in (0, 1)]
    for d in decisions:
        assert d.order == ["a", "m", "z"] and list(d.ran_ids) == [0, 1, 2]
        assert d.fresh == [("m", AR), ("z", AR)]
        assert d.extras == {"z": {0: 1, 1: 4}, "m": {0: 2, 1: 3}}
    assert by_id == ["a"] and cache == {"a": (0, AR)}  # the inputs are left as they were


def test_a_name_two_ranks_describe_differently_is_refused_on_every_rank() -> None:
    blobs = [encode(_bits(0), [["g", AR, None]], 0), encode(_bits(0), [["g", AR8, None]], 0)]
    for rank in (0, 1):
        d = _decide(blobs, [], {}, ["g"], rank=rank)
        assert d.order == [] and list(d.refused) == ["g"]
        error = d.refused["g"]
        assert isinstance(error, CollectiveMismatchError)
        assert str(error).startswith(f"rank {rank}: ") and "(4,)" in str(error) \
            and "(8,)" in str(error)


def test_a_name_only_some_ranks_proposed_waits_and_says_for_whom() -> None:
    by_id, cache = _cache(["a"])
    blobs = [encode(_bits(1, 0), [["n", AR, None]], 0), encode(_bits(1), [], 0),
             encode(_bits(1, 0), [], 0)]
    d = _decide(blobs, by_id, cache, ["a", "n"])
    assert d.order == [] and d.missing == {"a": (1,), "n": (1, 2)}


def test_a_cached_name_every_rank_changed_is_adopted() -> None:
    by_id, cache = _cache(["a", "b"])
    blobs = [encode(_bits(2, 1), [["a", AR8, None]], 0)] * 2
    d = _decide(blobs, by_id, cache, ["a", "b"])
    assert d.order == ["a", "b"] and d.adopted == {"a": AR8} and not d.fresh


def test_joined_ranks_take_allreduces_only() -> None:
    by_id, cache = _cache(["a"])
    blobs = [encode(_bits(1, 0), [["bc", BC, None]], 0), encode(_bits(1), [], JOINED)]
    d = _decide(blobs, by_id, cache, ["a", "bc"])
    assert d.joined == [1] and d.order == ["a"]
    assert list(d.refused) == ["bc"] and "cannot run while ranks [1] have joined" in \
        str(d.refused["bc"])


def test_ranks_all_stuck_on_collectives_that_cannot_match_fail_together() -> None:
    blobs = [encode(_bits(0), [["x", AR, None]], STUCK), encode(_bits(0), [["y", AR, None]],
                                                                STUCK)]
    d = _decide(blobs, [], {}, ["x"])
    assert list(d.refused) == ["x"]
    text = str(d.refused["x"])
    assert "cannot match" in text and "rank 0 waits for 'x'" in text \
        and "rank 1 waits for 'y'" in text
    not_stuck = [blobs[0], encode(_bits(0), [["y", AR, None]], 0)]
    assert not _decide(not_stuck, [], {}, ["x"]).refused  # one rank is still busy: wait


def test_a_cache_out_of_step_is_a_bug_said_as_such() -> None:
    by_id, cache = _cache(["a"])
    with pytest.raises(ShoalError, match="cache out of step with rank 1"):
        _decide([encode(_bits(1, 0), [["b", AR, None]], 0), encode(_bits(2), [], 0)],
                by_id, cache, ["a"])
