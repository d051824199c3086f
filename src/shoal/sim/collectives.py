"""Cost models of one fused AllReduce and of one negotiation round.

They mirror shoal's algorithms (``shoal.core.algorithms``):

* ``shm`` (one node): every rank copies the peers' parts of its input into its slot, reduces
  its own part, copies every part out, chunk by chunk, with two flag rounds per chunk;
* ``ring`` (shoal's flat TCP ring): ``2(n-1)`` synchronous steps, each moving ``1/n`` of the
  buffer over the slowest hop; the last block of every reduce-scatter step is reduced after it
  arrives; recursive doubling (``log2 n`` whole-buffer swaps) up to ``small_message`` bytes;
* ``hierarchical``: per ``shm_chunk`` chunk, the shm reduce-scatter, then each local rank
  reduces its shard across the nodes (all local ranks at once, sharing the node's link, ring
  or doubling by shard size), then the shm allgather. ``pipelined=False``: the phases one after
  the other (a serial baseline); ``"phases"`` (shoal): the host's phases of chunks k+1 and
  k-1 run while chunk k crosses the nodes, the cross rings one at a time, each paying its
  latency; ``True``: several chunks in flight across the nodes too, the ring latency paid once
  per buffer (the SMDDP design);
* ``nccl``: a Horovod-style flat ring over every GPU, pipelined as NCCL does it: the latency
  is the sum of hop latencies, not steps times the slowest hop.

Across nodes shoal's TCP is held to its streams times the network's per-flow cap
(:meth:`Hardware.cross_bandwidth`); NCCL's ring is modelled on EFA (SRD), which has none.

On GPU hardware shoal stages gradients through pinned host memory (PCIe both ways) and runs
the host algorithms there; the ``nccl`` ring runs on the devices over NVLink and the NIC.
"""

from __future__ import annotations

import math

from .hardware import Hardware

__all__ = ["ALGORITHMS", "allreduce_time", "doubling_time", "flat_ring_time",
           "hierarchical_time", "nccl_ring_time", "negotiation_time", "ring_time", "shm_time",
           "tcp_ring_time"]

ALGORITHMS = ("shm", "ring", "hierarchical", "nccl")
REDUCE_PASSES = 1.5    # in-place a += b reads two bytes and writes one per byte reduced
TCP_BLOCK = 4 << 20    # SHOAL_TCP_CHUNK_BYTES: the ring reduces received data in such blocks


def ring_time(nbytes: float, n: int, bandwidth: float, step_latency: float) -> float:
    """A synchronous ring: ``2(n-1)`` steps, each paying a latency and moving ``nbytes/n``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * step_latency + 2 * (n - 1) / n * nbytes / bandwidth


def doubling_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Recursive doubling: ``log2 p`` whole-buffer swaps (``p`` the largest power of two
    <= n) plus a fold-in and a send-back when ``n`` is not a power of two."""
    if n <= 1:
        return 0.0
    p2 = 1 << (n.bit_length() - 1)
    rounds = int(math.log2(p2)) + (2 if n != p2 else 0)
    return rounds * (latency + nbytes / bandwidth)


def _reduce(hw: Hardware, nbytes: float, local: int) -> float:
    """One rank's in-place reduction of ``nbytes`` on the host (cores shared by ``local``)."""
    return REDUCE_PASSES * nbytes / hw.host_copy_bw * max(1.0, local / hw.cores_per_node)


def shm_time(hw: Hardware, nbytes: float, local: int) -> float:
    """shoal's shared-memory allreduce among ``local`` ranks of one host."""
    if local <= 1:
        return 0.0
    passes = hw.shm_base + hw.shm_per_peer * (local - 1) / local
    per_rank = passes * nbytes / hw.host_copy_bw * max(1.0, local / hw.cores_per_node)
    together = local * passes * nbytes / hw.host_mem_bw
    chunks = max(1, math.ceil(nbytes / hw.shm_chunk))
    return max(per_rank, together) + 2 * chunks * hw.shm_sync


def tcp_ring_time(hw: Hardware, nbytes: float, n: int, bandwidth: float, latency: float,
                  local: int = 1) -> float:
    """shoal's ring (or doubling below ``small_message``) over TCP among ``n`` ranks whose
    hop has ``bandwidth`` and ``latency``; ``local`` ranks share a host's cores."""
    if n <= 1:
        return 0.0
    if nbytes <= hw.small_message:
        return doubling_time(nbytes, n, bandwidth, latency) + \
            math.log2(1 << (n.bit_length() - 1)) * _reduce(hw, nbytes, local)
    tail = (n - 1) * _reduce(hw, min(TCP_BLOCK, nbytes / n), local)
    return ring_time(nbytes, n, bandwidth, latency) + tail


def _staging(hw: Hardware, nbytes: float) -> float:
    """Device -> pinned host and back (every GPU at once over its share of PCIe)."""
    return 2 * nbytes / hw.pcie_bw if hw.gpu and hw.pcie_bw else 0.0


