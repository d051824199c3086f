"""The ``shoal`` command: ``shoal bench ...``, ``shoal sim`` and ``shoal config``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shoal`` console script."""
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure shoal against its peers")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from .bench import allreduce, cluster, exchange, report, train
    allreduce.add_arguments(bench_sub.add_parser(
        "allreduce", help="float32 allreduce, shoal vs torch gloo vs memcpy"))
    exchange.add_arguments(bench_sub.add_parser(
        "exchange", help="a real model's gradient exchange, shoal vs gloo"))
    cluster.add_arguments(bench_sub.add_parser(
        "cluster", help="allreduce across emulated nodes on a shaped link (root)"))
    train.add_arguments(bench_sub.add_parser(
        "train", help="end-to-end EfficientNet throughput, shoal vs DDP (source checkout)"))
    report.add_arguments(bench_sub.add_parser(
        "report", help="regenerate BENCHMARKS.md and its plots from the JSON results"))
    from .sim import cli as sim_cli
    sim_cli.add_arguments(sub.add_parser(
        "sim", help="predict step time and scaling efficiency on M nodes x G workers"))
    sub.add_parser("config", help="list every SHOAL_* setting with its default")
    args = parser.parse_args(argv)
    if args.command == "sim":
        return sim_cli.run(args)
    if args.command == "config":
        from .core.config import describe
        print(describe())
        return 0
    if args.bench == "allreduce":
        return allreduce.run(args)
    if args.bench == "exchange":
        return exchange.run(args)
    if args.bench == "cluster":
        return cluster.run(args)
    if args.bench == "train":
        return train.run(args)
    if args.bench == "report":
        return report.run(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
