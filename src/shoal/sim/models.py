"""Model descriptions for the simulator: gradients in backward order with their compute times.

A :class:`StepProfile` is what the engine model consumes: per worker and step, the forward
time and, in the order backward produces them, every gradient's size and the backward compute
that ends with it being ready. Profiles come from

* the real layer shapes of the EfficientNet application (:func:`efficientnet_costs`, from
  :func:`shoal.bench.models.param_shapes`): per-module FLOPs and activation bytes on a roofline
  (:func:`compute_profile`), optionally scaled to a measured time per image
  (:data:`CALIBRATIONS`);
* a timeline recorded with ``SHOAL_TIMELINE`` (:func:`load_timeline`): each tensor's ``QUEUE``
  span starts when its gradient was submitted, i.e. became ready.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.bench.models import MODELS, param_shapes

from .hardware import Device, Hardware

__all__ = ["CALIBRATIONS", "MODELS", "RESOLUTION", "Calibration", "Gradient", "StepProfile",
           "TensorCost", "compute_profile", "efficientnet_costs", "load_timeline",
           "model_profile"]

#: Input resolution of each preset (Tan & Le 2019, compound-scaling table).
RESOLUTION = {"efficientnet-b0": 224, "efficientnet-b4": 380}
#: Stride of the first block of each of EfficientNet's seven stages (same for every variant).
STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
#: Per-GPU batch when no calibration names one (NVIDIA's AMP recipes use 256 for B0).
DEFAULT_BATCH = {"efficientnet-b0": 256, "efficientnet-b4": 64}
BACKWARD_OVER_FORWARD = 2.0  # backward computes input and weight gradients: ~2x the forward


@dataclass(frozen=True)
class Gradient:
    """One gradient tensor: its size and the backward compute that ends with it ready."""

    name: str
    nbytes: int
    backward_s: float


@dataclass(frozen=True)
class StepProfile:
    """One worker's training step: forward time, then gradients in backward order."""

    name: str
    batch: int
    forward_s: float
    gradients: tuple[Gradient, ...]
    source: str = ""

    @property
    def backward_s(self) -> float:
        """Total backward compute."""
        return sum(g.backward_s for g in self.gradients)

    @property
    def compute_s(self) -> float:
        """Forward plus backward: the step time of one worker alone."""
        return self.forward_s + self.backward_s

    @property
    def grad_bytes(self) -> int:
        """Bytes allreduced per step."""
        return sum(g.nbytes for g in self.gradients)


@dataclass(frozen=True)
class TensorCost:
    """A parameter tensor in registration order, with the forward cost per image of the work
    whose backward ends with this gradient ready (zero for a module's other tensors)."""

    name: str
    numel: int
    flops: float
    act_bytes: float  # activation elements moved (multiplied by the device's bytes/element)


