"""One GPU per process for TensorFlow, as Horovod's documented recipe does.

TensorFlow maps every visible GPU into every process and allocates nearly all their memory
at start: eight processes on an eight-GPU host all take all eight and place their work on
GPU 0. :func:`pin_gpu` turns on memory growth and leaves one GPU visible per local rank
(``local_rank % count``, so ranks share when there are fewer GPUs than ranks). It only
configures, and must run before TensorFlow first touches a GPU; :func:`init` (what
``shoal.tensorflow.init`` and ``shoal.keras.init`` are) does it right after joining the job.
"""

from __future__ import annotations

import logging
from typing import Any

from shoal.core import api

__all__ = ["init", "pin_gpu"]

log = logging.getLogger("shoal.tensorflow")


def pin_gpu(local_rank: int, tf: Any = None, local_size: int | None = None) -> str | None:
    """Make only GPU ``local_rank % count`` visible to TensorFlow, with memory growth;
    returns its name, or None on a machine without GPUs (then nothing changes). With
    ``local_size`` ranks on the host and fewer GPUs, it says that they share."""
    if tf is None:
        import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    chosen = gpus[local_rank % len(gpus)]
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(chosen, "GPU")
    except RuntimeError as exc:  # TensorFlow set its GPUs up before shoal was initialised
        log.warning("shoal: could not pin local rank %d to %s (%s); call shoal's init() "
                    "before any TensorFlow operation, or pin GPUs yourself", local_rank,
                    chosen.name, exc)
        return None
    if local_size is not None and len(gpus) < local_size:
        log.warning("shoal: %d local ranks share %d GPU(s); local rank %d uses %s",
                    local_size, len(gpus), local_rank, chosen.name)
    return chosen.name


def init(comm: Any = None, process_sets: Any = (), **kwargs: Any) -> None:
    """``shoal.init`` (the same arguments: Horovod's ``comm`` and ``process_sets``, shoal's
    settings), then one GPU for this process (:func:`pin_gpu`)."""
    first = not api.is_initialized()
    api.init(comm, process_sets, **kwargs)
    if first:
        pin_gpu(api.local_rank(), local_size=api.local_size())
