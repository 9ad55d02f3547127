"""One run analyzed by two versions of megascope: the same report, and the time of each.

    .venv/bin/python bench/same_report.py --before f5d45b2                 # the 12,288-rank run
    .venv/bin/python bench/same_report.py --before f5d45b2 --run RUN --rounds 5

A change that should not change behaviour (a module moved, a reader shared) is checked here: the
run (by default the 12,288-rank benchmark run of bench/analyzer_scale.py, synthesized once under
bench/.data/) is analyzed by ``megascope analyze --json`` from this checkout and from a
checkout of ``--before`` (a git worktree made for the purpose), alternated round by round, each
in a cold process. Prints whether the findings are the same (kind, ranks, severity, steps) and
each version's median wall time and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from analyzer_scale import DATA, ensure_run  # noqa: E402


def analyze(checkout: str, run: str) -> tuple[dict, float]:
    """The report of ``run`` by the code at ``checkout``, and the wall time it took."""
    env = {**os.environ, "PYTHONPATH": checkout}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "analyzer", "analyze", run, "--json"],
                          cwd=checkout, env=env, capture_output=True, text=True)  # fmt: skip
    took = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: analyze failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout), took


def essence(report: dict) -> list[tuple]:
    """What must not change: each finding's kind, ranks, severity and steps."""
    return [(f["kind"], tuple(f["ranks"]), f["severity"], tuple(f.get("steps") or ()))
            for f in report["findings"]]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision to compare against")
    ap.add_argument("--run", help="run directory (default: the 12,288-rank benchmark run)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    run = args.run or ensure_run(
        "dp=192,pp=8,tp=8", 50, os.path.join(DATA, "scale-dp192-pp8-tp8-50")
    )
    with tempfile.TemporaryDirectory(prefix="megascope-before-") as tmp:
        before = os.path.join(tmp, "checkout")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", before, args.before],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            times: dict[str, list[float]] = {"before": [], "now": []}
            reports: dict[str, dict] = {}
            for k in range(args.rounds):
                order = ("before", "now") if k % 2 == 0 else ("now", "before")
                for name in order:
                    rep, took = analyze(before if name == "before" else ROOT, run)
                    times[name].append(took)
                    reports[name] = rep
                    print(f"round {k + 1} {name:>6}: {took:6.1f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT, check=False)
    same = essence(reports["before"]) == essence(reports["now"])
    b, n = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"\nfindings the same: {same}")
    for name in ("before", "now"):
        print(f"  {name:>6}: {essence(reports[name])}")
    print(f"median wall time: before {b:.1f} s, now {n:.1f} s, now/before {n / b:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
