"""``python -m shoal.as``: run a script with the import switch on."""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types
from collections.abc import Sequence

from . import ENV_VAR, KINDS, environment, install

USAGE = (f"usage: python -m shoal.as {{{','.join(KINDS)}}}[,...] (SCRIPT | -m MODULE | -c CODE) "
         f"[ARGS...]\n  runs SCRIPT (or MODULE, or CODE, as python does) with Horovod's or "
         f"SMDDP's imports resolved to shoal's modules ({ENV_VAR})")


def main(argv: Sequence[str] | None = None) -> int:
    """Install the switch for ``argv[0]``'s kinds, then run the script as ``__main__``;
    returns the exit status for usage errors (the script's own exit passes through)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] in ("-h", "--help") or (args[1] in ("-m", "-c")
                                                         and len(args) < 3):
        print(USAGE, file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    try:
        install(args[0])
    except ValueError as exc:
        print(f"python -m shoal.as: {exc}", file=sys.stderr)
        return 2
    os.environ.update(environment(args[0], os.environ))  # for the processes it starts
    if args[1] == "-m":
        sys.argv = [args[2], *args[3:]]
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    elif args[1] == "-c":  # as `python -c CODE ARGS`: argv[0] is "-c", the code runs as __main__
        sys.argv = ["-c", *args[3:]]
        sys.path[0] = ""
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module  # what pickle and multiprocessing look up
        exec(compile(args[2], "<string>", "exec"), module.__dict__)
    else:
        sys.argv = args[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(args[1]))  # as `python SCRIPT` has it
        runpy.run_path(args[1], run_name="__main__")
    return 0
