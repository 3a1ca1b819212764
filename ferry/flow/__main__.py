"""``python -m ferry.flow STORE COMMAND``: the flow inspector (see `ferry.flow._ops._inspect`)."""

from __future__ import annotations

import sys

from ._ops._inspect import main

if __name__ == "__main__":
    sys.exit(main())
