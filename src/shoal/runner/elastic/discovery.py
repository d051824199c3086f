"""Where an elastic job's hosts come from (Horovod's ``horovod.runner.elastic.discovery``):
a discovery script's ``host:slots`` lines, a fixed list, or any :class:`HostDiscovery` (the
Ray executors' ask Ray for its nodes)."""

from __future__ import annotations

import abc
import subprocess

from ..common import LaunchError

__all__ = ["FixedHosts", "HostDiscovery", "HostDiscoveryScript", "discover", "parse_discovery"]


class HostDiscovery(abc.ABC):
    """Says which hosts the job may use now, and how many workers (slots) each."""

    @abc.abstractmethod
    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{host: slots}``, in the order the hosts should fill."""


class HostDiscoveryScript(HostDiscovery):
    """A script that prints ``host:slots`` lines (``host`` alone: ``slots`` slots)."""

    def __init__(self, discovery_script: str, slots: int = 1) -> None:
        self._script = discovery_script
        self._default_slots = slots

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(discover(self._script, slots_per_host=self._default_slots))


class FixedHosts(HostDiscovery):
    """The same hosts every time (``-H``)."""

    def __init__(self, available_hosts_and_slots: dict[str, int]) -> None:
        self._hosts = dict(available_hosts_and_slots)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self._hosts)


def parse_discovery(text: str, slots_per_host: int = 1) -> list[tuple[str, int]]:
    """``host:slots`` lines (``host`` alone: ``slots_per_host`` slots; blank lines and ``#``
    comments skipped), in order."""
    out: list[tuple[str, int]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if not host or (slots and not slots.strip().isdigit()):
            raise LaunchError(f"host discovery: cannot read {raw!r} (expected host:slots)")
        if any(h == host for h, _ in out):
            continue
        out.append((host, int(slots) if slots else slots_per_host))
    return out


def discover(script: str, timeout: float = 30.0, slots_per_host: int = 1
             ) -> list[tuple[str, int]]:
    """Run the discovery script; its hosts and slots."""
    try:
        proc = subprocess.run([script], capture_output=True, text=True, timeout=timeout,
                              shell=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"host discovery script {script}: {exc}") from None
    if proc.returncode != 0:
        raise LaunchError(f"host discovery script {script} exited with {proc.returncode}: "
                          f"{proc.stderr.strip()[-300:]}")
    return parse_discovery(proc.stdout, slots_per_host)
