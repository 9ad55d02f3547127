"""The analysis on its two engines: embedded (local) against Dask with 1 and 2 workers.

    .venv/bin/python bench/engine_scale.py RUN              # an existing run
    .venv/bin/python bench/engine_scale.py --mesh dp=96,pp=16,tp=8 --steps 50   # synthesized once

Each configuration runs in its own child process, from the raw rows (``MEGASCOPE_DIGESTS=raw``:
stored digests would leave Dask nothing to do): ``open_run`` (the digests: one scan of the
collectives and spans, locally or as Dask tasks) and then ``analyze``. For Dask it reports
the cluster's start, every task's seconds and rows (the report's ``engine`` key), and from
them the time N workers would take: the driver's own work (the run's opening without the
digest tasks, and the analysis) plus the tasks' seconds spread over N workers. The findings of every configuration must equal the local engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, sys, time
from analyzer.db import open_run
from analyzer.executor import DaskEngine, LocalEngine, digests_hook
from analyzer.findings import analyze
path, workers = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
engine = DaskEngine(workers=workers) if workers else LocalEngine()
t1 = time.perf_counter()
run = open_run(path, digests=digests_hook(engine) if workers else None)
t2 = time.perf_counter()
report = analyze(run)
t3 = time.perf_counter()
run.close()
engine.close()
print(json.dumps({"start_s": t1 - t0, "open_s": t2 - t1, "analyze_s": t3 - t2,
                  "engine": engine.report(), "findings": report["findings"]}))
"""


def measure(run: str, workers: int) -> dict:
    env = dict(os.environ, MEGASCOPE_DIGESTS="raw")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, run, str(workers)], capture_output=True, text=True,
        env=env, cwd=ROOT, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def driver_s(m: dict) -> float:
    """The driver's own seconds: the run's opening without the digest tasks, the analysis."""
    return m["open_s"] - m["engine"].get("digest_s", 0.0) + m["analyze_s"]


def projection(m: dict, n: int) -> float:
    """Seconds on ``n`` workers: the driver's work plus the tasks' seconds spread over them
    (the engine cuts ``TASKS_PER_WORKER`` partitions per worker, so tasks shrink with n)."""
    return driver_s(m) + sum(t["seconds"] for t in m["engine"]["tasks"]) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", help="run directory (default: synthesize --mesh/--steps)")
    p.add_argument("--mesh", default="dp=96,pp=16,tp=8")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--inject", default="slow_rank:rank=5123,factor=1.15")
    p.add_argument("--workers", default="1,2", help="Dask worker counts to measure")
    args = p.parse_args()
    run = args.run
    if run is None:
        run = os.path.join(ROOT, "bench", ".data", f"engine-{args.mesh.replace(',', '-')}")
        if not os.path.isfile(os.path.join(run, "run.json")):
            subprocess.run(
                [sys.executable, "-m", "analyzer", "synth", "--mesh", args.mesh, "--steps",
                 str(args.steps), "--inject", args.inject, "--out", run, "--force"],
                check=True, cwd=ROOT,
            )  # fmt: skip
    local = measure(run, 0)
    total = local["open_s"] + local["analyze_s"]
    print(f"run {run}")
    print(
        f"local: open {local['open_s']:.1f} s + analyze {local['analyze_s']:.1f} s = {total:.1f} s"
    )
    for w in (int(x) for x in args.workers.split(",")):
        m = measure(run, w)
        tasks = m["engine"]["tasks"]
        secs = sorted(t["seconds"] for t in tasks)
        rows = sum(sum(t["rows_in"].values()) for t in tasks)
        own = m["open_s"] + m["analyze_s"]
        same = m["findings"] == local["findings"]
        print(
            f"dask {w} worker(s): start {m['start_s']:.1f} s, open {m['open_s']:.1f} s "
            f"(digest tasks {m['engine']['digest_s']:.1f} s wall) + analyze {m['analyze_s']:.1f} s "
            f"= {own:.1f} s ({own / total:.2f}x local; {own + m['start_s']:.1f} s with the "
            f"cluster's start); {len(tasks)} tasks, {rows:,} rows, task s min "
            f"{secs[0]:.2f} median {secs[len(secs) // 2]:.2f} max {secs[-1]:.2f} sum {sum(secs):.1f}; "
            f"findings {'equal' if same else 'DIFFER'}"
        )
        proj = ", ".join(f"{n}: {projection(m, n):.1f} s" for n in (1, 2, 4, 8, 16, 64))
        print(f"  driver {driver_s(m):.1f} s; projected from these tasks, N workers -> {proj}")


if __name__ == "__main__":
    main()
