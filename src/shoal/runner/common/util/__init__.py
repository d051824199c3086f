"""``horovod.runner.common.util``: the launcher helpers scripts import (:mod:`.env`,
:mod:`.secret`)."""

__all__ = ["env", "secret"]
