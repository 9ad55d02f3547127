"""A note when the tracer lost rows: run.json's ``dropped`` (by rank, by table), written by each
rank at close. The findings still stand on what was kept, but a reader should know that some
ranks' tables have gaps."""

from __future__ import annotations

from typing import Any

from analyzer.findings.record import Note


def note(meta: dict[str, Any]) -> Note | None:
    """The ``dropped`` note of the report: which ranks lost rows and how many per table (None when
    run.json says none were)."""
    dropped = meta.get("dropped")
    if not isinstance(dropped, dict) or not dropped:
        return None
    totals: dict[str, int] = {}
    ranks: list[int] = []
    for rank, tables in dropped.items():
        if not isinstance(tables, dict):
            continue
        try:
            ranks.append(int(rank))
        except ValueError:
            continue
        for table, n in tables.items():
            totals[table] = totals.get(table, 0) + int(n or 0)
    if not ranks or not any(totals.values()):
        return None
    ranks.sort()
    what = ", ".join(f"{n:,} {table}" for table, n in sorted(totals.items()) if n)
    shown = ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )
    return {
        "kind": "dropped",
        "ranks": ranks,
        "message": f"the tracer dropped rows on {len(ranks)} rank(s) ({shown}): {what}",
        "evidence": {"by_rank": dropped, "totals": totals},
    }
