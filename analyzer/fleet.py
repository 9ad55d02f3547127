"""Many runs at once: a table of runs and the hosts, GPUs and links that recur as culprits.

``megascope fleet RUN_OR_ROOT...`` (docs/spec.md §4) analyzes each run (the findings report of
§3, on the embedded engine one after another, on Dask one task per run) and answers the
cross-run questions: which host (and GPU, where the topology names it) was the culprit of a
straggler, hang, crash, throttle or data stall in more than one run, with its hardware class in
each, and which link (the hosts at its two ends) was slow in more than one run. A run that cannot be read is reported in one
line and left out; the others are still analyzed.

Runs in an object store (``s3://``, ``gs://``, any URL pyarrow's file systems open) are copied
to a temporary folder first (:func:`analyzer.gather.gather`), then analyzed as local
runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

from analyzer.db import Run, RunError, open_run
from analyzer.executor import Engine
from analyzer.findings import analyze, registry
from tracer.cliutil import UsageError

SCHEMA = "megascope.fleet/1"
# kinds whose ranks are the culprits (a slow link's ranks are its two ends: see links); each
# kind says so itself (analyzer.findings.detector.Kind.culprit)
CULPRIT_KINDS = registry.CULPRIT_KINDS
MAX_DEPTH = 2  # a root's runs are found this many folders down


def find_runs(args: Iterable[str]) -> tuple[list[str], list[dict[str, str]]]:
    """The run directories named or found under the roots named (a folder holding a
    run.json, up to ``MAX_DEPTH`` folders down, hidden folders left out), and the arguments
    that hold none."""
    runs: list[str] = []
    bad: list[dict[str, str]] = []
    for arg in args:
        if "://" in arg:
            runs.append(arg)
            continue
        if not os.path.isdir(arg):
            bad.append({"run": arg, "error": f"{arg}: no such directory"})
            continue
        found = _runs_under(arg, MAX_DEPTH)
        if not found:
            bad.append({"run": arg, "error": f"{arg}: no run.json in it or below it"})
        runs += [r for r in found if r not in runs]
    return runs, bad


def _runs_under(folder: str, depth: int) -> list[str]:
    if os.path.isfile(os.path.join(folder, "run.json")):
        return [folder]
    if depth == 0:
        return []
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    except OSError:
        return []
    out: list[str] = []
    for name in names:
        if not name.startswith("."):
            out += _runs_under(os.path.join(folder, name), depth - 1)
    return out


def _shape(meta: dict[str, Any]) -> str:
    mesh = meta.get("mesh") or {}
    axes = "x".join(f"{k}{v}" for k, v in mesh.items() if v and int(v) > 1)
    return f"{meta.get('world_size') or 0} ({axes or 'one group'})"


def run_row(path: str, whatif: bool = True) -> dict[str, Any]:
    """One run's row of the fleet table, or ``{"run", "error"}`` when it cannot be read."""
    local, tmp = path, None
    try:
        if "://" in path:
            from analyzer.gather import gather

            tmp = tempfile.mkdtemp(prefix="megascope-fleet-")
            local = os.path.join(tmp, "run")
            gather([path], local)
        run = open_run(local)
    except (RunError, UsageError, OSError) as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"run": path, "error": str(e).strip().splitlines()[0]}
    try:
        report = analyze(run, whatif=whatif)
        culprits = sorted({r for f in report["findings"] for r in f["ranks"]
                           if f["kind"] in CULPRIT_KINDS})  # fmt: skip
        gpus = _gpus(run, culprits)
        hosts = run.execute(
            "select host, string_agg(distinct nullif(hw_class, ''), '+' order by nullif(hw_class, '')) "
            "as hw_class from topology where host <> '' group by host order by 1"
        )
    except Exception as e:  # a run we cannot analyze is one line, never a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        return {"run": path, "error": f"{path}: cannot analyze: {first}"}
    finally:
        run.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    meta, summary = run.meta, run.meta.get("summary") or {}
    return {
        "run": path,
        "job": str(meta.get("run_id") or os.path.basename(os.path.normpath(path))),
        "shape": _shape(meta),
        "world_size": run.world_size,
        "mesh": run.mesh,
        "steps": summary.get("steps"),
        "mfu": summary.get("mfu"),
        "status": meta.get("status"),
        "hosts": [str(h) for h in hosts["host"].dropna()],
        "host_classes": {
            str(h): str(c)
            for h, c in zip(hosts["host"], hosts["hw_class"], strict=True)
            if isinstance(h, str) and isinstance(c, str)
        },
        "findings": [
            {
                "kind": f["kind"],
                "ranks": f["ranks"],
                "hosts": f.get("hosts") or [],
                "gpus": [gpus[r] for r in f["ranks"] if r in gpus]
                if f["kind"] in CULPRIT_KINDS
                else [],
                "severity": f["severity"],
            }
            for f in report["findings"]
        ],  # fmt: skip
    }


