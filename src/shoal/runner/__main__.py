"""``python -m shoal.runner ...`` is ``shoalrun ...``."""

from __future__ import annotations

import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
