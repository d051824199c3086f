"""``shoalrun --sagemaker``: the job's shape from a SageMaker training container.

SageMaker starts the container on every host of the training job. On the master (the first
host in sorted order) shoalrun starts one worker per GPU (``SM_NUM_GPUS``, else 1) on every
host, reaching the others over ssh like Horovod's MPI mode, advertising the rendezvous on
``network_interface_name``, and appending the hyperparameters to the command the way the
SageMaker training toolkit does (keys sorted, ``--key value``). On the other hosts shoalrun
waits until the workers the master started there have finished.

Read: ``SM_HOSTS``/``SM_CURRENT_HOST``/``SM_NETWORK_INTERFACE_NAME``/``SM_HPS``/``SM_NUM_GPUS``
if set, else ``<base>/input/config/resourceconfig.json`` and ``hyperparameters.json``, with
``<base>`` = ``$SAGEMAKER_BASE_DIR`` or ``/opt/ml``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import LaunchError

__all__ = ["SageMaker", "base_dir", "detected", "hyperparameter_args", "load",
           "wait_for_workers"]


@dataclass(frozen=True)
class SageMaker:
    """What a SageMaker container says about the training job."""

    hosts: tuple[str, ...]  # sorted: the master first
    current_host: str
    network_interface: str | None = None
    num_gpus: int = 1
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def master(self) -> str:
        """The host that launches the job."""
        return self.hosts[0]


def base_dir(environ: Mapping[str, str]) -> Path:
    """``$SAGEMAKER_BASE_DIR`` (tests), else ``/opt/ml``."""
    return Path(environ.get("SAGEMAKER_BASE_DIR") or "/opt/ml")


def detected(environ: Mapping[str, str]) -> bool:
    """Whether this looks like a SageMaker training container."""
    return bool(environ.get("SM_HOSTS") or environ.get("SM_CURRENT_HOST")
                or (base_dir(environ) / "input/config/resourceconfig.json").is_file())


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise LaunchError(f"SageMaker: {what} is not valid JSON ({exc})") from None


def _decode(value: Any) -> Any:
    """hyperparameters.json holds every value as a JSON string; decode it when it is JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def load(environ: Mapping[str, str]) -> SageMaker:
    """Read the SageMaker environment; :class:`LaunchError` when it is incomplete."""
    config_dir = base_dir(environ) / "input/config"
    resource: dict[str, Any] = {}
    path = config_dir / "resourceconfig.json"
    if path.is_file():
        resource = _json(path.read_text(), str(path))
    hosts = _json(environ["SM_HOSTS"], "SM_HOSTS") if environ.get("SM_HOSTS") \
        else resource.get("hosts")
    current = environ.get("SM_CURRENT_HOST") or resource.get("current_host")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise LaunchError(f"SageMaker: no host list (SM_HOSTS, or 'hosts' in {path})")
    if current not in hosts:
        raise LaunchError(f"SageMaker: current host {current!r} (SM_CURRENT_HOST or "
                          f"'current_host' in {path}) is not among the hosts {hosts}")
    if environ.get("SM_HPS"):
        hps = _json(environ["SM_HPS"], "SM_HPS")
    elif (config_dir / "hyperparameters.json").is_file():
        raw = _json((config_dir / "hyperparameters.json").read_text(), "hyperparameters.json")
        hps = {k: _decode(v) for k, v in raw.items()}
    else:
        hps = {}
    gpus = environ.get("SM_NUM_GPUS", "").strip()
    if gpus and not gpus.isdigit():
        raise LaunchError(f"SageMaker: SM_NUM_GPUS={gpus!r} is not a number")
    interface = environ.get("SM_NETWORK_INTERFACE_NAME") or resource.get(
        "network_interface_name")
    return SageMaker(hosts=tuple(sorted(hosts)), current_host=str(current),
                     network_interface=interface or None,
                     num_gpus=max(1, int(gpus or 1)), hyperparameters=hps)


def _arg_value(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return "" if value is None else str(value)


def hyperparameter_args(hps: Mapping[str, Any]) -> list[str]:
    """Like the SageMaker training toolkit: sorted keys, ``--key value`` (``-k`` for one
    letter), mappings as ``a=1,b=2``, other values as ``str()`` (``True``, ``[1, 2]``)."""
    args: list[str] = []
    for key in sorted(hps):
        args += [f"--{key}" if len(key) > 1 else f"-{key}", _arg_value(hps[key])]
    return args


def _alive(pid_file: Path) -> bool:
    """Whether the pid in ``pid_file`` is a running process (a zombie is not)."""
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat")
        return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def wait_for_workers(marker_dir: Path, first_timeout: float, poll_s: float = 0.5) -> bool:
    """On a SageMaker host that is not the master: wait for the master to start workers here
    (their bootstraps leave ``<job>-<rank>.pid`` files in ``marker_dir``), then for all of
    them to end. False when none appeared within ``first_timeout`` seconds."""
    deadline = time.monotonic() + first_timeout
    seen = False
    while True:
        live = [p for p in marker_dir.glob("*.pid") if _alive(p)] if marker_dir.is_dir() else []
        seen = seen or bool(live)
        if seen and not live:
            return True
        if not seen and time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
