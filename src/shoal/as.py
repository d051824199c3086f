"""``python -m shoal.as KIND SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``): run a Horovod
(``KIND`` = ``horovod``) or SMDDP (``smddp``) script unchanged on shoal, under any launcher
(torchrun, srun, mpirun). The import switch (:mod:`shoal.alias`) is installed here and in
every Python process the script starts."""

from shoal.alias.main import main

if __name__ == "__main__":
    raise SystemExit(main())
