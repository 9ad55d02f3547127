"""A run's diagnosis, and how a failing test shows it."""

from __future__ import annotations

import json

from analyzer.db import open_run
from analyzer.findings import analyze


def diagnose(run: str) -> dict:
    """``megascope analyze RUN --json``'s report, computed in this process."""
    db = open_run(run)
    try:
        return analyze(db)
    finally:
        db.close()


def shown(report: dict) -> str:
    """The report's run, findings and dismissed suspects, for an assertion's message."""
    return json.dumps({k: report.get(k) for k in ("run", "findings", "dismissed")}, indent=1)


def explain(report: dict, run: str | None = None) -> str:
    """The findings, and where there are none, what each rank's steps looked like."""
    lines = [f"{f['kind']} {f['ranks']}: {f['message']}" for f in report["findings"]]
    lines += [f"dismissed: {d}" for d in report.get("dismissed", [])]
    if not lines and run is not None:
        db = open_run(run)
        try:
            lines.append(db.sql(
                "select rank, name, count(*) as n, median(end_ns - start_ns) / 1e6 as median_ms "
                "from spans where step >= 2 group by rank, name order by name, rank"
            ).to_string())  # fmt: skip
        finally:
            db.close()
    return "\n".join(lines) or "no findings"
