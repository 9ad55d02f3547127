"""``megascope export chrome RUN --out FILE.json``: a run as Chrome trace-event JSON.

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per rank,
spans and collectives as slices, arrows between the members of each collective.
"""

from __future__ import annotations

import sys

from tracer.cliutil import ArgumentParser, UsageError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope export", description=__doc__.splitlines()[0])
    p.add_argument("format", choices=("chrome",), help="output format")
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--out", required=True, metavar="FILE", help="the JSON file to write")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from analyzer.export.chrome import ExportError, export_chrome

    try:
        stats = export_chrome(args.run, args.out)
    except (ExportError, OSError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    print(
        f"wrote {args.out}: {stats['events']} events, {stats['ranks']} ranks, "
        f"{stats['spans']} spans, {stats['collectives']} collectives, {stats['flows']} flows",
        file=sys.stdout,
    )
    return 0
