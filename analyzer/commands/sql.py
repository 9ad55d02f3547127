"""``megascope sql RUN "SELECT ..."``: a query over the run's views (docs/spec.md §4).

Views: the SPEC tables (topology, spans, collectives, gpu, heartbeats, stacks) and the derived
steps, gpu_breakdown, collective_rows, group_members and rank_coords.
"""

from __future__ import annotations

import sys

from tracer.cliutil import ArgumentParser, UsageError, log_warnings


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope sql``."""
    p = ArgumentParser(prog="megascope sql", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("query", metavar="SQL", help="one SQL statement")
    p.add_argument("--json", action="store_true", help="print rows as a JSON array of objects")
    p.add_argument("--limit", type=int, default=1000, help="rows printed as text (default 1000)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megascope sql``: the rows as a table, or as JSON with ``--json``; returns
    the exit status."""
    args = build_parser().parse_args(argv)
    log_warnings()
    import duckdb

    from analyzer.db import RunError, open_run

    try:
        run = open_run(args.run)
    except RunError as e:
        raise UsageError(str(e)) from None
    try:
        df = run.sql(args.query)
    except duckdb.Error as e:
        raise UsageError(f"SQL: {str(e).strip().splitlines()[0]}") from None
    finally:
        run.close()
    if args.json:
        sys.stdout.write(df.to_json(orient="records", date_format="iso") + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(header_style="bold")
    for col in df.columns:
        table.add_column(str(col))
    for row in df.head(args.limit).itertuples(index=False):
        table.add_row(*("" if v is None else str(v) for v in row))
    console = Console(width=max(100, Console().width))
    console.print(table)
    if len(df) > args.limit:
        console.print(f"({len(df)} rows, {args.limit} shown)")
    return 0
