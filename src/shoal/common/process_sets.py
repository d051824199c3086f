"""``horovod.common.process_sets``: shoal's process sets (:mod:`shoal.core.process_sets`)."""

from shoal.core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
