"""shoal's import switch at interpreter start: on ``PYTHONPATH`` under ``shoalrun --as`` and
``python -m shoal.as``, it installs the switch when ``SHOAL_AS`` names one, then runs the
``sitecustomize`` it shadows (the environment's own, if there is one)."""

import importlib.machinery
import importlib.util
import os
import sys


def _boot() -> None:
    kinds = os.environ.get("SHOAL_AS")
    if kinds:
        try:
            from shoal.alias import install
            install(kinds)
        except Exception as exc:  # never stop an interpreter from starting
            print(f"shoal: SHOAL_AS={kinds}: the import switch is off in this process "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        shadowed = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shadowed)


_boot()
