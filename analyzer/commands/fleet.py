"""``megascope fleet RUN_OR_ROOT...``: a table of runs and the culprits that recur across them.

Exit status: 0 when at least one run could be read (a run that cannot is one line on stderr
and left out), 2 when none could, never a traceback.
"""

from __future__ import annotations

import json
import sys

from analyzer.render.fleet import render_text
from tracer.cliutil import ArgumentParser, UsageError, log_warnings, write_out


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope fleet``."""
    p = ArgumentParser(prog="megascope fleet", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN_OR_ROOT", help="runs, or folders of runs")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="FILE", help="write the report to FILE (JSON)")
    p.add_argument("--engine", choices=("local", "dask"), default="local")
    p.add_argument("--scheduler", metavar="ADDR", help="a running Dask scheduler")
    p.add_argument("--workers", type=int, metavar="N", help="workers of the local Dask cluster")
    p.add_argument("--no-whatif", action="store_true", help="detectors' own severities (faster)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megascope fleet``; returns the exit status."""
    args = build_parser().parse_args(argv)
    log_warnings()
    from analyzer.executor import make_engine
    from analyzer.fleet import find_runs, fleet

    paths, bad = find_runs(args.runs)
    for b in bad:
        print(f"megascope: warning: {b['error']} (skipped)", file=sys.stderr)
    if not paths:
        raise UsageError("no run to read")
    with make_engine(args.engine, args.scheduler, args.workers) as engine:
        report = fleet(paths, engine, whatif=not args.no_whatif)
        if engine.name != "local":
            report["engine"] = engine.report()
    for s in report["skipped"]:
        print(f"megascope: warning: {s['error']} (skipped)", file=sys.stderr)
    report["skipped"] = bad + report["skipped"]
    if not report["runs"]:
        raise UsageError("no run could be read")
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        write_out(args.out, text)
    if args.json:
        sys.stdout.write(text)
    elif not args.out:
        sys.stdout.write(render_text(report))
    return 0
