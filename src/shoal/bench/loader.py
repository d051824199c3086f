"""``shoal bench loader``: images per second of one loader worker on photographs of ImageNet's
size, for the application's PyTorch and Keras input pipelines (source checkout).

The records are scikit-learn's two sample photographs cut into distinct JPEGs of about
500x375 (:mod:`apps.efficientnet.dataloader.photos`), written once into ``--data``. Each
trial runs ``python -m apps.efficientnet.loader_throughput`` pinned to one core (``taskset``):
a ``DataLoader`` with one worker process for PyTorch, the ``tf.data`` pipeline with
``num_parallel_calls=1`` and one thread for Keras, with and without AutoAugment; the methods
take turns trial by trial. The table gives images/s per worker (median of the trials and
their spread) and what AutoAugment costs. With ``--synthetic-steps`` it also runs the
application's ``--synthetic`` training on the same one core (its ``training_benchmark`` mode)
and reports the loader's rate over that training rate: above 1, one loader worker feeds one
core's training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import write_results
from .stats import stats

__all__ = ["add_arguments", "run", "section"]

ROOT = Path(__file__).resolve().parents[3]  # the source checkout (apps/ beside src/)
TARGET = 400.0  # images/s per loader worker at 224 px without AutoAugment


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument("--data", default=".cache/photo-tfrecords",
                   help="where the photograph TFRecords are (written there if missing)")
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--frameworks", default="torch,tensorflow")
    p.add_argument("--augmenters", default="none,autoaugment")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--images", type=int, default=512, help="images timed per trial")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--core", type=int, default=0, help="the core every trial is pinned to")
    p.add_argument("--synthetic-steps", type=int, default=0,
                   help="also time this many steps of --synthetic training (0: do not)")
    p.add_argument("--out", default="benchmarks/loader.json")


def _pinned(core: int) -> list[str]:
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core)] if taskset else []


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def trial(framework: str, augmenter: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in its own process; its JSON line."""
    cmd = [*_pinned(args.core), sys.executable, "-m", "apps.efficientnet.loader_throughput",
           "--framework", framework, "--augmenter", augmenter, "--data", args.data,
           "--image-size", str(args.image_size), "--images", str(args.images)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"shoal bench loader: {framework}/{augmenter} failed "
                           f"({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def synthetic_rate(framework: str, args: argparse.Namespace) -> float:
    """Images/s of the application's ``--synthetic`` training (EfficientNet-B0, batch 16) on
    the same one core, from its log's summary."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="shoal-bench-loader-") as model_dir:
        warmup = 2
        cmd = [*_pinned(args.core), sys.executable, "-m", "apps.efficientnet.main",
               "--framework", framework, "--mode", "training_benchmark", "--synthetic",
               "--arch", "efficientnet-b0", "--image_size", str(args.image_size),
               "--train_batch_size", "16", "--max_epochs", "1", "--steps_per_epoch",
               str(args.synthetic_steps + warmup), "--benchmark_warmup_steps", str(warmup),
               "--model_dir", model_dir, "--num_workers", "0", "--log_steps", "0",
               "--log_filename", "log.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                              timeout=3600)
        log = Path(model_dir) / "log.json"
        if proc.returncode != 0 or not log.exists():
            raise RuntimeError(f"shoal bench loader: synthetic {framework} training failed "
                               f"({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        summary = next(x for x in lines if x.get("step") == "SUMMARY")["data"]
        return float(summary["avg_exp_per_second_training"])


def run(args: argparse.Namespace) -> int:
    """Write the photographs if needed, measure, print the table, write the results."""
    sys.path[:0] = [str(ROOT)]
    from apps.efficientnet.dataloader.photos import write_photo_records
    write_photo_records(args.data, args.records)
    methods = [(f, a) for f in args.frameworks.split(",") for a in args.augmenters.split(",")]
    rates: dict[str, list[float]] = {f"{f}/{a}": [] for f, a in methods}
    for t in range(args.trials):
        for framework, augmenter in methods:
            r = trial(framework, augmenter, args)
            rates[f"{framework}/{augmenter}"].append(r["images_per_s"])
            print(f"trial {t} {framework:10} {augmenter:12} {r['images_per_s']:7.1f} images/s",
                  flush=True)
    results = []
    for (framework, augmenter), key in zip(methods, rates, strict=True):
        # stats() is for times: the rates' spread is that of their inverses
        s = stats([1.0 / v for v in rates[key]])
        results.append({"framework": framework, "augmenter": augmenter,
                        "images_per_s": 1.0 / s["median"], "spread": s["spread"],
                        "trials": rates[key]})
    synthetic = {}
    if args.synthetic_steps:
        for framework in args.frameworks.split(","):
            synthetic[framework] = synthetic_rate(framework, args)
    payload = {"benchmark": "loader", "image_size": args.image_size, "records": args.records,
               "images_per_trial": args.images, "core": args.core, "target": TARGET,
               "cpus": os.cpu_count(), "results": results, "synthetic_training": synthetic}
    print("\n".join(section(payload)))
    write_results(args.out, payload)
    return 0


def section(data: dict[str, Any]) -> list[str]:
    """The BENCHMARKS.md section of ``benchmarks/loader.json``."""
    by = {(r["framework"], r["augmenter"]): r for r in data["results"]}
    out = ["## Input pipeline: one loader worker on photographs", "",
           f"`{data.get('command', 'shoal bench loader')}`: {data['records']} JPEGs of about "
           f"500x375 (scikit-learn's sample photographs cut apart), random-resized crop to "
           f"{data['image_size']} px and flip, one loader worker pinned to one core (a "
           f"`DataLoader` worker process; `tf.data` with one parallel call and one thread), "
           f"{data['images_per_trial']} images a trial, methods alternating; "
           f"target {data['target']:g} images/s without AutoAugment.", "",
           "| framework | augmenter | images/s (median) | spread | vs no augmenter |"
           + (" loader / training |" if data.get("synthetic_training") else ""),
           "|---|---|---|---|---|" + ("---|" if data.get("synthetic_training") else "")]
    for r in data["results"]:
        base = by.get((r["framework"], "none"))
        share = f"{r['images_per_s'] / base['images_per_s']:.2f}x" if base else "-"
        row = (f"| {r['framework']} | {r['augmenter']} | {r['images_per_s']:.0f} | "
               f"{r['spread']:.0%} | {share} |")
        train = data.get("synthetic_training", {}).get(r["framework"])
        if data.get("synthetic_training"):
            row += f" {r['images_per_s'] / train:.1f} |" if train else " - |"
        out.append(row)
    if data.get("synthetic_training"):
        out += ["", "loader / training: the worker's rate over the application's `--synthetic` "
                "training rate on the same one core (EfficientNet-B0, batch 16): how many "
                "cores of training one loader core can feed."]
    return [*out, ""]
