"""``shoalrun --sagemaker``: the job's shape from a SageMaker training container.

SageMaker starts the container on every host of the training job. On the master (the first
host in sorted order) shoalrun starts one worker per GPU (``SM_NUM_GPUS``, else 1) on every
host, reaching the others over ssh like Horovod's MPI mode, advertising the rendezvous on
``network_interface_name``, and appending the hyperparameters to the command the way the
SageMaker training toolkit does (keys sorted, ``--key value``; the reserved ``sagemaker_*``
ones are left out, as the toolkit leaves them out). On the other hosts shoalrun waits until the
workers the master started there have finished.

Every worker, on every host, sees the whole training environment the toolkit gives an entry
point (:func:`worker_environment`): ``SM_HOSTS``, ``SM_CURRENT_HOST`` (its own host),
``SM_CHANNELS`` and ``SM_CHANNEL_<NAME>``, ``SM_MODEL_DIR``, ``SM_OUTPUT_DATA_DIR``,
``SM_HPS`` and ``SM_HP_<NAME>``, ... taken from shoalrun's own ``SM_*`` variables where the
toolkit set them, else derived from the files SageMaker writes, plus ``SAGEMAKER_*``,
``TRAINING_JOB_NAME`` and ``AWS_*`` (region, container credentials) for S3 access. A worker
started over ssh would otherwise see none of them.

Read: ``SM_HOSTS``/``SM_CURRENT_HOST``/``SM_NETWORK_INTERFACE_NAME``/``SM_HPS``/``SM_NUM_GPUS``
if set, else ``<base>/input/config/resourceconfig.json``, ``hyperparameters.json`` and
``inputdataconfig.json``, with ``<base>`` = ``$SAGEMAKER_BASE_DIR`` or ``/opt/ml``.
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

__all__ = ["RESERVED_PREFIX", "SageMaker", "base_dir", "detected", "hyperparameter_args", "load",
           "user_hyperparameters", "wait_for_workers", "worker_environment"]

#: Hyperparameters the SageMaker SDK adds for the toolkit (``sagemaker_program``,
#: ``sagemaker_region``, ...): not the training script's arguments.
RESERVED_PREFIX = "sagemaker_"
_FORWARD_PREFIXES = ("SM_", "SAGEMAKER_", "AWS_")
_FORWARD_NAMES = ("TRAINING_JOB_NAME", "TRAINING_JOB_ARN")


@dataclass(frozen=True)
class SageMaker:
    """What a SageMaker container says about the training job."""

    hosts: tuple[str, ...]  # sorted: the master first
    current_host: str
    network_interface: str | None = None
    num_gpus: int = 1
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)  # all, reserved ones too
    base: str = "/opt/ml"
    resource_config: Mapping[str, Any] = field(default_factory=dict)
    input_data_config: Mapping[str, Any] = field(default_factory=dict)

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
    hps: dict[str, Any] = {}
    if (config_dir / "hyperparameters.json").is_file():
        raw = _json((config_dir / "hyperparameters.json").read_text(), "hyperparameters.json")
        hps = {k: _decode(v) for k, v in raw.items()}
    if environ.get("SM_HPS"):  # the toolkit's: the user's only; the reserved ones stay
        hps = {**{k: v for k, v in hps.items() if k.startswith(RESERVED_PREFIX)},
               **_json(environ["SM_HPS"], "SM_HPS")}
    gpus = environ.get("SM_NUM_GPUS", "").strip()
    if gpus and not gpus.isdigit():
        raise LaunchError(f"SageMaker: SM_NUM_GPUS={gpus!r} is not a number")
    interface = environ.get("SM_NETWORK_INTERFACE_NAME") or resource.get(
        "network_interface_name")
    channels: Any = {}
    if environ.get("SM_INPUT_DATA_CONFIG"):
        channels = _json(environ["SM_INPUT_DATA_CONFIG"], "SM_INPUT_DATA_CONFIG")
    elif (config_dir / "inputdataconfig.json").is_file():
        channels = _json((config_dir / "inputdataconfig.json").read_text(),
                         "inputdataconfig.json")
    return SageMaker(hosts=tuple(sorted(hosts)), current_host=str(current),
                     network_interface=interface or None,
                     num_gpus=max(1, int(gpus or 1)), hyperparameters=hps,
                     base=str(base_dir(environ)), resource_config=resource or {},
                     input_data_config=channels if isinstance(channels, dict) else {})


def user_hyperparameters(hps: Mapping[str, Any]) -> dict[str, Any]:
    """``hps`` without the reserved ``sagemaker_*`` entries (what the script is given)."""
    return {k: v for k, v in hps.items() if not k.startswith(RESERVED_PREFIX)}


def _env_value(value: Any) -> str:
    """The toolkit's encoding: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _derived(sm: SageMaker, host: str) -> dict[str, Any]:
    """The training environment of a worker on ``host``, as the toolkit derives it from the
    files (lower-case names, before ``SM_`` and encoding)."""
    base = Path(sm.base)
    hps = user_hyperparameters(sm.hyperparameters)
    framework = {k: v for k, v in sm.hyperparameters.items() if k.startswith(RESERVED_PREFIX)}
    resource = {**sm.resource_config, "current_host": host, "hosts": list(sm.hosts)}
    channels = {name: str(base / "input/data" / name) for name in sm.input_data_config}
    env: dict[str, Any] = {
        "hosts": list(sm.hosts), "current_host": host,
        "network_interface_name": sm.network_interface or "eth0",
        "hps": hps, "framework_params": framework, "resource_config": resource,
        "input_data_config": dict(sm.input_data_config), "channels": sorted(channels),
        "num_gpus": sm.num_gpus, "num_cpus": os.cpu_count() or 1,
        "model_dir": str(base / "model"), "input_dir": str(base / "input"),
        "input_config_dir": str(base / "input/config"), "output_dir": str(base / "output"),
        "output_data_dir": str(base / "output/data"),
        "output_intermediate_dir": str(base / "output/intermediate"),
        "user_args": hyperparameter_args(hps),
        "log_level": framework.get("sagemaker_container_log_level", 20),
    }
    if "sagemaker_program" in framework:
        env["user_entry_point"] = framework["sagemaker_program"]
        env["module_name"] = str(framework["sagemaker_program"]).removesuffix(".py")
    if "sagemaker_submit_directory" in framework:
        env["module_dir"] = framework["sagemaker_submit_directory"]
    env["training_env"] = {**env, "is_master": host == sm.master,
                           "master_hostname": sm.master}
    env.update({f"channel_{name}": path for name, path in channels.items()})
    env.update({f"hp_{key}": value for key, value in hps.items()})
    return env


