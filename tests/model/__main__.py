"""`python -m tests.model [slow] [flow | fleet | admission]`: run the core, shell, flow, fleet and
admission model checks (with `flow`: only the flow's and the fleet's; with `fleet`: only the
fleet's; with `admission`: only flow control's admission, docs/adr/0142); states and time each."""

from __future__ import annotations

import sys

from tests.model.admission import ADMISSION_DEFAULT, ADMISSION_SLOW, AdmissionChecker
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
    args = argv[1:]
    slow = "slow" in args
    configs = DEFAULT + (SLOW if slow else [])
    shell = SHELL_DEFAULT + (SHELL_SLOW if slow else [])
    flow = FLOW_DEFAULT + (FLOW_SLOW if slow else [])
    fleet = FLEET_DEFAULT + (FLEET_SLOW if slow else [])
    admission = ADMISSION_DEFAULT + (ADMISSION_SLOW if slow else [])
    reports = [Checker(c).run for c in configs] + [ShellChecker(c).run for c in shell]
    if "flow" in args or "fleet" in args or "admission" in args:
        reports = []
    if "admission" not in args:
        if "fleet" not in args:
            reports += [FlowChecker(c).run for c in flow]
        reports += [FleetChecker(c).run for c in fleet]
    if not ("flow" in args or "fleet" in args):
        reports += [AdmissionChecker(c).run for c in admission]
    for run in reports:
        r = run()
        print(
            f"{r.states:9} states {r.transitions:9} steps {r.seconds:7.2f} s  {r.name}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
