"""EfficientNet training on shoal: ``python -m apps.efficientnet.main --mode train_and_eval ...``.

Launch data-parallel with ``shoalrun -np 4 python -m apps.efficientnet.main ...`` (or torchrun,
mpirun, srun, SageMaker). Flags: ``--help`` or :mod:`apps.efficientnet.config.flags`. Run as a
file (SageMaker's ``entry_point="apps/efficientnet/main.py"``), it puts the repository root on
``sys.path`` in place of its own folder.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run as a file, not as a module
    # Python put this file's folder first on the path, where the application's own keras/
    # would shadow the real Keras: put the repository root there instead
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parents[1]))

from apps.efficientnet.config.flags import UnsupportedFlagError, parse_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags (and SageMaker's environment) and run the chosen mode with the chosen
    framework (only that framework is imported)."""
    try:
        args = parse_args(argv)
    except UnsupportedFlagError as e:  # a value asks for what shoal cannot do: say which
        raise SystemExit(f"apps.efficientnet.main: error: {e}") from None
    if args.framework == "tensorflow":
        from apps.efficientnet.keras.train import run
    else:
        from apps.efficientnet.runtime.runner import run
    run(args)


if __name__ == "__main__":
    main()
