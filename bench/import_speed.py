"""Kineto import speed: megascope's streaming import vs Holistic Trace Analysis's load.

    python bench/import_speed.py [--copies 40] [--ranks 2] [--repeat 1] [--workers auto|N]

Builds a bigger trace set from the committed two-rank fixture (tests/data/kineto): each
rank's events are replicated ``--copies`` times, every copy shifted in time past the previous
one, with fresh correlation ids and profiler step numbers, and written gzip-compressed under
bench/.data/. Then, side by side in this one run, each in its own fresh process:

* ``megascope``: ``import_kineto`` of the set into a new run directory (stream, reduce,
  write Parquet);
* ``hta``: ``TraceAnalysis(trace_dir=...)`` (Holistic Trace Analysis's own load), when the
  ``hta`` package imports; otherwise ``json``: ``json.load`` of each file plus a pandas
  DataFrame of its events, the first steps of HTA's load, said so in the output.

It prints wall seconds and peak resident memory (the largest process of each side), and the
ratios. Holistic Trace Analysis parses ranks in a process pool; megascope does too for big
sets (``--workers``). Module import time is not counted for either side.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURE = os.path.join(REPO, "tests", "data", "kineto", "two_rank_recsys")
WORK = os.path.join(HERE, ".data", "import_speed")


def _shifted(ev: dict, k: int, span: float) -> dict:
    """Copy ``k`` of one event: later by ``k * span`` µs, ids and step numbers renumbered."""
    ev = dict(ev)
    if "ts" in ev and isinstance(ev["ts"], (int, float)):
        ev["ts"] = ev["ts"] + k * span
    args = ev.get("args")
    if isinstance(args, dict):
        args = dict(args)
        for key in ("correlation", "External id"):
            if isinstance(args.get(key), int):
                args[key] = args[key] + k * 100_000_000
        ev["args"] = args
    name = ev.get("name", "")
    if name.startswith("ProfilerStep#"):
        ev["name"] = f"ProfilerStep#{int(name[13:]) + k * 1000}"
    return ev


def build(copies: int, ranks: int) -> str:
    """Write the replicated set (reused when it already exists); returns its folder."""
    out = os.path.join(WORK, f"traces_{ranks}x{copies}")
    if os.path.isdir(out) and len(os.listdir(out)) == ranks:
        return out
    os.makedirs(out, exist_ok=True)
    for rank in range(ranks):
        with gzip.open(os.path.join(FIXTURE, f"sampled_rank-{rank % 2}.json.gz"), "rt") as f:
            doc = json.load(f)  # the small fixture only; the big output is streamed below
        events = doc.pop("traceEvents")
        doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": rank}
        timed = [e for e in events if e.get("ph") == "X"]
        span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000
        tmp = os.path.join(out, f".rank-{rank}.json.gz.tmp")
        with gzip.open(tmp, "wt", compresslevel=1) as f:
            f.write(json.dumps(doc)[:-1] + ', "traceEvents": [\n')
            first = True
            for k in range(copies):
                for ev in events if k == 0 else timed:
                    f.write(("" if first else ",\n") + json.dumps(_shifted(ev, k, span)))
                    first = False
            f.write("\n]}\n")
        os.replace(tmp, os.path.join(out, f"rank-{rank}.json.gz"))
    return out


CHILD = {
    "megascope": """
import shutil, sys, time
from analyzer.importers.kineto import import_kineto
shutil.rmtree(sys.argv[2], ignore_errors=True)
workers = None if sys.argv[3] == "auto" else int(sys.argv[3])
t = time.perf_counter(); r = import_kineto(sys.argv[1], sys.argv[2], workers=workers)
dt = time.perf_counter() - t
print(dt, sum(r.rows.values()))
""",
    "hta": """
import logging, sys, time
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
t = time.perf_counter(); ta = TraceAnalysis(trace_dir=sys.argv[1]); dt = time.perf_counter() - t
print(dt, sum(len(df) for df in ta.t.traces.values()))
""",
    "json": """
import glob, gzip, json, sys, time
import pandas as pd
t = time.perf_counter(); n = 0
for p in sorted(glob.glob(sys.argv[1] + '/*.json.gz')):
    with gzip.open(p, 'rb') as f:
        df = pd.DataFrame(json.load(f)['traceEvents'])
    n += len(df)
dt = time.perf_counter() - t
print(dt, n)
""",
}


def run_child(kind: str, traces: str, out: str, workers: str) -> tuple[float, int, float, float]:
    """(wall seconds, rows, peak RSS MiB, CPU seconds) of one fresh process doing ``kind``.

    CPU seconds (user + system, the process and the workers it reaped) include imports but
    hardly depend on what else runs on the machine; wall seconds exclude imports.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD[kind], traces, out, workers], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    text = proc.stdout.read() if proc.stdout else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not text.strip():
        raise SystemExit(f"{kind} failed (exit {proc.returncode})")
    seconds, rows = text.split()
    cpu = usage.ru_utime + usage.ru_stime
    return float(seconds), int(rows), usage.ru_maxrss / 1024.0, cpu


def hta_available() -> bool:
    probe = "import hta.trace_analysis"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=40, help="replicas of each rank's events")
    p.add_argument("--ranks", type=int, default=2, help="ranks (trace files)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each side (best is kept)")
    p.add_argument(
        "--workers", default="auto", help="megascope's parse processes: a number, or auto"
    )
    args = p.parse_args()
    traces = build(args.copies, args.ranks)
    size = sum(os.path.getsize(os.path.join(traces, n)) for n in os.listdir(traces))
    other = "hta" if hta_available() else "json"
    print(f"traces: {traces} ({args.ranks} files, {size / 2**20:.1f} MiB gzip)")
    if other == "json":
        print("hta not importable here: timing json.load + pandas DataFrame instead")
    results = {}
    for kind in ("megascope", other):
        best = None
        for _ in range(args.repeat):
            r = run_child(kind, traces, os.path.join(WORK, "run"), args.workers)
            best = r if best is None or r[0] < best[0] else best
        results[kind] = best
        secs, rows, rss, cpu = best
        print(
            f"{kind:>10}: {secs:8.2f} s wall  {cpu:8.2f} s CPU  {rss:6.0f} MiB peak RSS"
            f"  ({rows} rows)"
        )
    (a, _, ma, ca), (b, _, mb, cb) = results["megascope"], results[other]
    print(
        f"ratio: megascope is {b / a:.1f}x faster than {other} (wall), {cb / ca:.1f}x (CPU), "
        f"with {mb / ma:.1f}x less memory"
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - t0:.0f} s)")
