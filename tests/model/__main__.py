"""`python -m tests.model [slow] [flow]`: run the core, shell and flow model checks (with `flow`:
only the flow's); states and time each."""

from __future__ import annotations

import sys

from tests.model.checker import Checker
from tests.model.configs import (
    DEFAULT,
    FLOW_DEFAULT,
    FLOW_SLOW,
    SHELL_DEFAULT,
    SHELL_SLOW,
    SLOW,
)
from tests.model.flow import FlowChecker
from tests.model.shell import ShellChecker


def main(argv: list[str]) -> int:
    configs = DEFAULT + (SLOW if "slow" in argv[1:] else [])
    shell = SHELL_DEFAULT + (SHELL_SLOW if "slow" in argv[1:] else [])
    flow = FLOW_DEFAULT + (FLOW_SLOW if "slow" in argv[1:] else [])
    reports = [Checker(c).run for c in configs] + [ShellChecker(c).run for c in shell]
    if "flow" in argv[1:]:
        reports = []
    reports += [FlowChecker(c).run for c in flow]
    for run in reports:
        r = run()
        print(
            f"{r.states:9} states {r.transitions:9} steps {r.seconds:7.2f} s  {r.name}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