def _gpus(run: Run, ranks: list[int]) -> dict[int, str]:
    """rank -> GPU uuid, where the topology names one."""
    if not ranks:
        return {}
    rows = run.execute(
        "select rank, any_value(gpu_uuid) as gpu from topology where gpu_uuid is not null "
        f"and gpu_uuid <> '' and rank in ({','.join(str(int(r)) for r in ranks)}) group by rank"
    )
    return {int(r): str(g) for r, g in zip(rows["rank"], rows["gpu"], strict=True)}


def _repeats(
    rows: list[dict[str, Any]], key: str, keys_of: Any, classes: bool = False
) -> list[dict[str, Any]]:
    """Entries seen in more than one run, with their runs, kinds and severities; with
    ``classes`` (hosts), the hardware class the host had in each run (its ranks' classes
    joined by ``+`` where they differ; null where none is named)."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        for f in row["findings"]:
            for k in keys_of(f):
                e = seen.setdefault(k, {key: k, "runs": [], "kinds": [], "severities": [],
                                        "paths": []})  # fmt: skip
                if row["run"] not in e["paths"]:
                    e["paths"].append(row["run"])
                    e["runs"].append(row["job"])
                    e["severities"].append(f["severity"])
                    if classes:
                        cls = (row.get("host_classes") or {}).get(k)
                        e.setdefault("hw_classes", []).append(cls)
                if f["kind"] not in e["kinds"]:
                    e["kinds"].append(f["kind"])
    out = [e for e in seen.values() if len(e["runs"]) > 1]
    out.sort(key=lambda e: (-len(e["runs"]), e[key]))
    return out


def _culprit_hosts(f: dict[str, Any]) -> list[str]:
    return sorted(set(f["hosts"])) if f["kind"] in CULPRIT_KINDS else []


def _link(f: dict[str, Any]) -> list[str]:
    if f["kind"] != "slow_link" or not f["hosts"]:
        return []
    return ["<->".join(sorted(set(f["hosts"])))]


def fleet(paths: list[str], engine: Engine, whatif: bool = True) -> dict[str, Any]:
    """The fleet report: ``{"runs", "repeat_culprits", "repeat_gpus", "repeat_links",
    "skipped"}`` (docs/spec.md §3)."""
    if engine.name == "local":
        results = [run_row(p, whatif) for p in paths]
    else:
        results = engine.map(run_row, paths, whatif=whatif)
    rows = [r for r in results if "error" not in r]
    return {
        "schema": SCHEMA,
        "runs": rows,
        "repeat_culprits": _repeats(rows, "host", _culprit_hosts, classes=True),
        "repeat_gpus": _repeats(rows, "gpu", lambda f: sorted(set(f["gpus"]))),
        "repeat_links": _repeats(rows, "link", _link),
        "skipped": [r for r in results if "error" in r],
    }


def row_cells(r: dict[str, Any], ranks: int, hosts: int) -> tuple[str, ...]:
    """One run's row of the fleet table as text (job, shape, steps, MFU, status, findings),
    each finding with at most ``ranks`` ranks and ``hosts`` hosts."""
    found = "; ".join(
        f"{f['kind']} {','.join(map(str, f['ranks'][:ranks]))}"
        + (f" on {','.join(sorted(set(f['hosts']))[:hosts])}" if f["hosts"] else "")
        + f" ({f['severity']:.0%})"
        for f in r["findings"]
    )
    mfu = f"{r['mfu']:.1%}" if isinstance(r.get("mfu"), int | float) else "-"
    return (r["job"], r["shape"], str(r["steps"] or "-"), mfu, str(r["status"]), found or "none")


def host_history(report: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """host -> the runs placed on it and the findings that named it, run by run (the
    dashboard's fleet page)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for row in report["runs"]:
        for h in row.get("hosts") or []:
            out.setdefault(h, {"runs": [], "findings": []})["runs"].append(row["job"])
        for f in row["findings"]:
            for h in sorted(set(f["hosts"])):
                out.setdefault(h, {"runs": [row["job"]], "findings": []})["findings"].append(
                    {"job": row["job"], "kind": f["kind"], "severity": f["severity"]}
                )
    return dict(sorted(out.items()))