def flat_ring_time(hw: Hardware, nbytes: float, nodes: int, local: int,
                   nic_efficiency: float = 1.0) -> float:
    """shoal's ``ring``: every rank in one TCP ring; each step waits for the slowest hop."""
    n = nodes * local
    hops = []
    if local > 1:
        hops.append((hw.tcp_loopback.bandwidth, hw.tcp_loopback.latency))
    if nodes > 1:  # one rank per node sends across at a time
        hops.append((hw.cross_bandwidth(1, nic_efficiency), hw.nic.latency))
    if not hops:
        return _staging(hw, nbytes)
    bw = min(b for b, _ in hops)
    lat = max(lat for _, lat in hops)
    return _staging(hw, nbytes) + tcp_ring_time(hw, nbytes, n, bw, lat, local)


def hierarchical_time(hw: Hardware, nbytes: float, nodes: int, local: int,
                      nic_efficiency: float = 1.0, pipelined: bool | str = False) -> float:
    """shoal's ``hierarchical`` (``shm`` on one node)."""
    if nodes <= 1:
        return _staging(hw, nbytes) + shm_time(hw, nbytes, local)
    if local <= 1:  # no shared memory: the cross-node ring is the whole job
        return _staging(hw, nbytes) + tcp_ring_time(
            hw, nbytes, nodes, hw.cross_bandwidth(1, nic_efficiency), hw.nic.latency)
    bw = hw.cross_bandwidth(local, nic_efficiency)  # each local rank's, all crossing at once
    chunks = max(1, math.ceil(nbytes / hw.shm_chunk))
    chunk = nbytes / chunks
    shard = chunk / local  # what each local rank reduces across nodes, all at once
    if shard <= hw.small_message:
        one = doubling_time(shard, nodes, bw, hw.nic.latency)
    else:
        one = tcp_ring_time(hw, shard, nodes, bw, hw.nic.latency, local)
    intra = shm_time(hw, nbytes, local)
    if not pipelined:
        return _staging(hw, nbytes) + intra + chunks * one
    if pipelined == "phases":  # the slower of the two streams sets the pace; the other's
        # share of one chunk fills and drains the pipeline
        cross = chunks * one
        return _staging(hw, nbytes) + max(intra, cross) + min(intra, cross) / chunks
    # overlapped: phases of different chunks run at once; the cross ring's latency is paid
    # once per buffer (several chunks in flight), the slowest phase sets the pace
    latency = one - ring_time(shard, nodes, bw, 0.0) if shard > hw.small_message \
        else one / 2
    phases = [intra, chunks * (one - latency), _staging(hw, nbytes)]
    return max(phases) + latency + (sum(phases) - max(phases)) / chunks


def nccl_ring_time(hw: Hardware, nbytes: float, nodes: int, local: int,
                   nic_efficiency: float = 1.0) -> float:
    """A Horovod/NCCL-style flat ring over all ``n`` GPUs (host TCP ring without GPUs).

    Bandwidth: each node's link carries ``2(n-1)/n`` of the buffer, intra-node hops ride
    NVLink. Latency: pipelined, so the sum of the hop latencies around the ring twice.
    """
    if not hw.gpu:
        return flat_ring_time(hw, nbytes, nodes, local, nic_efficiency)
    n = nodes * local
    if n <= 1:
        return 0.0
    assert hw.device_link is not None
    bws = [hw.device_link.bandwidth] if local > 1 else []
    if nodes > 1:
        bws.append(hw.nic.bandwidth * nic_efficiency)
    crossing = nodes if nodes > 1 else 0
    lat = 2 * (n - 1) / n * (crossing * hw.nic.latency +
                             (n - crossing) * hw.device_link.latency)
    return lat + 2 * (n - 1) / n * nbytes / min(bws)


def allreduce_time(algorithm: str, hw: Hardware, nbytes: float, nodes: int, local: int, *,
                   nic_efficiency: float = 1.0, pipelined: bool | str = False) -> float:
    """One fused allreduce of ``nbytes`` on ``nodes`` x ``local`` workers (no negotiation).

    ``hierarchical`` on one node is ``shm``, as shoal's selector picks.
    """
    if algorithm in ("shm", "hierarchical"):
        return hierarchical_time(hw, nbytes, nodes, local, nic_efficiency, pipelined)
    if algorithm == "ring":
        return flat_ring_time(hw, nbytes, nodes, local, nic_efficiency)
    if algorithm == "nccl":
        return nccl_ring_time(hw, nbytes, nodes, local, nic_efficiency)
    raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def negotiation_time(kind: str, hw: Hardware, nodes: int, local: int) -> float:
    """One negotiation round.

    ``decentralized`` (shoal): a shared-memory allgather on each node, then each local rank
    swaps its node's proposals with its peers on every other node (lengths, then payloads).
    ``coordinator`` (Horovod): every rank sends its ready list to rank 0, which answers all
    (gather and broadcast trees over TCP, rank 0 handling every message itself).
    """
    n = nodes * local
    if n <= 1:
        return 0.0
    if kind == "decentralized":
        t = hw.shm_sync if local > 1 else 0.0
        if nodes > 1:
            t += 2 * (hw.nic.latency + 2 * (nodes - 1) * hw.ctrl_msg)
        return t
    if kind == "coordinator":
        hop = hw.nic.latency if nodes > 1 else hw.tcp_loopback.latency
        depth = math.ceil(math.log2(n))
        return 2 * depth * (hop + hw.ctrl_msg) + 2 * n * hw.ctrl_msg
    raise ValueError(f"unknown negotiation {kind!r}")
