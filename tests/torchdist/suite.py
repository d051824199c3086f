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

if os.environ["BACKEND"] == "shoal" or os.environ.get("SHOAL_SUITE_AS"):
    import shoal.torch.backend

    shoal.torch.backend.register()
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("shoal")

if os.environ.get("SHOAL_SUITE_AS"):
    # Some of torch's tests run only for a backend *named* gloo. SHOAL_SUITE_AS=gloo (with
    # BACKEND=gloo) runs them on shoal: every process group the tests ask gloo for is made
    # by shoal instead. Tests that check the backend's name then fail, as they should.
    import torch.distributed as dist

    _alias = os.environ["SHOAL_SUITE_AS"]

    def _swap(backend):
        return "shoal" if backend is not None and str(backend).lower() == _alias else backend

    _init, _new_group = dist.init_process_group, dist.new_group

    def _init_as(*args, backend=None, **kwargs):
        if args:
            args = (_swap(args[0]), *args[1:])
        return _init(*args, backend=_swap(backend), **kwargs)

    def _new_group_as(*args, backend=None, **kwargs):
        return _new_group(*args, backend=_swap(backend), **kwargs)

    dist.init_process_group = _init_as
    dist.new_group = _new_group_as

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
