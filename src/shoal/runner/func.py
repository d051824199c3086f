"""Run a Python function on N ranks and return its results by rank: ``shoal.run`` (Horovod's
``horovod.run``), the core that other "run a function" front ends share.

The function, its arguments and the results travel through a store served here for the one
job (authenticated with a fresh secret, which reaches the workers in their environment as
shoalrun's own does); the workers are started by ``shoalrun`` with the launch flags given, so
hosts, ssh and the network interface work as they do for a script. Functions are pickled with
cloudpickle where it is installed (a function defined in ``__main__`` then works), else with
pickle (by reference: the function must be importable on the workers).
"""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["RunFuncError", "run", "run_func"]

ADDR_VAR, SECRET_VAR = "SHOAL_RUN_FUNC_ADDR", "SHOAL_RUN_FUNC_SECRET"


class RunFuncError(RuntimeError):
    """A rank's function raised, or the job failed before every rank returned."""


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def run_func(fn: Callable[..., Any], args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None, *, np: int,
             launch_flags: Sequence[str] = (), env: Mapping[str, str] | None = None,
             executable: str | None = None, timeout: float | None = None) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``np`` ranks started by shoalrun with ``launch_flags``;
    the return values in rank order.

    Raises:
        RunFuncError: a rank raised (its rank, exception and traceback in the message), or
            the job ended without every rank's result (shoalrun's exit status and its last
            lines).
    """
    from ..core.auth import secret_bytes
    from ..core.rendezvous import StoreClient, StoreServer
    if np < 1:
        raise ValueError(f"np must be at least 1, not {np}")
    secret = secrets.token_hex(32)
    host = "0.0.0.0" if any(f in launch_flags for f in ("-H", "--hosts", "--hostfile")) \
        else "127.0.0.1"
    server = StoreServer(secret_bytes(secret), host=host, port=0).start()
    port = int(server.address[1])
    addr = "127.0.0.1" if host == "127.0.0.1" else _advertised()
    store = StoreClient("127.0.0.1", port, secret_bytes(secret), timeout=30.0)
    try:
        store.set("fn", _dumps((fn, tuple(args), dict(kwargs or {}))))
        child_env = {**os.environ, **(env or {}), ADDR_VAR: f"{addr}:{port}",
                     SECRET_VAR: secret}
        argv = [sys.executable, "-m", "shoal.runner", "-np", str(np), *launch_flags,
                executable or sys.executable, "-m", "shoal.runner.task"]
        proc = subprocess.run(argv, env=child_env, stdout=None, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
        sys.stderr.write(proc.stderr)
        errors = [store.try_get(f"error/{r}") for r in range(np)]
        failed = [(r, e.decode()) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise RunFuncError("\n".join(f"rank {r} raised {text}" for r, text in failed))
        results = [store.try_get(f"result/{r}") for r in range(np)]
        missing = [r for r, value in enumerate(results) if value is None]
        if missing or proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RunFuncError(f"the job ended with exit status {proc.returncode}"
                               + (f" before ranks {missing} returned" if missing else "")
                               + f":\n{tail}")
        return [pickle.loads(value) for value in results]  # type: ignore[arg-type]
    finally:
        store.close()
        server.close()


def _advertised() -> str:
    import socket
    return socket.gethostbyname(socket.gethostname())


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, np: int = 1, min_np: int | None = None,
        max_np: int | None = None, slots: int | None = None, reset_limit: int | None = None,
        hosts: str | None = None, hostfile: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None,
        ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | int | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | None = None,
        executable: str | None = None, env: Mapping[str, str] | None = None) -> list[Any]:
    """Horovod's ``horovod.run``: ``func(*args, **kwargs)`` on ``np`` processes (which call
    ``hvd.init()`` themselves); the results in rank order. The launch arguments are
    shoalrun's flags of the same names; ``use_gloo``/``use_mpi``/``mpi_args`` and
    ``disable_cache`` are accepted and change nothing (shoal has one transport and no
    cache)."""
    flags: list[str] = []
    for flag, value in (("--min-np", min_np), ("--max-np", max_np),
                        ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                        ("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("--ssh-port", ssh_port),
                        ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            flags += [flag, str(value)]
    if verbose:
        flags.append("--verbose")
    return run_func(func, args, kwargs, np=np, launch_flags=flags, env=env,
                    executable=executable)
