"""What a look of ``megascope watch`` costs on a large run: a full look beside a pulse.

    .venv/bin/python bench/watch_pulse.py RUN              # a run with stored digests
    .venv/bin/python bench/watch_pulse.py RUN --window 20 --repeat 3

On a finished run (``megascope synth`` writes its digests whole, as ``compact`` does), each in
a fresh process, so that nothing is cached in memory (the files are, in the page cache: a warm
first pass is printed apart):

* ``full``: :func:`analyzer.live.look`, the detectors over the newest ``--window``
  steps, as a watch's first look and every ``--full-every`` seconds past 1,024 ranks;
* ``window``: a pulse's first read, the window's digests (analyzer/pulse.py);
* ``one step``: then one new step, as a live run adds them: the pulse is told its newest step
  is not settled yet, so it reads that step's digests again;
* ``nothing new``: a pulse when no digests file changed.

Prints wall seconds (median of ``--repeat``), peak RSS, and the ratio of each to the full look;
the pulse's screen and the full look's findings, which should name the same ranks. Target: one
step under 1 s on 12,288 ranks at full detail on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(run: str, what: str, window: int) -> dict:
    """One measurement, in this process."""
    from analyzer.live import look
    from analyzer.pulse import Pulse

    out: dict = {}
    if what == "full":
        t = time.perf_counter()
        seen = look(run, window, True)
        out["s"] = time.perf_counter() - t
        out["named"] = [[f["kind"], f["ranks"]] for f in seen.findings] if seen else None
    else:
        pulse = Pulse(run)
        t = time.perf_counter()
        beat = pulse.look(window)
        out["s"] = time.perf_counter() - t
        if what != "window":
            pulse.settled = beat.steps[1] if what == "one step" else pulse.settled
            pulse.file_last = {} if what == "one step" else pulse.file_last
            t = time.perf_counter()
            beat = pulse.look(window)
            out["s"] = time.perf_counter() - t
        out["named"] = sorted(beat.suspects)
        out["steps"], out["read"] = beat.steps, beat.read_steps
        pulse.close()
    out["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def measure(run: str, what: str, window: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, run, "--child", what, "--window", str(window)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.run, args.child, args.window)))
        return
    measure(args.run, "full", args.window)  # warms the page cache
    rows = {}
    for what in ("full", "window", "one step", "nothing new"):
        got = [measure(args.run, what, args.window) for _ in range(args.repeat)]
        rows[what] = {
            "s": statistics.median(g["s"] for g in got),
            "runs": [round(g["s"], 3) for g in got],
            "rss_gib": max(g["rss_gib"] for g in got),
            "named": got[0]["named"],
            "read": got[0].get("read"),
        }
    full = rows["full"]["s"]
    print(
        f"{'look':<12} {'wall s':>8} {'x full':>7} {'peak GiB':>9} {'steps read':>10}  runs; names"
    )
    for what, r in rows.items():
        read = "" if r["read"] is None else r["read"]
        print(f"{what:<12} {r['s']:>8.3f} {r['s'] / full:>7.3f} {r['rss_gib']:>9.2f} "
              f"{read!s:>10}  {r['runs']}; {r['named']}")  # fmt: skip


if __name__ == "__main__":
    main()
