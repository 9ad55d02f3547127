"""The what-if engine at MegaScale scale: 12,288 simulated ranks x 50 steps.

    .venv/bin/python bench/whatif_scale.py                        # synthesizes once, then measures
    .venv/bin/python bench/whatif_scale.py --mesh dp=16,pp=8,tp=8 --steps 20   # a smaller try

The run (``megascope synth``, coarse detail, 8 microbatches, one straggler at 1.3x) is written
once under ``bench/.data/`` (git-ignored) and reused. The measurement runs in a child process
and prints each phase's wall time (reading the run, building the graph, the durations, the
replays) and the peak resident set size (``getrusage``: DuckDB's and numpy's memory included).
Target: <= 60 s and <= 4 GiB on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
DATA = os.path.join(ROOT, "bench", ".data")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def child(run_dir: str, full: bool) -> dict:
    from analyzer.whatif import analysis, graph, load
    from analyzer.whatif.replay import Replayer

    out: dict = {}
    t0 = time.monotonic()
    times = load.read_times(run_dir)
    out["read_s"] = time.monotonic() - t0
    t = time.monotonic()
    g = graph.build_graph(times.template, times.meta)
    out["graph_s"] = time.monotonic() - t
    t = time.monotonic()
    measured = analysis._measured(g, times)  # noqa: SLF001 (this step timed alone)
    typical = analysis.typical_durations(g.slots.key, g.group >= 0, measured, "study")
    out["durations_s"] = time.monotonic() - t
    t = time.monotonic()
    r = Replayer(g)
    t_ori, t_ideal = r.run(measured), r.run(typical)
    out["two_replays_s"] = time.monotonic() - t
    out["slowdown"] = float(t_ori.mean() / t_ideal.mean())
    out["slots"], out["steps"], out["levels"] = len(g.slots), len(times.steps), len(g.levels)
    out["core_s"] = time.monotonic() - t0
    out["peak_gib"] = _peak_gib()
    print(json.dumps(out), flush=True)
    if full:
        t = time.monotonic()
        report = analysis.analyze_whatif(run_dir)
        out["report_s"] = time.monotonic() - t
        out["top_rank"] = next(iter(report["by_rank"]))
        out["peak_gib"] = _peak_gib()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="dp=192,pp=8,tp=8")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--full", action="store_true", help="also the whole report (every replay)")
    p.add_argument("--child", metavar="RUN", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.full)
        return 0
    from analyzer_scale import ensure_run

    name = f"scale-{args.mesh.replace('=', '').replace(',', '-')}-{args.steps}"
    run_dir = ensure_run(args.mesh, args.steps, os.path.join(DATA, name))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", run_dir]
    cmd += ["--full"] if args.full else []
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "child failed")
        return 1
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"run: {run_dir}: {res['slots']:,} operations per step x {res['steps']} steps, "
          f"{res['levels']} levels")  # fmt: skip
    for key in ("read_s", "graph_s", "durations_s", "two_replays_s", "core_s", "report_s"):
        if key in res:
            print(f"  {key:<16}{res[key]:8.1f}")
    print(f"  slowdown S      {res['slowdown']:8.4f}")
    print(f"  peak memory     {res['peak_gib']:8.2f} GiB   (child wall {wall:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
