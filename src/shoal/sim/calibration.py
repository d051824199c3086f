"""Where the simulator lands against published and measured numbers.

* :func:`calibrate`: EfficientNet-B0 with AMP on p4d.24xlarge against NVIDIA's published
  single-node throughput and against SMDDP's 8-node scaling comparison with Horovod; it solves
  for the assumptions that close each gap and returns them as text lines.
* :func:`validate`: shoal's two multi-node algorithms on the emulated 2-node cluster of
  ``shoal bench cluster`` against the allreduce times measured there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .collectives import allreduce_time, negotiation_time
from .engine_model import STRATEGIES, Strategy, scaling, step_time
from .hardware import PRESETS, Hardware
from .models import StepProfile, model_profile

__all__ = ["MEASURED_CLUSTER", "PUBLISHED", "Validation", "calibrate", "solve", "validate"]

#: Published figures the model is held against.
PUBLISHED = {
    # NVIDIA DeepLearningExamples, EfficientNet-B0, AMP, A100 (batch 256 per GPU)
    "nvidia_b0_1gpu": 3450.0,
    "nvidia_b0_8gpu": 20650.0,
    # SMDDP vs Horovod, EfficientNet-B0 AMP on 8 x p4d.24xlarge (AWS, 2021)
    "smddp_b0_8node_horovod_eff": 0.94,
    "smddp_b0_8node_smddp_eff": 0.97,
    "smddp_b0_speedup": 1.25,  # "up to 25-30% more throughput" (lower end)
}

#: ``shoal bench cluster --sizes 16M --trials 3`` (2 nodes x 2 ranks, tbf 1gbit, link
#: measured 121.27 MB/s), run for the simulator on this machine: min / median seconds.
MEASURED_CLUSTER = {
    "nbytes": 16 << 20, "nodes": 2, "local": 2, "link_Bps": 121266543.6,
    "hierarchical": (0.14243, 0.14334), "ring": (0.22632, 0.25056),
}


def solve(fn: Callable[[float], float], target: float, lo: float, hi: float,
          iterations: int = 30) -> float:
    """Bisection: the ``x`` in [lo, hi] where the monotonic ``fn(x)`` reaches ``target``."""
    f_lo = fn(lo) - target
    for _ in range(iterations):
        mid = (lo + hi) / 2
        f_mid = fn(mid) - target
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2


def _eff8(profile: StepProfile, hw: Hardware, s: Strategy,
          ceiling: float | None = None) -> tuple[float, float]:
    """Efficiency and throughput on 8 nodes."""
    rows = scaling(profile, hw, [s], [1, 8], input_ceiling=ceiling)
    return rows[1].efficiency, rows[1].result.throughput


def calibrate(hw_name: str = "p4d.24xlarge", model: str = "efficientnet-b0") -> list[str]:
    """The calibration report as lines of text (model vs published, and the assumptions)."""
    hw = PRESETS[hw_name]
    prof, ceiling = model_profile(model, hw)
    out = [f"Calibration: {model}, AMP, batch {prof.batch}/GPU on {hw.name} "
           f"({prof.grad_bytes / 1e6:.1f} MB of fp32 gradients, {len(prof.gradients)} tensors)",
           f"compute: {prof.source}; forward {prof.forward_s * 1e3:.1f} ms + backward "
           f"{prof.backward_s * 1e3:.1f} ms per step", ""]
    # 1. NVIDIA, one node
    hvd, shoal, pipe = STRATEGIES["horovod"], STRATEGIES["shoal"], STRATEGIES["shoal-pipelined"]
    one = step_time(prof, hw, hvd, 1, local=1).throughput
    node = step_time(prof, hw, hvd, 1).throughput
    capped = step_time(prof, hw, hvd, 1, input_ceiling=ceiling).throughput
    nv1, nv8 = PUBLISHED["nvidia_b0_1gpu"], PUBLISHED["nvidia_b0_8gpu"]
    ar = allreduce_time("nccl", hw, prof.grad_bytes, 1, hw.workers_per_node)
    out += ["1. NVIDIA DeepLearningExamples, A100 AMP, one node (modelled as Horovod + NCCL)",
            f"   1 GPU : published {nv1:8,.0f} img/s   model {one:8,.0f} "
            f"(the calibration input: time per image = 1/{nv1:,.0f} s)",
            f"   8 GPUs: published {nv8:8,.0f} img/s   model {node:8,.0f} "
            f"({node / nv8 - 1:+.0%}; {node / (8 * one):.1%} of 8 x 1 GPU vs published "
            f"{nv8 / (8 * nv1):.1%})",
            f"   -> all {prof.grad_bytes / 1e6:.0f} MB over NVSwitch take {ar * 1e3:.2f} ms of a "
            f"{prof.compute_s * 1e3:.0f} ms step: communication cannot lose 25%.",
            f"   A1: the node's input pipeline (JPEG decode, augmentation on the host) caps it at "
            f"{ceiling or 0:,.0f} img/s -> model {capped:,.0f} img/s.", ""]
    # 2. SMDDP vs Horovod on 8 nodes
    raw_hvd = hvd.replace(compute_slowdown=0.0)
    e_raw, _ = _eff8(prof, hw, raw_hvd)
    e_hvd, t_hvd = _eff8(prof, hw, hvd)
    e_sh, t_sh = _eff8(prof, hw, shoal)
    e_pipe, t_pipe = _eff8(prof, hw, pipe)
    e_cap, _ = _eff8(prof, hw, hvd, ceiling)
    target = PUBLISHED["smddp_b0_8node_horovod_eff"]
    fit = solve(lambda x: -_eff8(prof, hw, hvd.replace(compute_slowdown=x))[0], -target,
                0.0, 1.0)
    out += ["2. SMDDP vs Horovod, 8 x p4d.24xlarge (efficiency = throughput / 8 x one node)",
            f"   Horovod: published {target:.0%}   model {e_raw:.1%} with NCCL leaving "
            f"backward alone; {e_hvd:.1%} with A2",
            f"   A2: NCCL kernels slow the backward they overlap by "
            f"{hvd.compute_slowdown:.0%} (fitted: {fit:.3f} gives {target:.0%}; NCCL holds "
            f"~16 of 108 SMs)",
            f"   SMDDP  : published >{PUBLISHED['smddp_b0_8node_smddp_eff']:.0%}  "
            f"model shoal {e_sh:.1%}, shoal-pipelined {e_pipe:.1%} (host-staged, GPU "
            f"keeps computing)",
            f"   with A1 as well every library shows {e_cap:.0%}: the ceiling hides all "
            f"communication, so the published 94% says those runs were not input-bound.",
            f"   throughput shoal / Horovod on 8 nodes: model {t_sh / t_hvd - 1:+.1%} "
            f"(pipelined {t_pipe / t_hvd - 1:+.1%}); published up to +25-30%."]
    need = PUBLISHED["smddp_b0_speedup"]
    slow = solve(lambda x: t_sh / _eff8(prof, hw, hvd.replace(compute_slowdown=x))[1], need,
                 0.0, 3.0)
    e_at = _eff8(prof, hw, hvd.replace(compute_slowdown=slow))[0]
    out += [f"   A3: 97% vs 94% alone is only {0.97 / 0.94 - 1:+.1%}; +{need - 1:.0%} needs "
            f"Horovod slower on one node too. In the model that takes a slowdown of "
            f"{slow:.2f} (Horovod then scales at {e_at:.1%}, not 94%): the two claims do not "
            f"hold together for B0 at this batch size; +25-30% must come from other models, "
            f"batch sizes or node counts.", ""]
    out += ["Assumptions: identical workers (no stragglers); backward = 2 x forward FLOPs; "
            "per-layer time from a roofline scaled to the calibrated total; fp32 gradients "
            "(PyTorch AMP); Horovod >= 0.21 defaults (1 ms cycle, 128 MB fusion); NCCL ring "
            "(no trees); the optimizer step and host<->device copies of inputs not modelled."]
    return out


@dataclass(frozen=True)
class Validation:
    """A predicted allreduce time against the measured one."""

    algorithm: str
    predicted_s: float
    measured_min_s: float
    measured_median_s: float

    @property
    def error(self) -> float:
        """Relative error against the measured minimum."""
        return self.predicted_s / self.measured_min_s - 1


def validate(measured: dict | None = None) -> list[Validation]:
    """Predicted vs measured allreduce on the emulated cluster (one negotiation round plus the
    algorithm, as one ``shoal.allreduce`` call costs); the link rate is the measured one."""
    m = measured or MEASURED_CLUSTER
    hw = PRESETS["this-machine"]
    hw = hw.replace(nic=type(hw.nic)(m["link_Bps"], hw.nic.latency))
    out = []
    for algo in ("hierarchical", "ring"):
        t = negotiation_time("decentralized", hw, m["nodes"], m["local"]) + hw.per_collective \
            + allreduce_time(algo, hw, m["nbytes"], m["nodes"], m["local"])
        out.append(Validation(algo, t, *m[algo]))
    return out
