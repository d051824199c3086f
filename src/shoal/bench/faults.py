"""``shoal bench faults``: inject each fault into a small job and record what shoal did.

Each scenario starts its ranks directly, with no launcher (rank 0 serves the rendezvous
store, as under Kubernetes where every pod starts alone), so nothing outside shoal stops the
job: every detection comes from shoal itself. A victim rank injects its fault at a recorded
moment (a real ``kill -9`` or ``SIGSTOP`` of itself, its link taken down inside an emulated
host, garbage on the ports) and the survivors record when, and with which error, they noticed.
The defaults are used (``SHOAL_HEARTBEAT_TIMEOUT_S`` 10 s), so the times are what a user gets.
Results go to ``benchmarks/faults.json``; ``shoal bench report`` turns them into
RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .fault_actions import ACTIONS as _MORE
from .faults_common import fault_now, record, wait_for_loss

__all__ = ["SCENARIOS", "add_arguments", "run", "worker_main"]


@dataclass(frozen=True)
class Scenario:
    """One fault: how many ranks, on which (simulated) hosts, and what it shows."""

    name: str
    fault: str
    ranks: int
    hosts: tuple[str, ...] = ()
    netns: bool = False
    drop_udp: bool = False  # the emulated hosts pass TCP only
    expect: str = "detected"  # "detected": survivors raise; "continues": the job finishes
    settings: dict[str, str] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("kill9-same-host", "kill -9 of a rank while the others wait in a collective", 3),
    Scenario("kill9-across-hosts", "kill -9 of a rank on another (emulated) host", 3,
             ("a", "a", "b")),
    Scenario("sigstop-same-host", "SIGSTOP (frozen, not dead) of a rank on the same host", 3),
    Scenario("sigstop-across-hosts", "SIGSTOP of a rank on another host", 3, ("a", "a", "b")),
    Scenario("cut-link", "the link between two emulated hosts taken down (netns, root)", 2,
             ("a", "b"), netns=True),
    Scenario("busy-rank", "a live rank busy for 3x the heartbeat timeout while the others "
             "wait", 2, expect="continues"),
    Scenario("udp-dropped", "UDP dropped between 2 emulated hosts (TCP passes); a rank idles "
             "1.5x the heartbeat timeout while the others wait", 4, ("a", "a", "b", "b"),
             netns=True, drop_udp=True, expect="continues"),
    Scenario("strangers-every-port", "a silent stranger (held open), HTTP and garbage on every "
             "TCP port and garbage on every UDP port each rank's own sockets listen on "
             "(found in /proc: store, data, heartbeat, point-to-point)", 3, expect="continues"),
    Scenario("replayed-heartbeat", "a rank frozen while its recorded heartbeats are replayed "
             "to the others", 3, ("a", "a", "b")),
    Scenario("sigstop-during-recv", "SIGSTOP of the peer a point-to-point receive (no "
             "timeout) waits on", 2),
    Scenario("async-held-computing", "rank 0 holds allreduce_async(A) and computes 3 s, then "
             "B; rank 1 does B, then A (stall warning 1 s)", 2, expect="continues",
             settings={"SHOAL_STALL_WARNING_S": "1"}),
    Scenario("bad-argument", "a bad argument (an object array) on one rank, caught; then "
             "unnamed collectives on every rank", 3, expect="continues",
             settings={"SHOAL_STALL_SHUTDOWN_S": "20"}),
    *(Scenario(f"{sig}-{work}", f"{text} of a rank of host b during a {what} (2 emulated "
               f"hosts x 2 ranks, netns)", 4, ("a", "a", "b", "b"), netns=True)
      for sig, text in (("kill9", "kill -9"), ("sigstop", "SIGSTOP"))
      for work, what in (("hierarchical", "hierarchical allreduce of 4 MiB"),
                         ("sharded", "sharded-optimizer (Adam) step"))),
    *(Scenario(f"mismatch-{kind}", f"ranks disagree: {text}", 3, expect="continues",
               settings={"SHOAL_STALL_WARNING_S": "5"})
      for kind, text in (("shape", "shape"), ("dtype", "dtype"), ("op", "reduction op"),
                         ("root", "broadcast root"), ("kind", "allreduce vs broadcast, "
                                                      "one name"),
                         ("names", "different names (every rank waits on its own)"))),
)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench faults``."""
    p.add_argument("--only", nargs="*", default=None, help=f"of {', '.join(SCENARIOS)}")
    p.add_argument("--out", default="benchmarks/faults.json")
    p.add_argument("--timeout", type=float, default=120, help="per scenario")


# -- inside a rank ---------------------------------------------------------------------------


