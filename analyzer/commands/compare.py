"""``megascope compare RUN_A RUN_B``: whether B trains slower than A, where, beyond the noise.

Step time, each phase, each collective kind and group and each rank, A against B, with an
interval from the steps' spread, and the findings of each run side by side (analyzer/compare.py).
Exit status: 0 when both runs could be read; with ``--fail-above PCT``, 1 when B's step time is
worse than A's by more than PCT percent of A's beyond the noise (the whole interval of the
difference above it); 2 with a one-line reason on unusable input, never a traceback.
"""

from __future__ import annotations

import logging

from analyzer.commands import add_output_args, emit, output_format
from tracer.cliutil import ArgumentParser, UsageError

log = logging.getLogger(__name__)

EXIT_SLOWER = 1


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope compare``."""
    p = ArgumentParser(
        prog="megascope compare",
        description=__doc__.splitlines()[0],
        epilog=f"exit status: 0; {EXIT_SLOWER} with --fail-above PCT when B's step time is worse "
        "than A's by more than PCT% beyond the noise; 2 on unusable input",
    )
    p.add_argument("run_a", metavar="RUN_A", help="the reference run")
    p.add_argument("run_b", metavar="RUN_B", help="the run compared with it")
    add_output_args(p)
    p.add_argument(
        "--fail-above",
        type=float,
        metavar="PCT",
        help=f"exit {EXIT_SLOWER} when B's step time is worse than A's by more than PCT%% "
        "beyond the noise (for CI)",
    )
    p.add_argument(
        "--no-whatif",
        action="store_true",
        help="the findings' severities from each detector's estimate, without the what-if (faster)",
    )
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megascope compare``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="megascope: warning: %(message)s")
    if args.fail_above is not None and not args.fail_above >= 0:
        raise UsageError(f"--fail-above {args.fail_above:g}: expected a percentage >= 0")
    fmt = output_format(args)

    from analyzer.compare import CompareError, compare
    from analyzer.db import RunError, open_run
    from analyzer.render.compare import render

    runs = []
    try:
        for path in (args.run_a, args.run_b):
            try:
                runs.append(open_run(path))
            except RunError as e:
                raise UsageError(str(e)) from None
        try:
            report = compare(
                runs[0], runs[1], whatif=not args.no_whatif, fail_above=args.fail_above
            )
        except CompareError as e:
            raise UsageError(str(e)) from None
        except Exception as e:  # a run we cannot read must not print a traceback
            log.debug("comparison failed", exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UsageError(f"cannot compare {args.run_a} with {args.run_b}: {first}") from None
    finally:
        for run in runs:
            run.close()
    emit(args, report, render(report, fmt))
    failed = (report.get("fail_above") or {}).get("failed")
    return EXIT_SLOWER if failed else 0
