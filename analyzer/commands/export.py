"""``megascope export chrome RUN --out FILE.json``: a run as Chrome trace-event JSON.

(``megascope export whatif RUN --out DIR [--one-per-tp-group]``: the what-if study's trace
schema, DIR/trace.parquet and DIR/meta.yaml; see :mod:`analyzer.export.whatif`.)

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per rank,
spans and collectives as slices, arrows between the members of each collective; with
``--ideal`` also the what-if's ideal replay of every step, one more process per rank.
"""

from __future__ import annotations

import sys

from tracer.cliutil import ArgumentParser, UsageError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope export", description=__doc__.splitlines()[0])
    p.add_argument("format", choices=("chrome", "whatif"), help="output format")
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the JSON file to write (whatif: the directory for trace.parquet "
                   "and meta.yaml)")  # fmt: skip
    p.add_argument(
        "--ideal",
        action="store_true",
        help="also write the ideal replay (every operation at its typical duration, as "
        "`megascope whatif`), aligned to each measured step's start, as 'rank N (ideal)'",
    )
    p.add_argument("--one-per-tp-group", action="store_true",
                   help="whatif: record only tp rank 0 of each tensor-parallel group, as the "
                   "study's traces of tp > 1 jobs do")  # fmt: skip
    return p


def _whatif(args) -> int:
    """``export whatif RUN --out DIR``: the what-if study's trace schema (export/whatif.py)."""
    from analyzer.export.whatif import ExportError, export_whatif

    try:
        n = export_whatif(args.run, args.out, one_per_tp_group=args.one_per_tp_group)
    except ExportError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    left = [f"{v} {k.replace('_', ' ')}" for k, v in n.items() if v and k not in
            ("rows", "ranks", "steps")]  # fmt: skip
    print(f"wrote {args.out}/trace.parquet and meta.yaml: {n['rows']} rows, {n['ranks']} ranks, "
          f"{n['steps']} steps" + (f" ({', '.join(left)})" if left else ""))  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``megascope export``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.format == "whatif":
        return _whatif(args)
    from analyzer.export.chrome import ExportError, export_chrome

    try:
        stats = export_chrome(args.run, args.out, ideal=args.ideal)
    except (ExportError, OSError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    print(
        f"wrote {args.out}: {stats['events']} events, {stats['ranks']} ranks, "
        f"{stats['spans']} spans, {stats['collectives']} collectives, {stats['flows']} flows"
        + (f", {stats['ideal']} ideal slices" if "ideal" in stats else ""),
        file=sys.stdout,
    )
    return 0
