"""``megascope compare RUN_A RUN_B``: whether B trains slower than A, where, beyond the noise.

Step time, each phase, each collective kind and group and each rank, A against B, with an
interval from the steps' spread, and the findings of each run side by side (analyzer/compare.py).
``megascope compare A1 A2 A3 -- B``: baseline runs of one configuration as the reference, their
steps pooled, their spread in the gate's drift. Exit status: 0 when the runs could be read; with
``--fail-above PCT``, 1 when B's median step is slower than A's by more than PCT percent and
beyond a noise model that holds the run-to-run drift (analyzer/compare_gate.py); 2 with a
one-line reason on unusable input, never a traceback.
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
        usage="megascope compare RUN_A RUN_B [options] | A1 A2 ... -- B [options]",
        epilog=f"exit status: 0; {EXIT_SLOWER} with --fail-above PCT when B's median step is slower "
        "than A's by more than PCT% and beyond the noise; 2 on unusable input",
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="RUN_A RUN_B: the reference run and the run compared with it; or baseline runs "
        "A1 A2 ... then -- B",
    )
    add_output_args(p)
    p.add_argument(
        "--fail-above",
        type=float,
        metavar="PCT",
        help=f"exit {EXIT_SLOWER} when B's median step is slower than A's by more than PCT%% "
        "and beyond the noise, run-to-run drift included (for CI)",
    )
    p.add_argument(
        "--drift",
        type=float,
        metavar="PCT",
        default=None,
        help="with --fail-above: the run-to-run spread of a run's median step the gate assumes "
        "where baseline runs do not measure it, in %% of the step (default: 3, pooled with the "
        "baselines' own spread)",
    )
    p.add_argument(
        "--no-whatif",
        action="store_true",
        help="the findings' severities from each detector's estimate, without the what-if (faster)",
    )
    return p


def split_runs(argv: list[str]) -> tuple[list[str], list[str], str | None]:
    """``argv`` split at ``--``: the arguments before it, the options after B, and B (None
    without ``--``). A ``--`` with no run after it is a :class:`UsageError`."""
    if "--" not in argv:
        return argv, [], None
    i = argv.index("--")
    after = argv[i + 1 :]
    if not after or after[0].startswith("-"):
        raise UsageError("expected the run B after --: megascope compare A1 A2 ... -- B")
    return argv[:i], after[1:], after[0]


def references(runs: list[str], b: str | None) -> tuple[list[str], str]:
    """The reference runs and B from the positional runs and the run after ``--``."""
    if b is None:
        if len(runs) != 2:
            raise UsageError(
                f"expected two runs, RUN_A RUN_B, got {len(runs)}; several baseline runs "
                "take -- before B: megascope compare A1 A2 A3 -- B"
            )
        return runs[:1], runs[1]
    if not runs:
        raise UsageError("expected at least one reference run before --")
    return runs, b


def main(argv: list[str]) -> int:
    """Entry point of ``megascope compare``; returns the exit status."""
    before, after, run_b = split_runs(argv)
    args = build_parser().parse_intermixed_args(before + after)
    if any(r.startswith("-") for r in args.runs):  # a run named like an option
        raise UsageError(f"not a run: {next(r for r in args.runs if r.startswith('-'))}")
    extra = [r for r in args.runs if r not in before]
    if run_b is not None and extra:
        raise UsageError(f"expected one run after --, got {1 + len(extra)}: the run B")
    refs, run_b = references(args.runs, run_b)
    logging.basicConfig(level=logging.WARNING, format="megascope: warning: %(message)s")
    if args.fail_above is not None and not args.fail_above >= 0:
        raise UsageError(f"--fail-above {args.fail_above:g}: expected a percentage >= 0")
    if args.drift is not None and not args.drift >= 0:
        raise UsageError(f"--drift {args.drift:g}: expected a percentage >= 0")
    fmt = output_format(args)

    from analyzer.compare import CompareError, compare
    from analyzer.compare_gate import DRIFT_PRIOR
    from analyzer.db import RunError, open_run
    from analyzer.render.compare import render

    runs = []
    try:
        for path in (*refs, run_b):
            try:
                runs.append(open_run(path))
            except RunError as e:
                raise UsageError(str(e)) from None
        try:
            report = compare(
                runs[:-1],
                runs[-1],
                whatif=not args.no_whatif,
                fail_above=args.fail_above,
                drift_prior=DRIFT_PRIOR if args.drift is None else args.drift,
            )
        except CompareError as e:
            raise UsageError(str(e)) from None
        except Exception as e:  # a run we cannot read must not print a traceback
            log.debug("comparison failed", exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UsageError(f"cannot compare {' + '.join(refs)} with {run_b}: {first}") from None
    finally:
        for run in runs:
            run.close()
    emit(args, report, render(report, fmt))
    failed = (report.get("fail_above") or {}).get("failed")
    return EXIT_SLOWER if failed else 0