def _victim_signal(sig: int) -> Callable[[Any, str, int, Any], None]:
    def act(shoal: Any, folder: str, rank: int, args: Any) -> None:
        victim = shoal.size() - 1
        shoal.barrier()
        if rank == victim:
            time.sleep(0.5)  # the survivors are inside their collective by now
            fault_now(folder)
            os.kill(os.getpid(), sig)
            time.sleep(120)
        wait_for_loss(shoal, folder, rank)
    return act


def _cut_link(shoal: Any, folder: str, rank: int, args: Any) -> None:
    shoal.barrier()
    if rank == 1:
        time.sleep(0.5)
        fault_now(folder)
        subprocess.run(["ip", "link", "set", "dev", args.device, "down"], check=True)
    wait_for_loss(shoal, folder, rank)


def _busy(shoal: Any, folder: str, rank: int, args: Any) -> None:
    shoal.barrier()
    start = time.time()
    if rank == 1:
        time.sleep(3 * shoal.communicator().cfg.heartbeat_timeout_s)
    got = shoal.allreduce(np.ones(4), shoal.Sum, name="after.busy")
    assert got.tolist() == [2.0] * 4
    record(folder, rank, outcome="continued", waited=time.time() - start)


def _mismatch(kind: str) -> Callable[[Any, str, int, Any], None]:
    def act(shoal: Any, folder: str, rank: int, args: Any) -> None:
        shoal.barrier()
        last = rank == shoal.size() - 1
        x = np.ones(4 + (kind == "shape" and last), np.float64 if kind == "dtype" and last
                    else np.float32)
        start = time.time()
        try:
            if kind == "root":
                shoal.broadcast(x, root_rank=int(last), name="m")
            elif kind == "kind" and last:
                shoal.broadcast(x, root_rank=0, name="m")
            elif kind == "names":
                shoal.allreduce(x, name=f"m.{rank}")
            else:
                shoal.allreduce(x, shoal.Max if kind == "op" and last else shoal.Sum, name="m")
            outcome, error, message = "no error", None, ""
        except shoal.ShoalError as exc:
            outcome, error, message = "raised", type(exc).__name__, str(exc)
        detected = time.time() - start
        ok = shoal.allreduce(np.ones(3), shoal.Sum, name="m").tolist() == [shoal.size()] * 3
        record(folder, rank, outcome=outcome, error=error, message=message,
                detected_s=detected, next_collective_ok=ok)
    return act


_ACTIONS: dict[str, Callable[[Any, str, int, Any], None]] = {
    "kill9-same-host": _victim_signal(signal.SIGKILL),
    "kill9-across-hosts": _victim_signal(signal.SIGKILL),
    "sigstop-same-host": _victim_signal(signal.SIGSTOP),
    "sigstop-across-hosts": _victim_signal(signal.SIGSTOP),
    "cut-link": _cut_link, "busy-rank": _busy,
    **{name: _mismatch(name.split("-", 1)[1]) for name in SCENARIOS
       if name.startswith("mismatch-")},
    **_MORE,
}


def worker_main(argv: Sequence[str]) -> None:
    """One rank of one scenario."""
    p = argparse.ArgumentParser()
    for flag in ("--scenario", "--secret", "--job", "--host", "--addr", "--dir", "--device"):
        p.add_argument(flag, default="")
    for flag in ("--rank", "--size", "--port"):
        p.add_argument(flag, type=int, required=True)
    args = p.parse_args(argv)
    import shoal
    shoal.init(rank=args.rank, size=args.size, rendezvous_addr=args.addr,
               rendezvous_port=args.port, hostname=args.host, secret=args.secret,
               job_id=args.job)
    _ACTIONS[args.scenario](shoal, args.dir, args.rank, args)
    shoal.shutdown()


