"""The scaling simulator: closed forms, monotonicity, presets, timeline loading, validation."""

from __future__ import annotations

import json
import math
import time

import pytest

from shoal.cli import main
from shoal.core.timeline import Timeline
from shoal.sim import PRESETS, STRATEGIES, StepProfile, load_timeline, model_profile, scaling
from shoal.sim.calibration import calibrate, solve, validate
from shoal.sim.collectives import (
    allreduce_time,
    doubling_time,
    flat_ring_time,
    hierarchical_time,
    nccl_ring_time,
    ring_time,
)
from shoal.sim.engine_model import _fuse, simulate_step, step_time
from shoal.sim.hardware import Link
from shoal.sim.models import Gradient, efficientnet_costs

INF = math.inf

# Recorded on this machine for the simulator (2 emulated nodes x 2 ranks, tc tbf 1gbit):
#   shoal bench cluster --sizes 16M --trials 3 --out /tmp/sim-bench-cluster.json
# link measured 121,266,544 B/s (0.97 Gbit/s); seconds, min and median over 3 trials.
MEASURED = {
    "nbytes": 16 << 20, "nodes": 2, "local": 2, "link_Bps": 121266543.6,
    "hierarchical": (0.14243240, 0.14334198),
    "ring": (0.22631544, 0.25056188),
}


def _ideal(**changes: object):
    """This machine's preset with free software, zero latencies and instant memory."""
    hw = PRESETS["this-machine"]
    base = dict(per_tensor=0.0, per_collective=0.0, ctrl_msg=0.0, shm_sync=0.0,
                host_copy_bw=INF, host_mem_bw=INF, nic=Link(1e9, 0.0),
                tcp_loopback=Link(INF, 0.0))
    base.update(changes)
    return hw.replace(**base)


def _profile(grads: list[tuple[int, float]], forward: float = 0.01) -> StepProfile:
    return StepProfile("synthetic", 8, forward,
                       tuple(Gradient(f"g{i}", b, t) for i, (b, t) in enumerate(grads)))


# -- closed forms ---------------------------------------------------------------------------
def test_single_worker_step_is_compute() -> None:
    prof, _ = model_profile("efficientnet-b0", PRESETS["p4d.24xlarge"])
    for s in STRATEGIES.values():
        r = step_time(prof, PRESETS["p4d.24xlarge"], s, 1, local=1)
        assert r.step_s == pytest.approx(prof.compute_s, rel=1e-12)
        assert r.comm_s == 0 and r.overlap == 1.0


