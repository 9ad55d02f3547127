"""``megascope whatif RUN [--json]``: how much faster the run would be without its stragglers.

Replays the run's steps on their dependency graph with every operation at its typical duration
(the ideal) and with chosen subsets at their measured durations (ByteDance Seed's what-if
analysis, OSDI 2025): the slowdown S over the ideal, S by rank, dp rank, stage, op kind and step,
and the study's M_W (individual workers) and M_S (the last stage). Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import sys

from analyzer.render.whatif import render
from tracer.cliutil import ArgumentParser, UsageError, log_warnings, parse_steps, write_out


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope whatif", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--steps", metavar="A:B", help="only steps A..B (inclusive)")
    p.add_argument("--typical", choices=("study", "median"), default="study",
                   help="study: mean compute / median transfer over all steps (default); "
                        "median: median of the peers in the same step")  # fmt: skip
    p.add_argument("--max-groups", type=int, default=16, metavar="N",
                   help="replay at most N dp ranks past 2N (those over their typical the most)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope whatif``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.max_groups < 1:
        raise UsageError(f"--max-groups must be >= 1, got {args.max_groups}")
    from analyzer.whatif import WhatIfError, analyze_whatif

    log_warnings()

    try:
        report = analyze_whatif(
            args.run, parse_steps(args.steps), max_groups=args.max_groups, typical=args.typical
        )
    except WhatIfError as e:
        raise UsageError(str(e)) from None
    text = json.dumps(report, indent=2)
    if args.out:
        write_out(args.out, text + "\n")
    print(text if args.json else render(report), file=sys.stdout)
    return 0
