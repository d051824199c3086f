"""torch's own backend conformance tests, run as torch's ``test_distributed_spawn.py`` runs
them: ``DistributedTest._DistTestBase`` (shipped in the torch wheel) under ``TestDistBackend``,
one spawned process per rank, for the backend named by ``BACKEND``.

    BACKEND=shoal WORLD_SIZE=2 python -m pytest tests/torchdist/suite.py
    scripts/torch-suite.sh          # gloo and shoal side by side, both counts

``"shoal"`` is registered as a c10d plugin and named in ``DistTestCases.backend_feature``
(``plugin``, ``ddp``, ``subgroup``) before torch's module is imported, in the parent and in
every spawned rank (spawn re-imports this module). Nothing of torch's is copied here.
"""

from __future__ import annotations

import os

os.environ.setdefault("BACKEND", "shoal")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")  # replaced per test by TestDistBackend.setUp

from torch.testing._internal.common_distributed import DistTestCases

if os.environ["BACKEND"] == "shoal":
    import shoal.torch.backend

    shoal.torch.backend.register()
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("shoal")

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of ``_DistTestBase``, each rank a spawned process."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
