"""`make bench`: run every `tests/bench/bench_*.py` module's `benchmarks()` and print one table.

`python -m tests.bench stm` runs only the modules whose name contains `stm`.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import tests.bench as pkg
from tests.bench._harness import Row, print_table


def main(argv: list[str]) -> int:
    wanted = argv[1:]
    rows: list[Row] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("bench_"):
            continue
        if wanted and not any(w in info.name for w in wanted):
            continue
        module = importlib.import_module(f"tests.bench.{info.name}")
        print(f"# {info.name}", flush=True)
        got = list(module.benchmarks())
        print_table(got)
        print(flush=True)
        rows.extend(got)
    print("# all figures")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
