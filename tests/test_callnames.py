"""Names of a process group's calls (:mod:`shoal.core.callnames`): the same every step of a
training loop, distinct while in flight, and the same on every rank (a pure function of the
calls issued so far)."""

from __future__ import annotations

from shoal.core.callnames import CallNames


def _names(calls: list[tuple[str, str]], window: int = 256, generations: int = 1
           ) -> list[str]:
    names = CallNames("g", window, generations)
    return [names.next(kind, sig) for kind, sig in calls]


def test_a_ddp_loop_names_every_step_alike_once_steps_are_found() -> None:
    init = [("allgather", "shapes"), ("broadcast", "p0"), ("broadcast", "p1")]
    step = [("broadcast", "buffers"), ("allreduce", "b0"), ("allreduce", "b1")]
    got = _names(init + step * 4)
    steps = [got[3 + 3 * i:6 + 3 * i] for i in range(4)]
    assert steps[1] == steps[2] == steps[3] == ["g.broadcast.0.0", "g.allreduce.0.0",
                                                 "g.allreduce.1.0"]
    assert steps[0][0] == "g.broadcast.2.0"  # before the loop repeats, places run on


def test_names_come_back_only_generations_steps_later() -> None:
    init = [("broadcast", "p0")]
    step = [("broadcast", "buffers"), ("allreduce", "b0")]
    got = _names(init + step * 9, generations=4)[1:]
    per_step = [tuple(got[2 * i:2 * i + 2]) for i in range(9)]
    assert per_step[1:5] == [("g.broadcast.0.1", "g.allreduce.0.1"),
                             ("g.broadcast.0.2", "g.allreduce.0.2"),
                             ("g.broadcast.0.3", "g.allreduce.0.3"),
                             ("g.broadcast.0.0", "g.allreduce.0.0")]
    assert per_step[5:9] == per_step[1:5]
    # the first reuse of a name is 4 steps after its last use
    allreduces = [names[1] for names in per_step]
    assert allreduces[0] == "g.allreduce.0.0" and allreduces.index(allreduces[0], 1) == 4


def test_calls_of_one_kind_in_a_step_get_distinct_places() -> None:
    # FSDP-like: identical layers' all-gathers, prefetched, then reduce-scatters
    step = [("allgather", "emb")] + [("allgather", "layer")] * 4 + \
        [("reducescatter", "layer")] * 4 + [("reducescatter", "emb")]
    got = _names(step * 5)
    per_step = [got[10 * i:10 * (i + 1)] for i in range(5)]
    assert per_step[2] == per_step[3] == per_step[4]
    for names in per_step[2:]:
        assert len(set(names)) == len(names)  # nothing in one step shares a name


def test_one_signature_again_and_again_takes_places_in_turn() -> None:
    got = _names([("allreduce", "x")] * 10, window=4)
    # the second call makes "x" the anchor (a step begins); no other signature comes, so no
    # step ends, and the places run on modulo the window
    assert got == ["g.allreduce.0.0"] + [f"g.allreduce.{i % 4}.0" for i in range(9)]


def test_a_shape_is_not_part_of_the_name_so_a_disagreement_is_a_mismatch() -> None:
    a = _names([("broadcast", "start"), ("allreduce", "(3,) float32")])
    b = _names([("broadcast", "start"), ("allreduce", "(4,) float32")])
    assert a == b  # the engine then sees one name, two descriptions: a mismatch


def test_a_name_in_use_is_handed_back_to_wait_on() -> None:
    names = CallNames("g", 2, 1, finished=lambda h: h == "done")
    names.next("allreduce", "x")
    first = names.next("allreduce", "x")  # (the step that begins here)
    assert names.take(first) is None
    names.hold(first, "running")
    names.hold(names.next("allreduce", "x"), "other")
    third = names.next("allreduce", "x")
    assert third == first and names.take(third) == "running"


def test_holders_stay_bounded_keeping_the_running_ones() -> None:
    names = CallNames("g", 1, 1, finished=lambda h: h.startswith("done"), limit=8)
    for i in range(20):
        names.hold(f"n{i}", f"done{i}" if i % 2 else f"running{i}")
    assert len(names._holders) <= 12
    assert names.take("n0") == "running0" and names.take("n19") == "done19"