# -- the orchestration -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is frozen by a signal (the SIGSTOP scenarios' victims)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _run_scenario(sc: Scenario, timeout: float) -> dict[str, Any]:
    from .netns import ClusterUnavailableError, EmulatedCluster
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        addr, commands = "127.0.0.1", []
        cluster = None
        if sc.netns:
            try:
                cluster = stack.enter_context(EmulatedCluster(2, "1gbit",
                                                              drop_udp=sc.drop_udp))
            except ClusterUnavailableError as exc:
                return {"outcome": "not run", "why": str(exc)}
            addr = cluster.addresses[0]
        common = ["--size", str(sc.ranks), "--port", str(_free_port()), "--addr", addr,
                  "--secret", secrets.token_hex(16), "--job", f"faults{os.getpid()}",
                  "--scenario", sc.name, "--dir", folder]
        env = {**os.environ, **sc.settings}
        for rank in range(sc.ranks):
            host = sc.hosts[rank] if sc.hosts else "node0"
            argv = [sys.executable, "-m", "shoal.bench.faults", "--rank", str(rank),
                    "--host", host, *common]
            if cluster is not None:
                node = list(dict.fromkeys(sc.hosts)).index(host)
                argv = cluster.command(node, [*argv, "--device", cluster.devices[node]])
            commands.append(argv)
        start = time.time()
        procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for c in commands]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                p.poll() is not None or _stopped(p.pid) for p in procs):
            time.sleep(0.2)
        for p in procs:  # the frozen and the hung: end them now
            if p.poll() is None:
                p.kill()
                p.wait(5)
        ranks = {}
        for r in range(sc.ranks):
            path = os.path.join(folder, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks[r] = json.load(f)
        fault_path = os.path.join(folder, "fault.json")
        fault_t = None
        if os.path.exists(fault_path):
            with open(fault_path) as f:
                fault_t = json.load(f)["t"]
        return _summary(sc, ranks, fault_t, start, [p.returncode for p in procs])


def _summary(sc: Scenario, ranks: dict[int, dict[str, Any]], fault_t: float | None,
             start: float, codes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"fault": sc.fault, "ranks": sc.ranks, "hosts": list(sc.hosts),
                           "exit_codes": codes, "per_rank": ranks}
    if sc.expect == "detected":
        survivors = {r: v for r, v in ranks.items() if v.get("outcome") == "raised"}
        times = [v["t"] - fault_t for v in survivors.values()] if fault_t else []
        out["detected_s"] = max(times) if times else None
        named = [str(sc.ranks - 1) in v.get("message", "") for v in survivors.values()]
        out["ok"] = bool(survivors) and len(survivors) >= (sc.ranks - 1 if not sc.netns
                                                          else 1) and all(named)
        out["outcome"] = (f"{len(survivors)} survivor(s) raised "
                          f"{sorted({v['error'] for v in survivors.values()})}"
                          + (", naming the lost rank" if all(named) and named else ""))
        first = next(iter(survivors.values()), {})
        out["message"] = first.get("message", "")[:300]
    else:
        done = [v for v in ranks.values() if v.get("outcome") in ("continued", "raised")]
        out["ok"] = len(done) == sc.ranks and all(v.get("next_collective_ok", True)
                                                   for v in done)
        if sc.name.startswith("mismatch-"):
            errors = sorted({str(v.get("error")) for v in done})
            out["detected_s"] = max(v.get("detected_s", 0.0) for v in done) if done else None
            out["ok"] = out["ok"] and errors == ["CollectiveMismatchError"]
            out["outcome"] = (f"every rank raised {errors}; the next collective worked"
                              if out["ok"] else f"errors {errors}")
            out["message"] = next((v["message"] for v in done if v.get("message")), "")[:300]
        else:
            out["outcome"] = ("every rank finished; the job went on" if out["ok"]
                              else "some rank did not finish")
            out["detected_s"] = None
    out["seconds"] = time.time() - start
    return out


def _checkpoint_kill() -> dict[str, Any]:
    """A worker killed halfway through writing a checkpoint (the application's writer)."""
    if os.path.isdir("apps") and os.getcwd() not in sys.path:  # a source checkout
        sys.path.insert(0, os.getcwd())
    try:
        from apps.efficientnet.runtime.checkpoint import load_checkpoint, save_checkpoint
    except ImportError as exc:
        return {"outcome": "not run", "why": f"the application is not importable: {exc}",
                "ok": False}
    import multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ckpt.pt")
        save_checkpoint(path, {"step": 1})
        proc = mp.get_context("spawn").Process(target=_slow_save, args=(path,))
        proc.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                n.endswith(".tmp") for n in os.listdir(folder)):
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        state = load_checkpoint(path)
        ok = state.get("step") == 1
    return {"fault": "kill -9 of the writer halfway through a checkpoint write", "ok": ok,
            "outcome": "the previous checkpoint loads intact" if ok else "checkpoint lost",
            "detected_s": None}


class _Stall:
    def __reduce__(self) -> tuple:
        time.sleep(120)
        return (dict, ())


def _slow_save(path: str) -> None:
    from apps.efficientnet.runtime.checkpoint import save_checkpoint
    save_checkpoint(path, {"step": 2, "blob": bytes(1 << 20), "stall": _Stall()})


def run(args: argparse.Namespace) -> int:
    """Run the scenarios one after another and write the JSON results."""
    from .common import write_results
    names = args.only or [*SCENARIOS, "checkpoint-kill"]
    results = {}
    for name in names:
        if name == "checkpoint-kill":
            results[name] = _checkpoint_kill()
        else:
            results[name] = _run_scenario(SCENARIOS[name], args.timeout)
        r = results[name]
        det = r.get("detected_s")
        print(f"{name:22} {'ok ' if r.get('ok') else 'BAD'} "
              f"{'' if det is None else f'{det:6.2f} s '}{r.get('outcome', '')}", flush=True)
    write_results(args.out, {"scenarios": results})
    return 0 if all(r.get("ok") or r.get("outcome") == "not run" for r in results.values()) \
        else 1


if __name__ == "__main__":
    worker_main(sys.argv[1:])
