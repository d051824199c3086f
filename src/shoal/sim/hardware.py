"""Hardware presets for the scaling simulator: one node's devices, memory and links.

A :class:`Hardware` describes one node type (every node of a simulated cluster is the same):
how many workers it runs, what one worker computes with (:class:`Device`, for the FLOP-based
compute estimate), how fast its host moves memory (the ``shm`` path and the host side of
``hierarchical``), its device interconnect (NVLink/NVSwitch; ``None`` when the workers are host
processes), host<->device PCIe, the node's network link and the software costs of the engine.

Bandwidths are bytes per second in one direction; latencies are seconds per message (one hop,
or one synchronous step of an algorithm). Every number carries its source in a comment: a
vendor's specification, a measurement in ``BENCHMARKS.md`` / ``DESIGN.md`` on this machine, or
an explicit assumption.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "Device", "Hardware", "Link", "get_hardware"]

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A point-to-point path: bandwidth (bytes/s, one direction) and latency (s/message)."""

    bandwidth: float
    latency: float

    def time(self, nbytes: float) -> float:
        """Time to move ``nbytes`` as one message."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Device:
    """What one worker computes with: a roofline (peak FLOP/s and memory bytes/s).

    Only the *distribution* of compute over layers comes from the roofline when a model is
    calibrated with a measured time per image; uncalibrated, it is also the absolute time.
    """

    name: str
    flops: float           # peak FLOP/s at the training precision
    mem_bw: float          # device memory bandwidth, bytes/s
    act_bytes: int = 2     # bytes per activation element (2 with AMP, 4 in fp32)


@dataclass(frozen=True)
class Hardware:
    """One node type of a simulated cluster (see the module docstring for units)."""

    name: str
    description: str
    workers_per_node: int
    cores_per_node: int
    device: Device
    # host shared memory: an allreduce moves each byte ``shm_base + shm_per_peer (G-1)/G``
    # times through one core's copy bandwidth (copy in, reduce, copy out; fitted to
    # BENCHMARKS.md), never faster than the node's aggregate memory bandwidth allows
    host_copy_bw: float
    host_mem_bw: float
    shm_sync: float        # one shared-memory flag round (arrive/reduced)
    nic: Link              # the node's network link, per direction
    tcp_loopback: Link     # TCP between two processes of one node (shoal's flat ring hops)
    device_link: Link | None = None   # NVLink/NVSwitch per GPU, per direction
    pcie_bw: float | None = None      # host<->device per GPU, per direction
    per_tensor: float = 5e-6          # engine software cost per tensor in a round
    per_collective: float = 20e-6     # per fused collective (Python call, launch, bookkeeping)
    ctrl_msg: float = 5e-6            # CPU cost to send or receive one control message
    shm_base: float = 1.0
    shm_per_peer: float = 1.8
    shm_chunk: int = 1 << 20          # SHOAL_SHM_CHUNK_BYTES (the hierarchical pipeline unit)
    small_message: int = 64 << 10     # SHOAL_SMALL_MESSAGE_BYTES (doubling below, ring above)
    # what the network lets one TCP connection carry (bytes/s; None: the NIC), and shoal's
    # TCP streams per peer on another host (SHOAL_TCP_STREAMS; auto opens 4)
    flow_cap: float | None = None
    streams: int = 4
    sources: tuple[str, ...] = ()

    @property
    def gpu(self) -> bool:
        """True when workers drive accelerators (gradients start in device memory)."""
        return self.device_link is not None

    def cross_bandwidth(self, concurrent: int, nic_efficiency: float = 1.0,
                        streams: int | None = None) -> float:
        """What each of ``concurrent`` ranks sending across the NIC at once gets: its share of
        the link, at most ``streams`` (default :attr:`streams`) connections at the per-flow
        cap."""
        share = self.nic.bandwidth * nic_efficiency / max(1, concurrent)
        if self.flow_cap is None:
            return share
        return min(share, (streams or self.streams) * self.flow_cap)

    def streams_needed(self, concurrent: int) -> int:
        """The fewest TCP streams per peer with which ``concurrent`` ranks crossing at once
        fill the NIC under the per-flow cap (1 without a cap)."""
        if self.flow_cap is None:
            return 1
        return max(1, math.ceil(self.nic.bandwidth / (concurrent * self.flow_cap) - 1e-9))

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some fields changed (for sweeps and what-if calibration)."""
        return dataclasses.replace(self, **changes)


