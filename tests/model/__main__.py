"""`python -m tests.model [slow] [flow | fleet]`: run the core, shell, flow and fleet model checks
(with `flow`: only the flow's and the fleet's; with `fleet`: only the fleet's); states and time
each."""

from __future__ import annotations

import sys

from tests.model.checker import Checker
from tests.model.configs import (
    DEFAULT,
    FLEET_DEFAULT,
    FLEET_SLOW,
    FLOW_DEFAULT,
    FLOW_SLOW,
    SHELL_DEFAULT,
    SHELL_SLOW,
    SLOW,
)
from tests.model.fleet import FleetChecker
from tests.model.flow import FlowChecker
from tests.model.shell import ShellChecker


def main(argv: list[str]) -> int:
    configs = DEFAULT + (SLOW if "slow" in argv[1:] else [])
    shell = SHELL_DEFAULT + (SHELL_SLOW if "slow" in argv[1:] else [])
    flow = FLOW_DEFAULT + (FLOW_SLOW if "slow" in argv[1:] else [])
    fleet = FLEET_DEFAULT + (FLEET_SLOW if "slow" in argv[1:] else [])
    reports = [Checker(c).run for c in configs] + [ShellChecker(c).run for c in shell]
    if "flow" in argv[1:] or "fleet" in argv[1:]:
        reports = []
    if "fleet" not in argv[1:]:
        reports += [FlowChecker(c).run for c in flow]
    reports += [FleetChecker(c).run for c in fleet]
    for run in reports:
        r = run()
        print(
            f"{r.states:9} states {r.transitions:9} steps {r.seconds:7.2f} s  {r.name}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
