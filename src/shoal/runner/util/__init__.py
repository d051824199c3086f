"""``horovod.runner.util``: thread helpers (:mod:`.threads`) and the driver's address
(:mod:`.network`)."""

__all__ = ["network", "threads"]
