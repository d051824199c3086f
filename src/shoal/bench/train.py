"""``shoal bench train``: end-to-end EfficientNet training throughput, shoal vs its peers.

Runs the training application (``apps/efficientnet``, from a source checkout) in its
``training_benchmark`` mode on synthetic data, once per backend, world size, architecture,
setting and variant, the backends taking turns trial by trial: shoal's ``DistributedOptimizer``
(``shoal``), stock DDP over ``backend="shoal"`` (``ddp-shoal``), stock DDP over gloo
(``ddp-gloo``) and Horovod's own ``DistributedOptimizer`` (``horovod``: the same application on
``horovod.torch``, started by ``horovodrun`` in the peers venv). A backend that is not installed
is reported as missing, never dropped silently. ``independent`` is the ceiling: N single-worker
jobs at once, with no communication at all, their throughputs added up: what N workers reach on
this machine when they share its cores, caches and memory bus but never talk.

Every worker runs ``--threads`` intra-op threads (default 1), so the per-worker compute is the
same at every world size; scaling efficiency = throughput(N) / (N x throughput(1)). On a 2-core
machine N > 2 oversubscribes, and the table says so. Variants: ``base``, ``amp`` (autocast,
bf16 on CPU), ``xla`` (``torch.compile``), ``amp+xla``.

With ``--overlap`` two more jobs per setting run shoal's optimizer with a timeline, at the
largest world size that does not oversubscribe the cores, with its automatic gradient buckets
and with 2 MiB ones (which always overlap), and report how much of the communication ran while
backward was still computing
(:mod:`shoal.bench.overlap`), keeping one step's excerpt of each to plot. (DDP waits for its
buckets inside ``backward()``, so the same split says nothing about DDP.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import overlap
from .common import free_port, write_results
from .peers import available_peers, peer_python
from .stats import stats

__all__ = ["add_arguments", "format_table", "run"]

VARIANTS = {"base": [], "amp": ["--use_amp"], "xla": ["--use_xla"],
            "amp+xla": ["--use_amp", "--use_xla"], "syncbn": ["--batch_norm", "syncbn"],
            "sharded": ["--optimizer_sharding"]}
BACKENDS = ("shoal", "ddp-shoal", "ddp-gloo", "horovod", "mwms", "independent")
#: the backends of each framework (``mwms``: TensorFlow's MultiWorkerMirroredStrategy)
FRAMEWORKS = {"torch": ("shoal", "ddp-shoal", "ddp-gloo", "horovod", "independent"),
              "tensorflow": ("shoal", "mwms", "independent")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench train``."""
    p.add_argument("--np", type=int, nargs="+", default=[1, 2])
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch",
                   help="tensorflow: the Keras application, against MultiWorkerMirroredStrategy")
    p.add_argument("--backends", default=None,
                   help="comma-separated, of the framework's: "
                        + "; ".join(f"{k}: {', '.join(v)}" for k, v in FRAMEWORKS.items()))
    p.add_argument("--settings", default="64:16,128:32",
                   help="image_size:per-worker-batch pairs (communication-heavy, compute-heavy)")
    p.add_argument("--archs", "--arch", default="efficientnet-b0",
                   help="comma-separated EfficientNet variants")
    p.add_argument("--variants", default="base",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    p.add_argument("--steps", type=int, default=30, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--overlap", action="store_true",
                   help="also measure the communication hidden behind backward")
    p.add_argument("--title", default=None,
                   help="the report section's heading (default: End-to-end training throughput)")
    p.add_argument("--out", default="benchmarks/train.json")
    p.add_argument("--timeout", type=float, default=900)


def _command(backend: str, n: int, app: list[str]) -> list[str]:
    if backend != "horovod":
        return [sys.executable, "-m", "shoal.runner", "-np", str(n), sys.executable, *app]
    python = peer_python()
    assert python is not None  # checked before any job runs
    horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
    return [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", python, *app]


def _app_args(arch: str, setting: str, variant: str, backend: str, model_dir: str,
              args: argparse.Namespace) -> list[str]:
    size, batch = setting.split(":")
    return ["-m", "apps.efficientnet.main", "--mode", "training_benchmark", "--synthetic",
            "--arch", arch, "--image_size", size, "--train_batch_size", batch,
            "--max_epochs", "1", "--steps_per_epoch", str(args.steps + args.warmup),
            "--benchmark_warmup_steps", str(args.warmup), "--backend", backend,
            "--model_dir", model_dir, "--num_workers", "0", "--log_steps", "0",
            "--log_filename", "log.json", "--framework", args.framework, *VARIANTS[variant]]


def _tf_config(n: int, index: int, ports: list[int]) -> str:
    """``TF_CONFIG`` of worker ``index`` of an ``n``-worker cluster on loopback."""
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports[:n]]},
                       "task": {"type": "worker", "index": index}})


