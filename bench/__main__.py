"""``python -m bench [NAME ...]``: run the benchmarks (all of them by default), each in its
own process, writing ``bench/results/NAME.json``; then the tables of
``docs/performance.md`` are made again from the results (``bench/report.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

from bench import report

ALL = ["overhead", "vllmclient", "relay", "coldstart", "scaling", "faults", "swap", "ledger",
       "toolcalls", "lora", "batch", "hostile", "route_cost", "replicas"]


def main() -> int:
    names = sys.argv[1:] or ALL
    unknown = set(names) - set(ALL)
    if unknown:
        print(f"unknown benchmark(s): {', '.join(sorted(unknown))}; choose from {ALL}")
        return 2
    failed = []
    for name in names:
        started = time.monotonic()
        print(f"== bench {name}", flush=True)
        code = subprocess.call([sys.executable, "-m", f"bench.{name}"])
        print(f"== bench {name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code:
            failed.append(name)
    if report.write():
        print(f"== {report.PAGE.relative_to(report.ROOT)}: tables made again from the results")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
