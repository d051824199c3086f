"""The ``shoal`` command: ``shoal bench ...``, ``shoal sim`` and ``shoal config``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> help; each is a module with add_arguments(parser) and run(args) -> int
_BENCH = {
    "allreduce": "float32 allreduce, shoal vs torch gloo vs Open MPI vs memcpy",
    "exchange": "a real model's gradient exchange, shoal vs gloo vs Horovod",
    "cluster": "allreduce across emulated nodes on a shaped link (root)",
    "latency": "small allreduces across emulated nodes vs the raw TCP round trip (root)",
    "collectives": "reducescatter and allgather vs allreduce and gloo",
    "train": "end-to-end EfficientNet throughput, shoal vs DDP (source checkout)",
    "soak": "many mixed collectives checked against numpy: mismatches, memory, cache size",
    "faults": "inject kill -9, SIGSTOP, a cut link, strangers, mismatches; record detection",
    "fsdp": "FSDP2 training steps over backend shoal vs over gloo, side by side",
    "ddp": "stock DDP training steps over backend shoal vs over gloo, side by side",
    "elastic": "an elastic job losing a worker: seconds from the kill to the next step",
    "loader": "images/s of one loader worker on ImageNet-sized photographs (source checkout)",
    "report": "regenerate BENCHMARKS.md and its plots from the JSON results",
}


def _config(_args: argparse.Namespace) -> int:
    from .core.config import describe
    print(describe())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shoal`` console script."""
    import importlib

    from .sim import cli as sim_cli
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench_sub = sub.add_parser("bench", help="measure shoal against its peers") \
        .add_subparsers(dest="bench", required=True)
    for name, text in _BENCH.items():
        module = importlib.import_module(f"shoal.bench.{name}")
        p = bench_sub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    p = sub.add_parser("sim", help="predict step time and scaling efficiency on M nodes x G "
                                   "workers")
    sim_cli.add_arguments(p)
    p.set_defaults(run=sim_cli.run)
    sub.add_parser("config", help="list every SHOAL_* setting with its default") \
        .set_defaults(run=_config)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
