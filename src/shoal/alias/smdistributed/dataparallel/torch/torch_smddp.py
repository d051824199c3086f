"""``import smdistributed.dataparallel.torch.torch_smddp``: makes ``"smddp"`` a
``torch.distributed`` backend, and that backend is shoal's, so
``init_process_group(backend="smddp")`` and stock DDP run over shoal."""

from shoal.torch.backend import register

BACKEND = "smddp"
register(BACKEND)
