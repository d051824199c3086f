"""The rules the adapters share, written once in the core: predivide, sparse reductions, the
reduce-scatter gradient, scalars where rows are needed, the root of a process set; and the
runtime object that holds the process's shoal state."""

from __future__ import annotations

import pytest

from harness import run_ranks
from shoal.core.gradients import check_predivide, predivide, reducescatter_grad_scale, sparse_scale
from shoal.core.reduction import ReduceOp, check_rows


def test_predivide_splits_an_average_around_the_sum() -> None:
    assert predivide(ReduceOp.AVERAGE, 1.0, 4) == (ReduceOp.AVERAGE, 1.0, 1.0)
    op, pre, post = predivide(ReduceOp.AVERAGE, 2.0, 4)
    assert op == ReduceOp.SUM and pre == 0.5 and post == 0.5
    assert predivide(ReduceOp.SUM, 1.0, 4) == (ReduceOp.SUM, 1.0, 1.0)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN])
def test_predivide_takes_average_only(op: ReduceOp) -> None:
    with pytest.raises(ValueError, match=r"gradient_predivide_factor only applies to "
                                         r"op=Average \(got op=\w+ with factor 2\)"):
        check_predivide(op, 2.0)
    with pytest.raises(ValueError, match="only applies to op=Average"):
        predivide(op, 2.0, 3)
    check_predivide(op, 1.0)  # the default factor goes with any op


def test_a_sparse_reduction_scales_the_gathered_values() -> None:
    assert sparse_scale(ReduceOp.SUM, 4) == 1.0
    assert sparse_scale(ReduceOp.AVERAGE, 4) == 0.25
    assert sparse_scale(ReduceOp.SUM, 4, prescale=3.0) == 3.0
    assert sparse_scale(ReduceOp.AVERAGE, 4, prescale=2.0, postscale=0.5) == 0.25


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT])
def test_a_sparse_reduction_a_gather_cannot_express_is_refused(op: ReduceOp) -> None:
    with pytest.raises(NotImplementedError, match=rf"rank 2: a tf.IndexedSlices reduces by "
                                                  rf"allgathering.*not {op.name.capitalize()}"
                                                  rf".*sparse_as_dense=True"):
        sparse_scale(op, 4, rank=2, what="a tf.IndexedSlices")


def test_the_reducescatter_gradient_follows_horovods_rule() -> None:
    assert reducescatter_grad_scale(ReduceOp.SUM, 4) == 4
    assert reducescatter_grad_scale(ReduceOp.AVERAGE, 4) == 1
    assert reducescatter_grad_scale(ReduceOp.SUM, 3, 0.5, 2.0) == 3.0
    assert reducescatter_grad_scale(ReduceOp.AVERAGE, 3, 0.5, 3.0) == 1.5


@pytest.mark.parametrize("kind", ["allgather", "alltoall", "reducescatter"])
def test_a_scalar_where_rows_are_needed_has_one_message(kind: str) -> None:
    with pytest.raises(ValueError, match=rf"^rank 1: {kind} tensor 'x' is a scalar; {kind} "
                                         rf"works on rows \(dimension 0\): reshape it to"):
        check_rows(0, kind, "x", 1)
    with pytest.raises(ValueError, match=rf"^rank 0: {kind} tensor is a scalar"):
        check_rows(0, kind, None, 0)
    check_rows(1, kind, "x", 1)
    check_rows(None, kind, "x", 1)  # no shape known: the core checks it later


def _roots(rank: int) -> dict:
    import numpy as np

    import shoal
    from shoal.core import process_sets as ps_
    from shoal.core.runtime import RUNTIME

    out: dict = {"same": RUNTIME.comm is shoal.communicator(),
                 "global": [ps_.set_root(None, r) for r in range(3)]}
    odd = shoal.add_process_set([1, 2])
    out["registry"] = sorted(RUNTIME.sets) == ps_.process_set_ids() == [0, odd.process_set_id]
    out["in_set"] = ps_.set_root(odd, 2)
    errors = []
    for ps, root in ((None, 3), (None, -1), (None, "0"), (None, True), (odd, 0)):
        try:
            ps_.set_root(ps, root)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["np_root"] = ps_.set_root(None, np.int64(1))
    shoal.remove_process_set(odd)
    return out


def test_roots_map_to_set_ranks_in_one_place_and_the_runtime_holds_the_state() -> None:
    for rank, got in enumerate(run_ranks(_roots, 3)):
        assert got["same"] and got["registry"]
        assert got["global"] == [0, 1, 2] and got["in_set"] == 1 and got["np_root"] == 1
        errors = got["errors"]
        assert len(errors) == 5 and all(e.startswith(f"rank {rank}: ") for e in errors)
        assert all("is not a rank of this job (0..2)" in e for e in errors[:4])
        assert "root_rank 0 is not a member of ProcessSet" in errors[4]