def efficientnet_costs(model: str) -> list[TensorCost]:
    """Per-tensor forward FLOPs and activation traffic of an EfficientNet preset.

    Spatial sizes follow the network: stem stride 2, the first block of each stage strides as
    in :data:`STAGE_STRIDES` (a stage starts where a block's output channels change), 1x1 SE
    convolutions on pooled features. A conv counts 2 FLOPs per multiply-add; BatchNorm and
    swish four passes over their activation (unfused, as eager frameworks run them); SE adds
    the pooling and the channel scaling.
    """
    shapes = param_shapes(model)
    res = RESOLUTION[model]
    blocks: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes:
        if name.startswith("blocks."):
            _, idx, rest = name.split(".", 2)
            blocks.setdefault(int(idx), {})[rest] = shape
    stride_of: dict[int, int] = {}
    stage, prev_out = -1, None
    for idx in sorted(blocks):
        out = blocks[idx]["project.0.weight"][0]
        first = out != prev_out
        stage += first
        stride_of[idx] = STAGE_STRIDES[min(stage, len(STAGE_STRIDES) - 1)] if first else 1
        prev_out = out
    hw = res // 2  # after the stem
    module_cost: dict[str, tuple[float, float]] = {}  # module -> (flops, act elements)

    def conv(module: str, shape: tuple[int, ...], out_hw: int) -> None:
        macs = math.prod(shape) * out_hw * out_hw  # O x I/g x k x k per output pixel
        module_cost[module] = (2.0 * macs, 2.0 * shape[0] * out_hw * out_hw)

    def norm(module: str, channels: int, at_hw: int) -> None:
        module_cost[module] = (8.0 * channels * at_hw * at_hw, 4.0 * channels * at_hw * at_hw)

    for name, shape in shapes:
        module = name.rsplit(".", 1)[0]
        if module in module_cost:
            continue
        if module == "stem.0":
            conv(module, shape, hw)
        elif module in ("stem.1", "head.1"):
            norm(module, shape[0], hw)
        elif module.startswith("blocks."):
            idx = int(module.split(".")[1])
            part = module.split(".", 2)[2]
            st = stride_of[idx]
            out_hw = -(-hw // st)
            if part == "expand.0":
                conv(module, shape, hw)
            elif part == "expand.1":
                norm(module, shape[0], hw)
            elif part == "depthwise.0":
                conv(module, shape, out_hw)
            elif part in ("depthwise.1", "project.1"):
                norm(module, shape[0], out_hw)
            elif part == "se.reduce":  # pooling reads the activation once
                mid = shape[1]
                module_cost[module] = (2.0 * math.prod(shape) + mid * out_hw ** 2,
                                       1.0 * mid * out_hw ** 2)
            elif part == "se.expand":  # x * sigmoid(s): read x, write the product
                mid = shape[0]
                module_cost[module] = (2.0 * math.prod(shape) + mid * out_hw ** 2,
                                       2.0 * mid * out_hw ** 2)
            elif part == "project.0":
                conv(module, shape, out_hw)
                hw = out_hw  # the block's output resolution
            else:  # pragma: no cover - a new kind of tensor in the preset
                raise ValueError(f"{model}: no cost rule for {name}")
        elif module == "head.0":
            hw = -(-res // 32)
            conv(module, shape, hw)
        elif module == "classifier":  # global pool over the head's output, then the FC
            module_cost[module] = (2.0 * math.prod(shape) + shape[1] * hw * hw,
                                   1.0 * shape[1] * hw * hw)
        else:  # pragma: no cover
            raise ValueError(f"{model}: no cost rule for {name}")
    out: list[TensorCost] = []
    last_of = {name.rsplit(".", 1)[0]: name for name, _ in shapes}  # first in backward
    for name, shape in shapes:
        module = name.rsplit(".", 1)[0]
        flops, act = module_cost[module] if last_of[module] == name else (0.0, 0.0)
        out.append(TensorCost(name, math.prod(shape), flops, act))
    return out


def compute_profile(costs: Sequence[TensorCost], device: Device, batch: int, *,
                    time_per_image: float | None = None, grad_bytes: int = 4,
                    name: str = "model") -> StepProfile:
    """A step profile from per-tensor costs on ``device``'s roofline.

    Each module takes ``max(FLOPs / peak, bytes / memory bandwidth)`` forward and
    :data:`BACKWARD_OVER_FORWARD` times that backward. With ``time_per_image`` (forward plus
    backward, measured or published) every time is scaled so the total matches it: the
    roofline then only sets how the compute is spread over the layers.
    """
    fwd = [max(c.flops / device.flops, c.act_bytes * device.act_bytes / device.mem_bw)
           for c in costs]
    per_image = (1.0 + BACKWARD_OVER_FORWARD) * sum(fwd)
    scale = time_per_image / per_image if time_per_image else 1.0
    grads = tuple(Gradient(c.name, c.numel * grad_bytes,
                           f * BACKWARD_OVER_FORWARD * scale * batch)
                  for c, f in zip(reversed(costs), reversed(fwd), strict=True))
    source = f"roofline on {device.name}" + (
        f", scaled to {time_per_image * 1e3:.3g} ms/image" if time_per_image else "")
    return StepProfile(name, batch, sum(fwd) * scale * batch, grads, source)


@dataclass(frozen=True)
class Calibration:
    """A measured or published compute speed of a model on a hardware preset."""

    time_per_image: float            # forward + backward, one worker, seconds
    batch: int                       # per worker
    node_input_ceiling: float | None  # images/s one node's input pipeline can feed, if bound
    source: str


#: Calibrated compute speeds. NVIDIA's EfficientNet-B0 AMP on A100: ~3,450 images/s on one
#: GPU and ~20,650 on eight (DeepLearningExamples, EfficientNet performance tables, batch 256).
#: The 8-GPU figure is 75% of 8 x 1 GPU; communication over NVSwitch cannot explain that (the
#: simulator predicts > 99%), so it is modelled as the node's input pipeline ceiling.
CALIBRATIONS: dict[tuple[str, str], Calibration] = {
    ("p4d.24xlarge", "efficientnet-b0"): Calibration(
        1 / 3450, 256, 20650.0, "NVIDIA DeepLearningExamples, A100 AMP: 3,450 img/s per GPU; "
        "20,650 img/s per 8-GPU node taken as the input-pipeline ceiling"),
    ("this-machine", "efficientnet-b0"): Calibration(
        0.19, 16, None, "measured here: torch 2.13 fp32 forward+backward, batch 8, 2 threads: "
        "0.097 s/image; one rank per core -> ~0.19 s/image"),
}


def model_profile(model: str, hw: Hardware, *, batch: int | None = None,
                  time_per_image: float | None = None,
                  grad_bytes: int = 4) -> tuple[StepProfile, float | None]:
    """The profile of a preset model on ``hw`` and the node's input ceiling (images/s).

    Without a calibration for (``hw``, ``model``), the achieved fraction of the roofline is
    borrowed from another model on ``hw`` or, failing that, from the same kind of device
    (GPU or CPU) elsewhere; with no calibration at all the roofline alone gives the time.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    costs = efficientnet_costs(model)
    cal = CALIBRATIONS.get((hw.name, model))
    ceiling = cal.node_input_ceiling if cal else None
    tpi = time_per_image or (cal.time_per_image if cal else None)
    if tpi is None:  # borrow the achieved fraction of the roofline from a calibrated pair
        from .hardware import PRESETS
        pairs = sorted(CALIBRATIONS.items(), key=lambda kv: (kv[0][0] != hw.name,
                                                             kv[0][1] != model))
        for (hw_name, other), c in pairs:
            other_hw = PRESETS.get(hw_name)
            if other_hw is None or (hw_name != hw.name and other_hw.gpu != hw.gpu):
                continue
            achieved = c.time_per_image / compute_profile(
                efficientnet_costs(other), other_hw.device, 1).compute_s
            tpi = compute_profile(costs, hw.device, 1).compute_s * achieved
            if hw_name == hw.name and c.node_input_ceiling:
                ceiling = c.node_input_ceiling * c.time_per_image / tpi
            break
    b = batch or (cal.batch if cal else DEFAULT_BATCH[model] if hw.gpu else 16)
    return compute_profile(costs, hw.device, b, time_per_image=tpi, grad_bytes=grad_bytes,
                           name=model), ceiling


def _read_trace(path: str | Path) -> list[dict]:
    text = Path(path).read_text().strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # the process died before close(): complete the array
        data = json.loads(text.rstrip(",") + "\n]")
    return data["traceEvents"] if isinstance(data, dict) else data


def load_timeline(path: str | Path, *, batch: int = 1, sizes: Mapping[str, int] | None = None,
                  forward_s: float | None = None) -> StepProfile:
    """A step profile from a ``SHOAL_TIMELINE`` Chrome trace (one rank's process).

    Each tensor's ``QUEUE`` span starts when it was submitted, i.e. when backward produced
    it; the k-th occurrence of every name belongs to step k. Ready offsets within a step are
    the median over steps (the first step, which negotiates every name in full, is left out
    when there are three or more). Sizes come from ``sizes`` or, failing that, from the fusion
    buffers' byte counts (shared equally by the tensors of a buffer not otherwise known). The
    trace does not show the forward pass nor the compute before the first gradient: the first
    gradient is given the mean gap and ``forward_s`` defaults to half the backward time.
    """
    events = _read_trace(path)
    tracks: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
    queues = [e for e in events if e.get("name") == "QUEUE" and e.get("ph") == "X"]
    if not queues:
        raise ValueError(f"{path}: no QUEUE events; was it written by SHOAL_TIMELINE?")
    pid = min(e["pid"] for e in queues)
    named = set(sizes or {}) | {n for e in events if e.get("name") == "ALLREDUCE" and
                                isinstance(e.get("args", {}).get("tensors"), list)
                                for n in e["args"]["tensors"]}

    def tensor(track: str) -> str:  # tracks are <kind>.<name>, as Horovod's
        plain = track.removeprefix("allreduce.")
        return plain if track not in named and plain in named else track

    starts: dict[str, list[float]] = {}
    for e in sorted((e for e in queues if e["pid"] == pid), key=lambda e: e["ts"]):
        track = tracks.get((pid, e["tid"]), str(e["tid"]))
        starts.setdefault(tensor(track), []).append(e["ts"])
    steps = min(len(v) for v in starts.values())
    first = 1 if steps >= 3 else 0
    offsets: dict[str, list[float]] = {n: [] for n in starts}
    for k in range(first, steps):
        t0 = min(v[k] for v in starts.values())
        for n, v in starts.items():
            offsets[n].append(v[k] - t0)
    ready = sorted((statistics.median(v) * 1e-6, n) for n, v in offsets.items())
    known = dict(sizes or {})
    for e in events:
        if e.get("name") == "ALLREDUCE" and e.get("pid") == pid and \
                tracks.get((pid, e.get("tid"))) == "fusion buffers":
            names, total = e["args"]["tensors"], int(e["args"]["bytes"])
            unknown = [n for n in names if n not in known]
            if unknown:
                share = (total - sum(known[n] for n in names if n in known)) // len(unknown)
                known.update({n: share for n in unknown})
    missing = [n for _, n in ready if n not in known]
    if missing:
        raise ValueError(f"{path}: no size for {missing[:3]}...; pass sizes=")
    span = ready[-1][0] - ready[0][0]
    gap = span / (len(ready) - 1) if len(ready) > 1 else 0.0
    grads = []
    prev = ready[0][0] - gap
    for t, n in ready:
        grads.append(Gradient(n, known[n], t - prev))
        prev = t
    bwd = sum(g.backward_s for g in grads)
    return StepProfile(Path(path).stem, batch, bwd / 2 if forward_s is None else forward_s,
                       tuple(grads), f"timeline {path} ({steps - first} steps)")
