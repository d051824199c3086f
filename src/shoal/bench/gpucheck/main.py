"""The GPU check's driver: ``python -m shoal.bench.gpucheck.main [--dry-run] --out FILE``
(what ``scripts/gpu-check.sh`` runs).

Each check of :mod:`.checks` runs in 2 ranks under shoalrun (they share the one GPU), then
EfficientNet-B0 trains on synthetic device tensors (:mod:`.bench`: the application's model, no
data modules) at 224 px with AMP on 1 and 2 ranks, beside the "independent" ceiling: as many
single-rank runs at once as there are ranks, with no communication, their images/s summed.
Everything lands in one JSON file, rewritten after every step (``complete`` is false until
the last), so a run cut at its time limit still returns what it did; the exit status is
non-zero when anything failed. ``--dry-run`` walks every step on CPU
tensors through the device stage's stand-in, at toy sizes, so the script is proven before
GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .checks import CHECKS

RANKS = 2
#: the benchmark's shape: (image px, per-rank batch, steps, warmup steps)
GPU_BENCH = (224, 128, 40, 10)
DRY_BENCH = (32, 4, 4, 1)
BUDGET_S = 200.0  # all steps together, about 3 minutes (gpu-check.sh kills it at 230 s)
NVIDIA_A100_B0_AMP = 3450  # images/s, NVIDIA's published figure for B0 + AMP on one A100


def _env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parents[4]  # the checkout: src/ and apps/ importable
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "src"), str(root), *filter(None, [env.get("PYTHONPATH")])])
    if dry:
        env["SHOAL_DEVICE_STAGE_CPU"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _shoalrun(np_: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "shoal.runner.launch", "-np", str(np_), sys.executable,
            *argv]


def run_check(name: str, dry: bool, timeout: float) -> dict[str, Any]:
    """One check in ``RANKS`` ranks; the per-rank results and whether all passed."""
    with tempfile.TemporaryDirectory(prefix="shoal-gpucheck-") as out:
        start = time.perf_counter()
        try:
            proc = subprocess.run(_shoalrun(RANKS, ["-m", "shoal.bench.gpucheck.worker", name,
                                                    out]),
                                  env=_env(dry), capture_output=True, text=True,
                                  timeout=timeout)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = 124, f"timed out after {timeout:.0f}s: {str(exc.stdout)[-2000:]}"
        ranks = []
        for r in range(RANKS):
            path = Path(out) / f"{name}.{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else
                         {"rank": r, "ok": False, "error": "wrote no result"})
    ok = rc == 0 and all(r.get("ok") for r in ranks)
    return {"ok": ok, "seconds": round(time.perf_counter() - start, 1), "ranks": ranks,
            **({} if ok else {"output_tail": tail})}


def _bench_argv(amp: bool, bench: tuple[int, int, int, int], out: str,
                alone: int = 0) -> list[str]:
    """The benchmark's command line; ``alone``: that many independent processes at once."""
    px, batch, steps, warmup = bench
    return ["-m", "shoal.bench.gpucheck.bench", out, "--px", str(px), "--batch", str(batch),
            "--steps", str(steps), "--warmup", str(warmup), *(["--amp"] if amp else []),
            *(["--alone", "--share", str(alone)] if alone else [])]


def _images_per_second(out: str) -> float:
    return float(json.loads(Path(out).read_text())["images_per_s"])


