"""``megascope import kineto|flight-recorder|whatif DIR --out RUN``: traces of other tools as a run.

A file that cannot be read is skipped with a one-line warning when the others import
(``--strict`` makes it fatal); when nothing imports, or a pickle names code, the command
exits 2 with one line naming the file.
"""

from __future__ import annotations

import sys

from analyzer.importers.common import ImportResult, TraceError
from tracer.cliutil import ArgumentParser, UsageError, log_warnings

FORMATS = ("kineto", "flight-recorder", "whatif")


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope import", description=__doc__.splitlines()[0])
    p.add_argument("format", choices=FORMATS, help="what DIR holds")
    p.add_argument("directory", metavar="DIR", help="one file per rank (whatif: TRACE.parquet)")
    p.add_argument("--out", required=True, metavar="RUN", help="the run directory to create")
    p.add_argument("--strict", action="store_true", help="fail on any unreadable file")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="kineto: parse N files at once (default: by input size and cores)")  # fmt: skip
    p.add_argument("--exact-ns", action="store_true",
                   help="kineto: keep nanosecond times (default: whole microseconds, as HTA)")  # fmt: skip
    p.add_argument("--meta", metavar="META.yaml",
                   help="whatif: the job's sizes (dp/pp/tp/dsp/vpp_size, world_size)")  # fmt: skip
    return p


def _summary(fmt: str, result: ImportResult) -> str:
    rows = ", ".join(f"{n} {table}" for table, n in sorted(result.rows.items()))
    ranks = result.ranks
    span = f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    text = f"imported {fmt}: {len(ranks)} ranks ({span}) into {result.run_dir}: {rows}"
    text += f"; status {result.status}"
    if result.skipped:
        text += f"; skipped {len(result.skipped)} file(s)"
    for note in result.notes:
        text += f"; {note}"
    return text


def main(argv: list[str]) -> int:
    """Entry point of ``megascope import``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    log_warnings()
    try:
        if args.format == "kineto":
            from analyzer.importers.kineto import import_kineto

            result = import_kineto(
                args.directory,
                args.out,
                strict=args.strict,
                workers=args.workers,
                exact_ns=args.exact_ns,
            )
        elif args.format == "whatif":
            from analyzer.importers.whatif import import_whatif

            if not args.meta:
                raise UsageError("import whatif needs --meta META.yaml")
            result = import_whatif(args.directory, args.meta, args.out)
        else:
            from analyzer.importers.flight_recorder import import_flight_recorder

            result = import_flight_recorder(args.directory, args.out, strict=args.strict)
    except TraceError as e:
        raise UsageError(str(e)) from None
    from analyzer.digests import write_digests

    write_digests(args.out)  # the digests a traced run has (docs/spec.md §2)
    print(_summary(args.format, result), file=sys.stdout)
    return 0
