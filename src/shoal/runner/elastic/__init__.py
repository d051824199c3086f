"""Elastic jobs: the driver (:mod:`.driver`), where hosts come from (:mod:`.discovery`,
Horovod's ``horovod.runner.elastic.discovery``) and shoalrun's workers that are processes
(:mod:`.processes`)."""

from .discovery import FixedHosts, HostDiscovery, HostDiscoveryScript, discover, parse_discovery
from .driver import (
    COOLDOWN_MAX_S,
    DISCOVER_HOSTS_FREQUENCY_SECS,
    Blacklist,
    Driver,
    ElasticOptions,
    Member,
    drive,
)
from .processes import ProcessDriver, run_elastic

__all__ = ["COOLDOWN_MAX_S", "DISCOVER_HOSTS_FREQUENCY_SECS", "Blacklist", "Driver",
           "ElasticOptions", "FixedHosts", "HostDiscovery", "HostDiscoveryScript", "Member",
           "ProcessDriver", "discover", "drive", "parse_discovery", "run_elastic"]
