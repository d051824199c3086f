"""The import switch: Horovod's and SMDDP's module names resolved to shoal's modules, so a
script written for either runs unchanged.

``shoalrun --as horovod`` (or ``--as smddp``, or both: ``--as horovod,smddp``) sets
``SHOAL_AS`` in every worker and puts this package's ``boot`` directory on ``PYTHONPATH``; its
``sitecustomize`` installs the switch at interpreter start, in the workers and in every Python
process they start (DataLoader workers, ``mp.spawn``). Under another launcher,
``python -m shoal.as horovod train.py ARGS`` does the same for one process and its children
(torchrun: ``torchrun --nproc-per-node 8 -m shoal.as smddp train.py``).

Opt-in only: without ``SHOAL_AS`` nothing is aliased. With it, a finder first on
``sys.meta_path`` answers for the aliased names, so shoal's modules win over an installed
``horovod`` or ``smdistributed`` package, and the switch says so on stderr once.

* ``horovod``: ``horovod.X`` is ``shoal.X`` (``horovod.torch``, ``horovod.tensorflow.keras``,
  ``horovod.common.util``, ...); a name shoal lacks (``horovod.spark``) is a
  ModuleNotFoundError that says so.
* ``smddp``: ``smdistributed.dataparallel.tensorflow`` is ``shoal.tensorflow`` (``.keras``
  too); ``smdistributed.dataparallel.torch.torch_smddp`` registers the torch backend
  ``"smddp"`` as shoal's; ``smdistributed.dataparallel.torch.distributed`` and
  ``...torch.parallel.distributed`` are SMDDP's version-1 API on torch.distributed over shoal.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from shoal._launchers import RANK_AND_SIZE_VARS

__all__ = ["BOOT_DIR", "ENV_VAR", "KINDS", "active", "environment", "install", "parse_kinds",
           "uninstall", "worker_environment"]

ENV_VAR = "SHOAL_AS"
#: the directory whose ``sitecustomize`` installs the switch in every process that has it on
#: its path and ``SHOAL_AS`` set
BOOT_DIR = str(Path(__file__).resolve().parent / "boot")
#: for each kind: aliased module prefix -> shoal module prefix (the longest prefix wins)
KINDS: dict[str, dict[str, str]] = {
    "horovod": {"horovod": "shoal"},
    "smddp": {"smdistributed": "shoal.alias.smdistributed",
              "smdistributed.dataparallel.tensorflow": "shoal.tensorflow"},
}


def parse_kinds(text: str | Sequence[str]) -> list[str]:
    """``"horovod,smddp"`` -> ``["horovod", "smddp"]``; ValueError for an unknown kind."""
    kinds = [k.strip().lower() for k in (text.split(",") if isinstance(text, str) else text)]
    kinds = [k for k in kinds if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown import switch {','.join(unknown) or repr(text)}: choose from "
                         f"{', '.join(KINDS)} (comma-separated for several)")
    return kinds


class _Loader(importlib.abc.Loader):
    """Loads an alias by importing its shoal module and putting that one in its place."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # the import system hands back whatever sys.modules holds under the name after this
        sys.modules[module.__name__] = importlib.import_module(self.target)


class AliasFinder(importlib.abc.MetaPathFinder):
    """The meta-path finder of the switch: aliased names to shoal's modules."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = list(kinds)
        self.table = {alias: target for kind in kinds for alias, target in KINDS[kind].items()}

    def target(self, fullname: str) -> str | None:
        """The shoal module that ``fullname`` resolves to, or None if it is not aliased."""
        for alias in sorted(self.table, key=len, reverse=True):
            if fullname == alias or fullname.startswith(alias + "."):
                return self.table[alias] + fullname[len(alias):]
        return None

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        shoal_name = self.target(fullname)
        if shoal_name is None:
            return None
        if importlib.util.find_spec(shoal_name) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the import switch ({ENV_VAR}="
                f"{','.join(self.kinds)}) resolves it to {shoal_name}, which shoal does not "
                f"have", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _Loader(shoal_name))


def active() -> AliasFinder | None:
    """The installed switch, if any."""
    return next((f for f in sys.meta_path if isinstance(f, AliasFinder)), None)


def install(kinds: str | Sequence[str]) -> AliasFinder:
    """Install the switch in this process (first on ``sys.meta_path``; again replaces it)."""
    finder = AliasFinder(parse_kinds(kinds))
    uninstall()
    sys.meta_path.insert(0, finder)
    _say_what_is_shadowed(finder)
    return finder


def uninstall() -> None:
    """Remove the switch (modules imported through it stay imported)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]


def environment(kinds: str | Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the switch on for the processes started with it: ``SHOAL_AS`` set and
    :data:`BOOT_DIR` first on ``PYTHONPATH``."""
    out = dict(env)
    out[ENV_VAR] = ",".join(parse_kinds(kinds))
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    out["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *paths])
    return out


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A launcher's worker environment with the switch applied where ``SHOAL_AS`` asks for it
    (unchanged otherwise)."""
    kinds = env.get(ENV_VAR)
    return environment(kinds, env) if kinds else dict(env)


def _say_what_is_shadowed(finder: AliasFinder) -> None:
    """An installed package of an aliased name is not what the script gets: say so, once per
    job (on its first rank) rather than once per process."""
    rank = next((os.environ[r] for r, _ in RANK_AND_SIZE_VARS if r in os.environ), "0")
    if rank != "0" or os.environ.get("_SHOAL_AS_SAID"):
        return
    for root in {alias.split(".")[0] for alias in finder.table}:
        spec = importlib.machinery.PathFinder.find_spec(root)
        if spec is not None:
            where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
            print(f"shoal: {ENV_VAR}={','.join(finder.kinds)}: the script's `import {root}...` "
                  f"gets shoal's modules; the {root} installed at {where} is not used",
                  file=sys.stderr, flush=True)
    os.environ["_SHOAL_AS_SAID"] = "1"  # children (DataLoader workers) do not say it again
