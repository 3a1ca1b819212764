"""`python -m tests.model [slow]`: run the model check and print states and time per bound."""

from __future__ import annotations

import sys

from tests.model.checker import Checker
from tests.model.configs import DEFAULT, SLOW


def main(argv: list[str]) -> int:
    configs = DEFAULT + (SLOW if "slow" in argv[1:] else [])
    for config in configs:
        r = Checker(config).run()
        print(
            f"{r.states:9} states {r.transitions:9} steps {r.seconds:7.2f} s  {r.name}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
