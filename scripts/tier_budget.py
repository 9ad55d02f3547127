"""The default tier's budget, checked by CI after the tier has run (.ci/run).

Reads the JUnit XML that pytest wrote for the tier (``PYTEST_ADDOPTS=--junitxml=FILE``), prints
its ten slowest tests and its total (the wall time since ``--started``, the epoch second at which
the tier's command began), and exits 1 when the total passes the budget: 6 minutes on
a machine of the reference speed (2 cores of the kind the project's CI runs on), so that the next
slow test is seen when it is added.

The same machine's speed swings from day to day (the same commit's default tier took 6 min 20 s
in one CI run and 12 min 50 s in another). So the budget is scaled by how much slower than its
reference this machine runs a fixed piece of work now (pure Python and a DuckDB query, the
suite's two costs), and never scaled down: a slow day does not fail CI, a slow test does.

    python scripts/tier_budget.py FILE --started EPOCH [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import xml.etree.ElementTree as ET

BUDGET_S = 360.0
# seconds the reference work took on a quiet 2-core machine of CI's kind (median of 5)
REFERENCE_S = 0.38


def reference_work() -> float:
    """Seconds for a fixed piece of the suite's kind of work: a Python loop over dicts and a
    DuckDB aggregate over four million rows."""
    import duckdb  # imported before the clock starts

    start = time.perf_counter()
    counts: dict[int, int] = {}
    for i in range(2_000_000):
        counts[i % 977] = counts.get(i % 977, 0) + i
    con = duckdb.connect()
    con.execute("set threads = 1")
    con.execute(
        "select i % 128 as k, median(i * 1.5), count(*) from range(4000000) t(i) group by k"
    ).fetchall()
    con.close()
    return time.perf_counter() - start


def slowdown(repeats: int = 5) -> float:
    """How much slower than the reference this machine runs the reference work now (>= 1):
    the median of ``repeats`` runs after one to warm up."""
    reference_work()
    return max(1.0, statistics.median(reference_work() for _ in range(repeats)) / REFERENCE_S)


def read(path: str) -> list[tuple[float, str]]:
    """Each test's (seconds, id) in the JUnit XML at ``path``."""
    root = ET.parse(path).getroot()
    return [
        (float(c.get("time", 0)), f"{c.get('classname', '')}::{c.get('name', '')}")
        for c in root.iter("testcase")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="the JUnit XML pytest wrote for the default tier")
    parser.add_argument(
        "--started", type=float, required=True, help="the epoch second the tier's command began"
    )
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds at reference speed")
    args = parser.parse_args(argv)
    total = time.time() - args.started
    try:
        tests = read(args.junit)
    except (OSError, ET.ParseError, ValueError) as e:
        print(f"tier_budget: cannot read {args.junit}: {e}", file=sys.stderr)
        return 2
    print("the default tier's ten slowest tests:")
    for seconds, name in sorted(tests, reverse=True)[:10]:
        print(f"  {seconds:7.2f} s  {name}")
    factor = slowdown()
    allowed = args.budget * factor
    verdict = "within" if total <= allowed else "OVER"
    print(
        f"the default tier: {len(tests)} tests in {total:.0f} s; budget {args.budget:.0f} s at "
        f"reference speed, {allowed:.0f} s on this machine now ({factor:.2f}x slower than the "
        f"reference): {verdict}"
    )
    return 0 if total <= allowed else 1


if __name__ == "__main__":
    sys.exit(main())
