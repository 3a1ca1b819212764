"""`python -m tests.model [slow] [flow | fleet | admission | children]`: run the core, shell, flow,
fleet, admission and children model checks (with `flow`: only the flow's and the fleet's; with
`fleet`: only the fleet's; with `admission`: only flow control's admission, docs/adr/0142; with
`children`: only child flows', on the wired engine's rule, docs/adr/0163); states and time each."""

from __future__ import annotations

import sys

from tests.model.admission import ADMISSION_DEFAULT, ADMISSION_SLOW, AdmissionChecker
from tests.model.checker import Checker
from tests.model.children import ChildrenChecker
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
from tests.model.test_children_model import DEFAULT as CHILDREN_DEFAULT
from tests.model.test_children_model import LARGER as CHILDREN_SLOW


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
    children = CHILDREN_DEFAULT + (CHILDREN_SLOW if slow else ())
    if "children" in args:
        reports = []
    if "children" in args or not ("flow" in args or "fleet" in args or "admission" in args):
        reports += [ChildrenChecker(c).run for c in children]
    for run in reports:
        r = run()
        print(
            f"{r.states:9} states {r.transitions:9} steps {r.seconds:7.2f} s  {r.name}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
