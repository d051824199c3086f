"""``horovod.runner.common.util.env``: this process's rank and size as its launcher says."""

from __future__ import annotations

import os
import re

from shoal._launchers import RANK_AND_SIZE_VARS

from . import secret

__all__ = ["IGNORE_REGEXES", "LOG_LEVEL_STR", "RANK_AND_SIZE_VARS", "get_env_rank_and_size",
           "is_exportable"]

LOG_LEVEL_STR = ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]
#: variables a launcher does not forward to remote workers
IGNORE_REGEXES = {"BASH_FUNC_.*", "OLDPWD", ".*CUDA_VISIBLE_DEVICES", secret.HOROVOD_SECRET_KEY}


def is_exportable(name: str) -> bool:
    """Whether a launcher forwards the variable ``name`` to remote workers."""
    return not any(re.match(pattern, name) for pattern in IGNORE_REGEXES)


def get_env_rank_and_size() -> tuple[int, int]:
    """``(rank, size)`` from the variables of whichever launcher started this process;
    ``(0, 1)`` for a lone process. RuntimeError where a launcher set only one of the two."""
    for rank_var, size_var in RANK_AND_SIZE_VARS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of "
                               f"{rank_var} and {size_var} found in environment")
    return 0, 1
