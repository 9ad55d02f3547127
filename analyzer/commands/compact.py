"""``megascope compact RUN``: rewrite a finished run as a few large files per table (the work
is analyzer/compact.py's)."""

from __future__ import annotations

from analyzer.compact import DEFAULT_FILE_MB, CompactError, compact
from tracer.cliutil import ArgumentParser, UsageError, log_warnings


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope compact``."""
    p = ArgumentParser(prog="megascope compact", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument(
        "--force",
        action="store_true",
        help="compact a run whose run.json still says running, or leave out unreadable parts",
    )
    p.add_argument(
        "--file-mb",
        type=float,
        default=DEFAULT_FILE_MB,
        help=f"input MiB gathered into one file (default {DEFAULT_FILE_MB})",
    )
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megascope compact``: one line per table compacted; returns the exit
    status."""
    args = build_parser().parse_args(argv)
    log_warnings()
    try:
        res = compact(args.run, force=args.force, file_mb=args.file_mb)
    except CompactError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{args.run}: {e.strerror or e}") from None
    for t in res.tables:
        if not t.files_before:
            continue
        if t.skipped:
            print(f"{t.table:<11} already compact: {t.files_after} files")
            continue
        print(
            f"{t.table:<11} {t.files_before:>7} files {t.bytes_before / 2**20:9.1f} MiB -> "
            f"{t.files_after:>3} files {t.bytes_after / 2**20:9.1f} MiB  ({t.rows} rows)"
        )
    print(f"compacted {res.run_dir} in {res.seconds:.1f} s")
    return 0