def worker_environment(sm: SageMaker, environ: Mapping[str, str], host: str
                       ) -> dict[str, str]:
    """What a worker on ``host`` needs of SageMaker's environment, wherever it was started.

    shoalrun's own ``SM_*`` / ``SAGEMAKER_*`` / ``AWS_*`` / ``TRAINING_JOB_*`` variables (the
    toolkit's values for the master, which hold for every host: the same paths in every
    container) pass on; ``SM_*`` variables missing from them are derived from the files;
    ``SM_CURRENT_HOST``, ``SM_RESOURCE_CONFIG`` and ``SM_TRAINING_ENV`` name ``host``.
    ``SM_HPS``, ``SM_HP_*`` and ``SM_USER_ARGS`` hold the user's hyperparameters only.
    """
    out = {k: v for k, v in environ.items()
           if k.startswith(_FORWARD_PREFIXES) or k in _FORWARD_NAMES}
    derived = {f"SM_{k.upper()}": _env_value(v) for k, v in _derived(sm, host).items()}
    own = ("SM_CURRENT_HOST", "SM_RESOURCE_CONFIG", "SM_TRAINING_ENV", "SM_HPS",
           "SM_USER_ARGS")
    for key, value in derived.items():
        if key in own or key not in out:
            out[key] = value
    for key in [k for k in out if k.startswith("SM_HP_")]:  # reserved ones never reach SM_HP_*
        if key not in derived:
            del out[key]
    return out


def _arg_value(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return "" if value is None else str(value)


def hyperparameter_args(hps: Mapping[str, Any]) -> list[str]:
    """Like the SageMaker training toolkit: the reserved ``sagemaker_*`` keys left out, sorted
    keys, ``--key value`` (``-k`` for one letter), mappings as ``a=1,b=2``, other values as
    ``str()`` (``True``, ``[1, 2]``)."""
    args: list[str] = []
    for key in sorted(user_hyperparameters(hps)):
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
