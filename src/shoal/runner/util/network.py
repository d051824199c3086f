"""``horovod.runner.util.network``: the address a driver gives its workers."""

from __future__ import annotations

import socket
from collections.abc import Iterable

from ..hosts import interface_address

__all__ = ["get_driver_ip"]


def get_driver_ip(nics: Iterable[str] | None = None) -> str:
    """This machine's IPv4 address on the first of ``nics`` (network interface names), or,
    without any, the one its host name resolves to."""
    names = sorted(nics or ())
    if names:
        return interface_address(names[0])
    return socket.gethostbyname(socket.gethostname())