A100 = Device("A100-SXM4-40GB (AMP)",
              flops=312e12,       # NVIDIA A100 datasheet: FP16 tensor core, dense
              mem_bw=1555 * GB,   # A100 40GB datasheet: HBM2 1,555 GB/s
              act_bytes=2)
V100 = Device("V100-SXM2-32GB (AMP)",
              flops=125e12,       # NVIDIA V100 datasheet: tensor performance
              mem_bw=900 * GB,    # V100 datasheet: HBM2 900 GB/s
              act_bytes=2)
CPU_CORE = Device("one core of this machine (fp32)",
                  flops=50e9,     # assumption: one AVX2 core, ~50 GFLOP/s fp32 peak
                  mem_bw=7.2 * GB,  # BENCHMARKS.md: numpy.copyto of 64 MiB in 9.27 ms
                  act_bytes=4)

PRESETS: dict[str, Hardware] = {
    "p4d.24xlarge": Hardware(
        name="p4d.24xlarge",
        description="8 x A100 40GB, NVSwitch, 4 x 100 Gbit/s EFA (400 Gbit/s)",
        workers_per_node=8,       # AWS EC2 P4 instance page: 8 x A100
        cores_per_node=48,        # 96 vCPUs (2 x Xeon 8275CL, 24 cores each)
        device=A100,
        host_copy_bw=10 * GB,     # assumption: one Cascade Lake core's memcpy rate
        host_mem_bw=200 * GB,     # assumption: 2 sockets x 6 ch DDR4-2933 (~280 peak, ~70%)
        shm_sync=2e-6,            # assumption: flag round on a cache line, spinning
        nic=Link(50 * GB,         # AWS: 400 Gbit/s EFA per p4d.24xlarge = 50 GB/s
                 15e-6),          # assumption: EFA/SRD one-way small-message latency
        tcp_loopback=Link(5 * GB, 20e-6),   # assumption: kernel TCP between local processes
        device_link=Link(240 * GB,  # AWS/NVIDIA: NVSwitch 600 GB/s bidirectional per GPU;
                                    # nccl-tests allreduce busbw on 8 x A100 is ~230-240 GB/s
                         5e-6),     # assumption: NVLink hop latency incl. kernel step
        pcie_bw=12.5 * GB,        # PCIe Gen4 x16 ~25 GB/s; two GPUs share a PCIe switch
        per_tensor=3e-6,          # assumption: C++-speed engine bookkeeping per tensor
        per_collective=30e-6,     # assumption: launch + fusion-buffer bookkeeping
        ctrl_msg=3e-6,
        flow_cap=10e9 / 8,        # AWS: a TCP flow is held to 10 Gbit/s inside a cluster
                                  # placement group (5 Gbit/s outside); EFA's SRD is not
        sources=("https://aws.amazon.com/ec2/instance-types/p4/",
                 "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
                 "ec2-instance-network-bandwidth.html (per-flow limits)",
                 "https://www.nvidia.com/en-us/data-center/a100/",
                 "https://github.com/NVIDIA/nccl-tests (busbw definition)"),
    ),
    "p3dn.24xlarge": Hardware(
        name="p3dn.24xlarge",
        description="8 x V100 32GB, NVLink hybrid cube mesh, 100 Gbit/s EFA",
        workers_per_node=8,       # AWS EC2 P3 instance page: 8 x V100 32GB
        cores_per_node=48,        # 96 vCPUs (2 x Xeon 8175M)
        device=V100,
        host_copy_bw=8 * GB,      # assumption: one Skylake core's memcpy rate
        host_mem_bw=150 * GB,     # assumption: 2 sockets x 6 ch DDR4-2666, ~70% of peak
        shm_sync=2e-6,
        nic=Link(12.5 * GB,       # AWS: 100 Gbit/s networking (EFA) = 12.5 GB/s
                 18e-6),          # assumption: first-generation EFA latency
        tcp_loopback=Link(4 * GB, 20e-6),
        device_link=Link(130 * GB,  # NVIDIA DGX-1V: 300 GB/s NVLink per GPU (6 links,
                                    # hybrid cube mesh); nccl-tests busbw ~130 GB/s
                         6e-6),
        pcie_bw=6 * GB,           # PCIe Gen3 x16 ~12 GB/s shared by two GPUs per switch
        per_tensor=3e-6,
        per_collective=30e-6,
        ctrl_msg=3e-6,
        flow_cap=10e9 / 8,        # AWS: 10 Gbit/s per TCP flow in a cluster placement group
        sources=("https://aws.amazon.com/ec2/instance-types/p3/",
                 "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
                 "ec2-instance-network-bandwidth.html (per-flow limits)",
                 "https://www.nvidia.com/en-us/data-center/v100/"),
    ),
    "this-machine": Hardware(
        name="this-machine",
        description="the project's 2-core box as a node: 2 ranks, shm, 1 Gbit/s tbf link",
        workers_per_node=2,       # shoal bench cluster: 2 ranks per emulated node
        cores_per_node=2,         # DESIGN.md: 2 cores, no GPU
        device=CPU_CORE,
        host_copy_bw=7.2 * GB,    # BENCHMARKS.md: memcpy 64 MiB in 9.27 ms
        host_mem_bw=14.4 * GB,    # BENCHMARKS.md: 2 ranks x 64 MiB shm in 17.4 ms = 1.9
                                  # memcpy each, in parallel: both cores copy at full rate
        shm_sync=5e-6,            # DESIGN.md: a spin round costs about 5 us
        nic=Link(121.3e6,         # shoal bench cluster: tbf 1gbit, one TCP stream measured
                                  # 0.97 Gbit/s (results in tests/test_sim.py)
                 100e-6),         # assumption: Python exchange() on a veth pair, per step
        tcp_loopback=Link(2 * GB,  # DESIGN.md: loopback TCP ~2 GB/s for 64 MiB messages
                          50e-6),
        per_tensor=15e-6,         # DESIGN.md: 213 tensors one by one cost 61 ms more than
                                  # fused over gloo; shoal's per-tensor bookkeeping is a
                                  # fraction of that (assumption: 15 us in Python)
        per_collective=30e-6,     # BENCHMARKS.md: a 4 KiB shm allreduce takes 17 us
        ctrl_msg=10e-6,           # assumption: Python socket send/recv of a few bytes
        shm_base=1.0, shm_per_peer=1.8,  # BENCHMARKS.md: 2 ranks 1.9 memcpy, 4 ranks on
                                         # 2 cores 4.0 memcpy (2.35 per rank, x2 oversubscribed)
        sources=("BENCHMARKS.md (shoal bench allreduce)", "DESIGN.md (measured facts)",
                 "shoal bench cluster --sizes 16M --trials 3"),
    ),
}


PRESETS["tcp-100g"] = PRESETS["p4d.24xlarge"].replace(
    name="tcp-100g",
    description="8 x A100 40GB, NVSwitch, 100 Gbit/s TCP (a cloud VM without EFA/RDMA)",
    nic=Link(12.5 * GB,           # 100 Gbit/s
             30e-6),              # assumption: kernel TCP one-way small-message latency
    flow_cap=10e9 / 8,            # assumption: EC2's in-placement-group 10 Gbit/s per flow
    sources=("assumption: p4d.24xlarge's node on a 100 Gbit/s TCP network",
             "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
             "ec2-instance-network-bandwidth.html (per-flow limits)"))


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(PRESETS)}") from None
