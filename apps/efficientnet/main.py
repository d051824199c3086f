"""EfficientNet training on shoal: ``python -m apps.efficientnet.main --mode train_and_eval ...``.

Launch data-parallel with ``shoalrun -np 4 python -m apps.efficientnet.main ...`` (or torchrun,
mpirun, srun, SageMaker). Flags: ``--help`` or :mod:`apps.efficientnet.config.flags`. Run as a
file (SageMaker's ``entry_point="apps/efficientnet/main.py"``), it puts the repository root on
``sys.path`` first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run as a file, not as a module
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from apps.efficientnet.config.flags import parse_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags (and SageMaker's environment) and run the chosen mode with the chosen
    framework (only that framework is imported)."""
    args = parse_args(argv)
    if args.framework == "tensorflow":
        from apps.efficientnet.keras.train import run
    else:
        from apps.efficientnet.runtime.runner import run
    run(args)


if __name__ == "__main__":
    main()
