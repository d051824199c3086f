"""A rank of :func:`shoal.run` (``python -m shoal.runner.task``, started by shoalrun): it
fetches the function from the job's function store, calls it, and leaves its return value, or
its exception, there under its rank."""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def main() -> int:
    """Run this rank's call; 0, or 1 when the function raised (its error is in the store)."""
    from shoal.core.auth import secret_bytes
    from shoal.core.rendezvous import StoreClient
    from shoal.runner.func import ADDR_VAR, SECRET_VAR
    addr, _, port = os.environ[ADDR_VAR].rpartition(":")
    rank = int(os.environ["SHOAL_RANK"])
    store = StoreClient(addr, int(port), secret_bytes(os.environ.pop(SECRET_VAR)),
                        timeout=30.0)
    try:
        fn, args, kwargs = pickle.loads(store.get("fn"))
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # reported by rank to the caller of shoal.run
            store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}\n"
                                       f"{traceback.format_exc()}".encode())
            return 1
        store.set(f"result/{rank}", pickle.dumps(value))
        return 0
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
