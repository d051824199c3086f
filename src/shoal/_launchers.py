"""The variables in which launchers tell a process its rank and the job's size, in Horovod's
order, then torchrun's and SLURM's. Standard library only: the import switch reads it at
interpreter start, where importing shoal's runner would cost the start of every process."""

__all__ = ["RANK_AND_SIZE_VARS"]

RANK_AND_SIZE_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"),  # horovodrun, shoalrun
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
                      ("PMI_RANK", "PMI_SIZE"),  # MPICH, Intel MPI
                      ("RANK", "WORLD_SIZE"),  # torchrun
                      ("SLURM_PROCID", "SLURM_NTASKS"))
