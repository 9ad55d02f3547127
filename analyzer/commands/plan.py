"""``megascope plan RUN [--json]``: which layout of the run's ranks trains its batch fastest.

Fits a cost model on the traced run (compute per FLOP, collectives per byte and group kind,
the optimizer per parameter), replays a step of every dp x tp x pp x cp layout of the same
ranks on the simulator's step graph, prices each layout's memory per rank, and ranks them.
Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import sys

from tracer.cliutil import ArgumentParser, UsageError, write_out


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope plan", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="a traced run directory")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the JSON plan to FILE")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory of one device, e.g. 80GiB (default: the run's device)")  # fmt: skip
    p.add_argument("--no-recompute", action="store_true",
                   help="leave out the layouts with full recompute")  # fmt: skip
    p.add_argument("--sharded-only", action="store_true",
                   help="leave out the layouts whose optimizer is not sharded over dp")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope plan``; returns the exit status."""
    args = _parser().parse_args(argv)
    from analyzer.db import RunError
    from analyzer.plan import PlanError, plan_run, render

    try:
        report = plan_run(args.run, device_memory=args.device_memory,
                          recompute=not args.no_recompute, sharding=not args.sharded_only)  # fmt: skip
    except (PlanError, RunError) as e:
        raise UsageError(str(e)) from None
    text = json.dumps(report, indent=2)
    if args.out:
        write_out(args.out, text + "\n")
    print(text if args.json else render(report), file=sys.stdout)
    return 0
