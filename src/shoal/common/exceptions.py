"""``horovod.common.exceptions``: the errors elastic training catches, as shoal raises them."""

from __future__ import annotations

from shoal.core.elastic import HostsUpdatedInterrupt
from shoal.core.errors import PeerLostError as HorovodInternalError
from shoal.core.errors import ShoalError

__all__ = ["HorovodInternalError", "HorovodVersionMismatchError", "HostsUpdatedInterrupt",
           "get_version_mismatch_message"]


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """Horovod's message for a framework whose version differs from the one built against."""
    return (f"Framework {name} installed with version {installed_version} but found version "
            f"{version}. shoal is pure Python and needs no rebuild: this only matters to code "
            f"that checks it.")


class HorovodVersionMismatchError(ShoalError, ImportError):
    """A framework version differs from an expected one (raised by
    :func:`shoal.common.util.check_installed_version` when given an exception)."""

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name, self.version, self.installed_version = name, version, installed_version
