"""``horovod.runner.util``: thread helpers (:mod:`.threads`)."""

__all__ = ["threads"]