def run_benchmark(dry: bool, timeout: float) -> dict[str, Any]:
    """images/s of EfficientNet-B0 on synthetic device tensors with AMP, 1 and RANKS ranks,
    and the ceiling (RANKS runs at once, alone); ``timeout`` bounds each launch."""
    start = time.perf_counter()
    bench = DRY_BENCH if dry else GPU_BENCH
    rows, ok, errors = [], True, []
    env = _env(dry)
    amp = True
    for ranks in (1, RANKS):
        row: dict[str, Any] = {"amp": amp, "ranks": ranks, "image_size": bench[0],
                               "batch_per_rank": bench[1]}
        with tempfile.TemporaryDirectory(prefix="shoal-gpubench-") as tmp:
            try:
                argv = _bench_argv(amp, bench, f"{tmp}/job.json")
                cmd = _shoalrun(ranks, argv) if ranks > 1 else [sys.executable, *argv]
                subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                               timeout=timeout)
                row["images_per_s"] = round(_images_per_second(f"{tmp}/job.json"), 1)
                if ranks > 1:
                    alone = [subprocess.Popen(
                        [sys.executable, *_bench_argv(amp, bench, f"{tmp}/alone{i}.json",
                                                      alone=ranks)],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                        for i in range(ranks)]
                    try:
                        for proc in alone:
                            _, err = proc.communicate(timeout=timeout)
                            if proc.returncode:
                                raise RuntimeError(f"an independent run failed: {err[-1500:]}")
                    finally:  # a run cut short must not go on taking the cores
                        for proc in alone:
                            if proc.poll() is None:
                                proc.kill()
                                proc.wait()
                    row["independent_images_per_s"] = round(sum(
                        _images_per_second(f"{tmp}/alone{i}.json") for i in range(ranks)), 1)
                    row["share_of_independent"] = round(
                        row["images_per_s"] / row["independent_images_per_s"], 3)
            except (subprocess.SubprocessError, RuntimeError, OSError, KeyError,
                    ValueError) as exc:
                ok = False
                detail = getattr(exc, "stderr", None) or ""
                errors.append(f"amp={amp} ranks={ranks}: {exc} {str(detail)[-1500:]}")
        rows.append(row)
    return {"ok": ok, "seconds": round(time.perf_counter() - start, 1), "rows": rows,
            "nvidia_a100_b0_amp_images_per_s": NVIDIA_A100_B0_AMP,
            **({"errors": errors} if errors else {})}


def section(report: dict[str, Any]) -> list[str]:
    """The GPU section of BENCHMARKS.md from a (non-dry) gpu-check JSON report."""
    bench = report["checks"].get("benchmark", {})
    profile = report["checks"].get("profile", {}).get("ranks", [{}])[0]
    lines = ["## GPU: scripts/gpu-check.sh", "",
             f"{report.get('gpu')}, torch {report.get('torch')}, {RANKS} ranks sharing the "
             f"GPU; all checks {'passed' if report['ok'] else 'did NOT pass'}. Profiled step: "
             f"{profile.get('shoal_host_waits_before_step')} host waits by shoal before "
             f"step(), GPU idle {profile.get('gpu_idle_share_of_step')} of the step.", "",
             "| B0 px | AMP | ranks | images/s | independent | share |",
             "|---|---|---|---|---|---|"]
    for row in bench.get("rows", []):
        lines.append(f"| {row['image_size']} | {row['amp']} | {row['ranks']} | "
                     f"{row.get('images_per_s')} | {row.get('independent_images_per_s', '-')} "
                     f"| {row.get('share_of_independent', '-')} |")
    lines += ["", f"NVIDIA's published EfficientNet-B0 with AMP on one A100: "
              f"{NVIDIA_A100_B0_AMP:,} images/s.", ""]
    return lines


def _write(out: Path, report: dict[str, Any], results: dict[str, Any], started: float,
           complete: bool) -> None:
    """The report as it stands (atomically): ``complete`` false until every step ran."""
    report["checks"] = results
    report["complete"] = complete
    report["ok"] = complete and "error" not in report and all(
        r["ok"] for r in results.values())
    report["seconds"] = round(time.perf_counter() - started, 1)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    """Run every check and the benchmark; write ``--out``; 0 when everything passed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU tensors, toy sizes")
    p.add_argument("--out", default="results/gpu-check.json")
    p.add_argument("--only", nargs="*", choices=[*CHECKS, "benchmark"], default=None)
    args = p.parse_args(argv)
    started = time.perf_counter()
    report: dict[str, Any] = {"dry_run": args.dry_run, "python": sys.version.split()[0]}
    try:
        import torch
        report["torch"] = torch.__version__
        report["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() and \
            not args.dry_run else None
        report["nccl"] = torch.distributed.is_nccl_available()
    except Exception as exc:  # reported, and fails the check below
        report["torch_error"] = repr(exc)
    if not args.dry_run and not report.get("gpu"):
        report["error"] = "no CUDA GPU visible (use --dry-run on a CPU machine)"
    steps = args.only or [*CHECKS, "benchmark"]
    results: dict[str, Any] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, report, results, started, complete=False)
    deadline = started + BUDGET_S
    for name in steps:
        left = deadline - time.perf_counter()
        if left < 15:
            results[name] = {"ok": False, "error": f"skipped: the {BUDGET_S:.0f}s budget "
                                                   f"was spent"}
            continue
        results[name] = run_benchmark(args.dry_run, min(90.0, left / 2)) \
            if name == "benchmark" else run_check(name, args.dry_run, min(60.0, left))
        print(f"gpu-check: {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
              f"({results[name].get('seconds', '')}s)", flush=True)
        for error in results[name].get("errors", []):
            print(f"gpu-check: {name}: {error}", flush=True)
        _write(out, report, results, started, complete=False)  # a cut run keeps its steps
    _write(out, report, results, started, complete=True)
    for row in results.get("benchmark", {}).get("rows", []):
        print(f"gpu-check: B0 {row['image_size']} px amp={row['amp']!s:5} ranks={row['ranks']}"
              f": {row.get('images_per_s')} images/s (independent "
              f"{row.get('independent_images_per_s')})", flush=True)
    print(f"gpu-check: {'passed' if report['ok'] else 'FAILED'} in {report['seconds']}s; "
          f"{out}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