def test_one_node_zero_latency_step_is_compute() -> None:
    hw = _ideal()
    prof, _ = model_profile("efficientnet-b0", hw, batch=4)
    for name in ("shoal", "shoal-ring", "shoal-pipelined"):
        r = simulate_step(prof, hw, STRATEGIES[name], 1, local=2)
        assert r.step_s == pytest.approx(prof.compute_s, rel=1e-9), name
        assert r.overlap == pytest.approx(1.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_bandwidth_bound_ring_closed_form(n: int) -> None:
    nbytes, bw, lat = 64 << 20, 1.25e9, 20e-6
    expect = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    assert ring_time(nbytes, n, bw, lat) == pytest.approx(expect)
    hw = _ideal(nic=Link(bw, lat))
    # one rank per node: shoal's flat ring and hierarchical are this ring across nodes
    assert flat_ring_time(hw, nbytes, n, 1) == pytest.approx(expect)
    assert allreduce_time("hierarchical", hw, nbytes, n, 1) == pytest.approx(expect)
    # a pipelined NCCL ring with one GPU per node pays the same latency sum
    gpu = PRESETS["p4d.24xlarge"].replace(nic=Link(bw, lat), pcie_bw=INF)
    assert nccl_ring_time(gpu, nbytes, n, 1) == pytest.approx(expect)


def test_hierarchical_carries_2_m_minus_1_over_m() -> None:
    hw = _ideal(nic=Link(1e8, 0.0))
    for m in (2, 4, 8):
        t = allreduce_time("hierarchical", hw, 64 << 20, m, 4)
        assert t == pytest.approx(2 * (m - 1) / m * (64 << 20) / 1e8, rel=1e-9)


def test_small_messages_use_recursive_doubling() -> None:
    hw = _ideal(nic=Link(1e9, 50e-6))
    assert flat_ring_time(hw, 4096, 8, 1) == pytest.approx(doubling_time(4096, 8, 1e9, 50e-6))
    assert doubling_time(4096, 8, 1e9, 50e-6) == pytest.approx(3 * (50e-6 + 4096 / 1e9))
    assert doubling_time(4096, 6, 1e9, 0.0) == pytest.approx(4 * 4096 / 1e9)  # 2 + fold


def test_one_gradient_step_closed_form() -> None:
    hw = _ideal(nic=Link(1e9, 1e-4))
    prof = _profile([(8 << 20, 0.02)])
    s = STRATEGIES["shoal-ring"]
    r = simulate_step(prof, hw, s, 4, local=1)
    ring = ring_time(8 << 20, 4, 1e9, 1e-4)
    neg = 2 * (1e-4 + 0.0)  # two exchanges across nodes, free messages
    assert r.step_s == pytest.approx(0.01 + 0.02 + neg + ring)  # caller drives at once
    assert r.exposed_s == pytest.approx(neg + ring) and r.overlap == pytest.approx(0.0)
    assert (r.rounds, r.buffers) == (1, 1)


def test_fusion_threshold_and_cycle() -> None:
    assert _fuse([4, 4, 4, 4], 8) == [[4, 4], [4, 4]]
    assert _fuse([10, 1, 1], 8) == [[10], [1, 1]]
    hw = _ideal()
    # gradients 0.1 ms apart, 1 ms cycle: the first round takes what arrived in the cycle
    prof = _profile([(1000, 1e-4)] * 30)
    r = simulate_step(prof, hw, STRATEGIES["shoal"], 2, local=2)
    assert r.rounds < 30 and r.buffers == r.rounds
    r1 = simulate_step(prof, hw, STRATEGIES["shoal"].replace(fusion_bytes=1000), 2, local=2)
    assert r1.buffers == 30


# -- properties of the scaling curves -------------------------------------------------------
def test_never_super_linear() -> None:
    t0 = time.perf_counter()
    for hw in PRESETS.values():
        for model in ("efficientnet-b0", "efficientnet-b4"):
            prof, ceiling = model_profile(model, hw)
            for cap in (None, ceiling):
                rows = scaling(prof, hw, list(STRATEGIES.values()), input_ceiling=cap)
                for r in rows:
                    assert r.efficiency <= 1 + 1e-9, (hw.name, model, r)
                    assert 0 <= r.result.overlap <= 1
                    assert r.result.step_s >= r.result.compute_s - 1e-12
    assert time.perf_counter() - t0 < 10


def test_shoal_beats_horovod_at_8_p4d_nodes() -> None:
    hw = PRESETS["p4d.24xlarge"]
    prof, _ = model_profile("efficientnet-b0", hw)
    rows = {r.strategy: r for r in scaling(prof, hw, [STRATEGIES["shoal"],
                                                      STRATEGIES["horovod"]], [1, 8])
            if r.nodes == 8}
    assert rows["shoal"].efficiency > 0.97  # SMDDP: > 97%
    assert 0.92 < rows["horovod"].efficiency < 0.96  # SMDDP's Horovod: 94%
    assert rows["shoal"].result.throughput > rows["horovod"].result.throughput


# -- presets --------------------------------------------------------------------------------
def test_presets_load() -> None:
    for hw in PRESETS.values():
        assert hw.workers_per_node >= 1 and hw.nic.bandwidth > 0 and hw.sources
        for model, tensors, params in (("efficientnet-b0", 213, 5288548),
                                       ("efficientnet-b4", 418, 19341616)):
            prof, _ = model_profile(model, hw)
            assert len(prof.gradients) == tensors
            assert prof.grad_bytes == 4 * params
            assert prof.forward_s > 0 and prof.backward_s == pytest.approx(2 * prof.forward_s)
            assert all(g.backward_s >= 0 for g in prof.gradients)
            assert prof.gradients[0].name == "classifier.bias"  # backward order
    # the published multiply-adds: B0 0.39 G, B4 4.2 G
    assert sum(c.flops for c in efficientnet_costs("efficientnet-b0")) / 2 == \
        pytest.approx(0.39e9, rel=0.1)
    assert sum(c.flops for c in efficientnet_costs("efficientnet-b4")) / 2 == \
        pytest.approx(4.2e9, rel=0.12)
    b0, _ = model_profile("efficientnet-b0", PRESETS["p4d.24xlarge"])
    assert b0.batch / b0.compute_s == pytest.approx(3450)  # NVIDIA's A100 AMP figure


# -- timeline profiles ----------------------------------------------------------------------
def _write_trace(path: str, close: bool = True) -> None:
    tl = Timeline(path, 0)
    t0 = time.perf_counter()
    names = ["fc.bias", "fc.weight", "conv.weight"]
    offsets = [0.0, 0.001, 0.004]  # seconds after the step's first gradient
    for step in range(3):  # step 0 (full negotiation) is slower; the loader drops it
        base = t0 + step * 0.1
        for name, off in zip(names, offsets, strict=True):
            late = 0.002 if step == 0 and off > 0 else 0.0
            tl.span(tl.track("allreduce", name), "QUEUE", base + off + late, base + 0.006)
        tl.span("fusion buffers", "ALLREDUCE", base + 0.006, base + 0.007, buffer=step + 1,
                tensors=names, bytes=4000 + 40000 + 123456)
    if close:
        tl.close()
    else:
        tl._file.flush()  # what a crashed process leaves behind


@pytest.mark.parametrize("close", [True, False])
def test_timeline_profile(tmp_path, close: bool) -> None:
    path = str(tmp_path / "tl.json")
    _write_trace(path, close)
    prof = load_timeline(path, batch=4, sizes={"fc.bias": 4000, "fc.weight": 40000})
    assert [g.name for g in prof.gradients] == ["fc.bias", "fc.weight", "conv.weight"]
    assert [g.nbytes for g in prof.gradients] == [4000, 40000, 123456]  # last from buffers
    gaps = [g.backward_s for g in prof.gradients]
    assert gaps[1] == pytest.approx(0.001, abs=2e-6) and gaps[2] == pytest.approx(0.003,
                                                                                  abs=2e-6)
    assert gaps[0] == pytest.approx(0.002, abs=2e-6)  # the mean gap
    assert prof.forward_s == pytest.approx(prof.backward_s / 2)
    r = step_time(prof, PRESETS["this-machine"], STRATEGIES["shoal"], 2)
    assert r.step_s > prof.compute_s


def test_timeline_without_queue_events(tmp_path) -> None:
    (tmp_path / "x.json").write_text(json.dumps([{"name": "process_name", "ph": "M"}]))
    with pytest.raises(ValueError, match="QUEUE"):
        load_timeline(tmp_path / "x.json")


# -- validation against measurement ---------------------------------------------------------
def test_predicted_allreduce_within_20_percent_of_measured() -> None:
    for v in validate(MEASURED):
        assert abs(v.error) <= 0.20, v
        assert abs(v.predicted_s / v.measured_median_s - 1) <= 0.20, v


# -- calibration and the command ------------------------------------------------------------
def test_solve() -> None:
    assert solve(lambda x: x * x, 2.0, 0.0, 2.0) == pytest.approx(math.sqrt(2), rel=1e-6)


def test_calibration_report() -> None:
    text = "\n".join(calibrate())
    for needle in ("3,450", "20,650", "94%", "97%", "A1", "A2", "A3"):
        assert needle in text


def test_cli(tmp_path, capsys) -> None:
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    assert main(["sim", "--nodes", "1,2,4", "--hardware", "p3dn.24xlarge", "--plot",
                 str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "horovod" in out and "efficiency" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 3 * len(STRATEGIES)
    assert main(["sim", "--validate"]) == 0
    assert main(["sim", "--calibrate"]) == 0
    assert "Calibration" in capsys.readouterr().out


def test_the_per_flow_cap_sets_the_streams_a_cluster_needs(capsys) -> None:
    p4d, tcp = PRESETS["p4d.24xlarge"], PRESETS["tcp-100g"]
    assert p4d.streams_needed(8) == 5  # 400 Gbit/s over 8 ranks at 10 Gbit/s a flow
    assert p4d.replace(flow_cap=5e9 / 8).streams_needed(8) == 10  # outside a placement group
    assert tcp.streams_needed(8) == 2 and tcp.streams_needed(1) == 10
    assert PRESETS["this-machine"].streams_needed(2) == 1  # no cap
    assert p4d.cross_bandwidth(8) == pytest.approx(4 * 10e9 / 8)  # auto's 4 streams: 80%
    assert p4d.cross_bandwidth(8, streams=5) == pytest.approx(50e9 / 8)
    # on the emulated cluster's link capped at a quarter, as in BENCHMARKS.md: one stream per
    # rank gets a quarter of the link, two ranks half; four streams fill it
    box = PRESETS["this-machine"]
    capped = box.replace(flow_cap=box.nic.bandwidth / 4)
    one, four = (hierarchical_time(capped.replace(streams=s), 64 << 20, 2, 2) for s in (1, 4))
    assert one > 1.8 * four
    assert four == pytest.approx(hierarchical_time(box, 64 << 20, 2, 2))
    assert main(["sim", "--hardware", "p4d.24xlarge", "--nodes", "2", "--plot", ""]) == 0
    assert "5 stream(s) per peer fill it (SHOAL_TCP_STREAMS=5); at 4, shoal's TCP gets 80%" \
        in capsys.readouterr().out
    assert main(["sim", "--hardware", "tcp-100g", "--nodes", "2", "--plot", "",
                 "--flow-cap", "5"]) == 0
    assert "3 stream(s) per peer" in capsys.readouterr().out
