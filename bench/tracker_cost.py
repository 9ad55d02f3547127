"""What ``--log-to`` costs per tracker: the import of its client, opening its run, logging a
run's findings and per-step scores, closing (wall and this process's CPU seconds; W&B's service
process is not counted in CPU). On the slow_rank sample (8 ranks, 18 steps), offline, local
files under a temporary directory.

    .venv/bin/python bench/tracker_cost.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import os, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.trackers import TrackerFeed, make_tracker
from analyzer.trackers.base import TrackerTarget
run = open_run(sys.argv[2]); report = analyze(run, whatif=False)
t1, c1 = time.perf_counter(), time.process_time()
feed = TrackerFeed(make_tracker(TrackerTarget(sys.argv[1], None, sys.argv[3], "bench")))
t2, c2 = time.perf_counter(), time.process_time()
feed.report(run, report["findings"], tuple(report["run"]["steps"]))
feed.close(); run.close()
t3, c3 = time.perf_counter(), time.process_time()
print(f"{t2 - t1:.2f} {c2 - c1:.2f} {t3 - t2:.2f} {c3 - c2:.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    print("tracker      open_wall open_cpu log_wall log_cpu  (s, median of repeats)")
    for kind in ("tensorboard", "mlflow", "wandb"):
        rows = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                run = os.path.join(tmp, "run")
                shutil.copytree(os.path.join(ROOT, "samples", "slow_rank"), run)
                out = subprocess.run([sys.executable, "-c", CHILD, kind, run, os.path.join(tmp, kind)],
                                     env=env, capture_output=True, text=True, check=True)  # fmt: skip
                rows.append([float(x) for x in out.stdout.split()])
        med = [sorted(col)[len(col) // 2] for col in zip(*rows, strict=True)]
        print(f"{kind:12s} " + " ".join(f"{x:8.2f}" for x in med), flush=True)


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(
        f"({time.perf_counter() - t:.0f} s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})"
    )