def _summary(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "log.json")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return next(x for x in lines if x.get("step") == "SUMMARY")["data"]


def _job(backend: str, n: int, arch: str, setting: str, variant: str,
         args: argparse.Namespace, timeline: str | None = None,
         env_extra: dict[str, str] | None = None) -> tuple[float, float | None, Any]:
    """One training job; its throughput (images/s, all workers), its workers' mean peak RSS
    (MiB; None from an application that does not report it) and, with ``timeline``, the
    timeline's analysis and excerpt. ``independent`` runs ``n`` single-worker jobs at once
    (no communication at all) and adds up their throughput: the machine's ceiling for ``n``
    workers."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **(env_extra or {})}
        if timeline:
            env["SHOAL_TIMELINE"] = os.path.join(tmp, "timeline.json")
        envs: list[dict[str, str]] = []
        if backend == "independent":
            dirs = [os.path.join(tmp, str(k)) for k in range(n)]
            commands = [_command("shoal", 1, _app_args(arch, setting, variant, "shoal", d, args))
                        for d in dirs]
        elif backend == "mwms":  # one process per worker, the cluster in TF_CONFIG
            dirs = [tmp]
            ports = [free_port() for _ in range(n)]
            commands = [[sys.executable, *_app_args(arch, setting, variant, backend, tmp, args)]
                        for _ in range(n)]
            envs = [{"TF_CONFIG": _tf_config(n, k, ports)} for k in range(n)]
        else:
            dirs = [tmp]
            commands = [_command(backend, n,
                                 _app_args(arch, setting, variant, backend, tmp, args))]
        # output goes to files, not pipes: a job that filled a pipe nobody reads yet would
        # stall, and its throughput with it
        logs = [os.path.join(tmp, f"stderr.{k}") for k in range(len(commands))]
        procs = []
        for k, (command, log) in enumerate(zip(commands, logs, strict=True)):
            with open(log, "w") as err:
                procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                              env={**env, **(envs[k] if envs else {})}))
        failed = []
        try:
            deadline = time.monotonic() + args.timeout
            for proc, log in zip(procs, logs, strict=True):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    with open(log) as f:
                        failed.append(f.read()[-800:])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failed:
            raise RuntimeError(f"{backend} np={n} {arch} {setting} {variant} failed: "
                               f"{failed[0]}")
        extra = None
        if timeline:
            events = overlap.load_events(env["SHOAL_TIMELINE"])
            extra = {**overlap.analyse(events), "excerpt": overlap.excerpt(events)}
        summaries = [_summary(d) for d in dirs]
        rss = [x["peak_rss_per_worker"] for x in summaries if "peak_rss_per_worker" in x]
        return (sum(float(x["avg_exp_per_second_training"]) for x in summaries),
                sum(rss) / len(rss) if rss else None, extra)


def _oversubscribed(n: int, threads: int) -> bool:
    return n * threads > (os.cpu_count() or 1)


def format_table(result: dict[str, Any]) -> str:
    """Images/second per configuration, backend and world size, with scaling efficiency."""
    lines = [f"training throughput (images/s, all workers), {result.get('framework', 'torch')}, "
             f"synthetic data, {result['threads']} thread(s) per worker"]
    for backend, why in result.get("missing", {}).items():
        lines.append(f"  {backend}: missing ({why})")
    for f in result.get("failed", []):
        lines.append(f"  FAILED {f['arch']} {f['setting']} {f['variant']} np={f['np']} "
                     f"{f['backend']}: {f['error'].splitlines()[-1] if f['error'] else ''}")
    by_config: dict[tuple[str, str, str, int], dict[str, float]] = {}
    for row in result["results"]:
        tag = " (oversubscribed)" if row["oversubscribed"] else ""
        eff = f", efficiency {row['efficiency']:.1%}" if row.get("efficiency") else ""
        rss = f", peak RSS {row['peak_rss_mib']['median']:.0f} MiB per worker" \
            if row.get("peak_rss_mib") else ""
        lines.append(f"  {row['arch']} {row['setting']} {row['variant']:>7} np={row['np']} "
                     f"{row['backend']:>9}: {row['median']:.1f}{eff}{rss}{tag}")
        key = (row["arch"], row["setting"], row["variant"], row["np"])
        by_config.setdefault(key, {})[row["backend"]] = row["median"]
    for (arch, setting, variant, n), per in by_config.items():
        ratios = [f"{per['shoal'] / per[b]:.2f}x {b}" for b in BACKENDS[1:]
                  if "shoal" in per and per.get(b)]
        if ratios:
            lines.append(f"  shoal throughput / theirs, {arch} {setting} {variant} np={n}: "
                         + ", ".join(ratios))
    for o in result.get("overlap", []):
        lines.append(f"  overlap {o['setting']} np={o['np']} {o['backend']} "
                     f"({o['buckets']} buckets, {o['images_per_s']:.1f} images/s): "
                     f"{o['hidden_share']:.0%} of {o['comm_ms']:.1f} ms communication hidden "
                     f"behind backward, {o['exposed_ms']:.1f} ms waited after it")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Driver: for every (arch, setting, np), ``--trials`` rounds in which every variant
    runs every backend, both in rotating order."""
    allowed = FRAMEWORKS[args.framework]
    backends = (args.backends or ",".join(allowed)).split(",")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"shoal bench train: unknown variant(s) {unknown}; use {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    unknown = [b for b in backends if b not in allowed]
    if unknown:
        print(f"shoal bench train: unknown backend(s) {unknown} for {args.framework}; use "
              f"{', '.join(allowed)}", file=sys.stderr)
        return 2
    missing: dict[str, str] = {}
    if "horovod" in backends and available_peers().get("horovod") is None:
        missing["horovod"] = ("not installed in the peers venv (scripts/install-peers.sh)"
                              if peer_python() else "no peers venv (scripts/install-peers.sh)")
        backends.remove("horovod")
    result: dict[str, Any] = {"title": args.title, "framework": args.framework,
                              "steps": args.steps, "warmup": args.warmup,
                              "threads": args.threads, "cores": os.cpu_count(),
                              "missing": missing, "results": [], "overlap": [], "failed": []}
    for arch in args.archs.split(","):
        for setting in args.settings.split(","):
            # variants and backends take turns trial by trial, so that a machine whose speed
            # drifts (shared cores) shifts every configuration alike
            samples: dict[tuple[str, str, int], list[float]] = {}
            memory: dict[tuple[str, str, int], list[float]] = {}  # peak RSS, MiB per worker
            for n in args.np:
                for trial in range(args.trials):
                    v = trial % len(variants)
                    for variant in variants[v:] + variants[:v]:
                        k = trial % len(backends)
                        for backend in backends[k:] + backends[:k]:
                            if backend == "mwms" and n == 1:
                                continue  # one worker: the np=1 shoal job is the reference
                            try:
                                tput, rss, _ = _job(backend, n, arch, setting, variant,
                                                    args)
                            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                                _failed(result, exc, arch=arch, setting=setting,
                                        variant=variant, backend=backend, np=n)
                                continue
                            samples.setdefault((variant, backend, n), []).append(tput)
                            if rss is not None:
                                memory.setdefault((variant, backend, n), []).append(rss)
                            print(f"{arch} {setting} {variant} np={n} {backend}: "
                                  f"{tput:.1f} images/s"
                                  + (f", peak RSS {rss:.0f} MiB per worker" if rss else ""),
                                  flush=True)
            for variant in variants:
                for (v, backend, n), values in samples.items():
                    if v != variant:
                        continue
                    st = stats(values)
                    one = samples.get((variant, backend, 1))
                    eff = st["median"] / (n * stats(one)["median"]) if one and n > 1 else None
                    rss = memory.get((v, backend, n))
                    result["results"].append({
                        "arch": arch, "setting": setting, "variant": variant,
                        "backend": backend, "np": n, **st, "efficiency": eff,
                        "oversubscribed": _oversubscribed(n, args.threads),
                        **({"peak_rss_mib": stats(rss)} if rss else {})})
            if args.overlap and "shoal" in backends and max(args.np) > 1:
                # the largest world size that does not oversubscribe the cores
                n = max((k for k in args.np if k > 1 and not _oversubscribed(k, args.threads)),
                        default=max(args.np))
                # the automatic bucket size, then small buckets that force overlap
                for buckets, env in (("auto", {}), ("2 MiB", {"SHOAL_BUCKET_BYTES": "2M"})):
                    try:
                        tput, _, extra = _job("shoal", n, arch, setting, "base", args,
                                              timeline="on", env_extra=env)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        _failed(result, exc, arch=arch, setting=setting, variant="base",
                                backend=f"shoal timeline, {buckets} buckets", np=n)
                        continue
                    result["overlap"].append({"arch": arch, "setting": setting,
                                              "backend": "shoal", "np": n, "buckets": buckets,
                                              "images_per_s": tput, **extra})
    print(format_table(result))
    write_results(args.out, result)
    return 1 if result["failed"] else 0


def _failed(result: dict[str, Any], exc: BaseException, **where: Any) -> None:
    """A job that failed or timed out is recorded (and reported) and the run goes on."""
    why = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else str(exc)[-600:]
    print(f"shoal bench train: {why}", file=sys.stderr, flush=True)
    result["failed"].append({**where, "error": why})
