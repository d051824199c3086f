"""``horovod.common.elastic``: the state classes and the reset loop (:mod:`shoal.core.elastic`)."""

from shoal.core.elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "run_fn"]
