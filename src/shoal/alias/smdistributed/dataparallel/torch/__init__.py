"""``smdistributed.dataparallel.torch`` under the import switch: ``torch_smddp`` (the backend
``"smddp"``), and SMDDP's version-1 API, ``distributed`` and ``parallel.distributed``."""
