"""``scripts/gpu-check.sh``: one prepared check of shoal's device path on a machine with one
NVIDIA GPU, whose ranks share it (``--dry-run`` walks every step on CPU tensors through the
device stage's stand-in, so the script is proven before GPU time is spent on it).

- :mod:`.checks`: what each rank runs (collectives against numpy, AMP training against one
  process on the global batch, SyncBatchNorm and DDP over backend "shoal", a profiled step);
- :mod:`.worker`: one check in one rank, under shoalrun, writing its JSON;
- :mod:`.main`: runs the checks and the application's benchmark, writes one JSON file, and
  exits non-zero on any failure.
"""
