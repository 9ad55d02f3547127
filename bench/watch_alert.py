"""How soon ``megascope watch`` names a rank that turns slow while the run trains.

    .venv/bin/python bench/watch_alert.py                       # dp4, rank 1 2x from step 20
    .venv/bin/python bench/watch_alert.py --factor 1.5 --repeats 3 --flush-steps 1,10
    .venv/bin/python bench/watch_alert.py --train "--dp 2 --micro-batch-size 16"  # a core per rank

Each run: ``megascope train TRAIN --steps N --inject slow_rank:rank=R,factor=F,step=S`` (TRAIN:
``--train``, by default ``--dp 4``: 4 ranks on this machine's 2 cores) with
the tracer flushing every K steps (``MEGASCOPE_FLUSH_STEPS``; its default is 10, or 5 s), and
beside it ``megascope watch RUN --no-whatif`` (``--interval``, 5 s by default as the watch's: it
looks as soon as every rank has flushed a new step, and after that many seconds without one),
whose lines the bench stamps as they arrive. Per run it prints:

* **seen**: the newest step the watch had read when it first announced the straggler on rank
  R, minus S: how many of the slow steps the look needed (the detectors' own latency);
* **elapsed**: how many steps rank R had begun by then, minus S: the latency a user sees, the
  tracer's flush period and the watch's interval included;
* **seconds** from the start of step S to the announcement;
* **lag**: seconds from the close of the look's newest step (its last ``step`` span's end) to
  the announcement: the flush, the watch's interval and the look;
* **first**: the elapsed steps (as above) at the first announcement of any kind on rank R (a
  ``transient_stall`` of R at the onset, before the straggler: the user has rank R's name);
* **other**: announcements of other faults or other ranks (false alarms; a ``transient_stall``
  of R at the onset, before the straggler, counts apart as ``onset stall``).

Held under the machine's CPU lock (``flock /tmp/megascope-cpu.lock``) run by run.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from analyzer.db import open_run  # noqa: E402

LOCK = "/tmp/megascope-cpu.lock"
LINE = re.compile(r"steps (\d+)-(\d+): \+ (\w+) ([\d,…]+) ")


@dataclass
class Alert:
    kind: str
    ranks: str
    hi: int  # the newest step of the look that announced it
    at_ns: int  # when the line arrived (time.time_ns)


@dataclass
class Outcome:
    flush_steps: int
    repeat: int
    seen: int | None = None
    elapsed: int | None = None
    seconds: float | None = None
    lag: float | None = None  # seconds from the close of the look's newest step to the line
    other: list[str] = field(default_factory=list)
    onset_stall: bool = False
    first_elapsed: int | None = None  # the first announcement of any kind on rank R: elapsed


def read_lines(proc: subprocess.Popen, alerts: list[Alert]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        m = LINE.search(line)
        if m:
            alerts.append(Alert(m.group(3), m.group(4), int(m.group(2)), time.time_ns()))


def step_starts(run: str, rank: int) -> dict[int, int]:
    """The slow rank's step starts (ns, the run's clock: Unix time on rank 0's host)."""
    db = open_run(run)
    try:
        got = db.sql(
            f"select step, min(start_ns) as t from spans where name = 'step' and rank = {rank} group by step"
        )
    finally:
        db.close()
    return dict(zip(got.step.astype(int), got.t.astype(int), strict=True))


def step_closes(run: str) -> dict[int, int]:
    """When each step was closed on every rank: the latest end of its `step` spans (ns)."""
    db = open_run(run)
    try:
        got = db.sql("select step, max(end_ns) as t from spans where name = 'step' group by step")
    finally:
        db.close()
    return dict(zip(got.step.astype(int), got.t.astype(int), strict=True))


def one(args: argparse.Namespace, flush: int, repeat: int, workdir: str) -> Outcome:
    run = os.path.join(workdir, f"flush{flush}-{repeat}")
    env = {**os.environ, "PYTHONPATH": ROOT, "MEGASCOPE_FLUSH_STEPS": str(flush)}
    py = sys.executable
    inject = f"slow_rank:rank={args.rank},factor={args.factor:g},step={args.step}"
    train = subprocess.Popen(
        ["flock", LOCK, py, "-m", "analyzer", "train", *shlex.split(args.train), "--steps",
         str(args.steps), "--out", run, "--inject", inject],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    nice = ["nice", "-n", str(args.nice)] if args.nice else []
    watch = subprocess.Popen(
        [*nice, py, "-m", "analyzer", "watch", run, "--interval", str(args.interval), "--no-whatif",
         "--wait", "600"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    alerts: list[Alert] = []
    reader = threading.Thread(target=read_lines, args=(watch, alerts), daemon=True)
    reader.start()
    train.wait(timeout=args.timeout)
    watch.wait(timeout=120)
    reader.join(timeout=10)
    out = Outcome(flush, repeat)
    starts = step_starts(run, args.rank)
    mine = str(args.rank)
    for a in alerts:
        if a.ranks == mine and out.first_elapsed is None and a.hi >= args.step:
            out.first_elapsed = sum(1 for t in starts.values() if t <= a.at_ns) - 1 - args.step
        if a.kind == "straggler" and a.ranks == mine and out.seen is None:
            out.seen = a.hi - args.step
            out.elapsed = sum(1 for t in starts.values() if t <= a.at_ns) - 1 - args.step
            out.seconds = (a.at_ns - starts[args.step]) / 1e9 if args.step in starts else None
            closes = step_closes(run)
            out.lag = (a.at_ns - closes[a.hi]) / 1e9 if a.hi in closes else None
        elif a.kind == "transient_stall" and a.ranks == mine and out.seen is None:
            out.onset_stall = True
        elif not (a.kind == "straggler" and a.ranks == mine):
            out.other.append(f"{a.kind} {a.ranks} @ {a.hi}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", default="--dp 4", help="the trainer's mesh and sizes")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step", type=int, default=20, help="the first slow step")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--flush-steps", default="1,10", help="the tracer's flush periods to compare")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="the watch's --interval (it also looks as soon as a step is complete)",
    )
    p.add_argument("--keep", metavar="DIR", help="keep the runs in DIR (flushK-R)")
    p.add_argument("--nice", type=int, default=0,
                   help="run the watch at this niceness (a side process the ranks' cores "
                   "run when they wait)")  # fmt: skip
    args = p.parse_args()
    flushes = [int(x) for x in args.flush_steps.split(",")]
    print(f"{args.train}, rank {args.rank} {args.factor:g}x from step {args.step} of {args.steps}")
    print(f"{'flush':>5} {'rep':>3} {'seen':>5} {'elapsed':>7} {'seconds':>7} {'lag':>5} "
          f"{'first':>5}  other")  # fmt: skip
    results: dict[int, list[Outcome]] = {f: [] for f in flushes}
    with tempfile.TemporaryDirectory(prefix="megascope-watch-") as tmp:
        workdir = args.keep or tmp
        os.makedirs(workdir, exist_ok=True)
        for repeat in range(args.repeats):
            for flush in flushes:
                o = one(args, flush, repeat, workdir)
                results[flush].append(o)
                sec = f"{o.seconds:.1f}" if o.seconds is not None else "-"
                lag = f"{o.lag:.1f}" if o.lag is not None else "-"
                other = ", ".join(o.other) + (" (onset stall)" if o.onset_stall else "")
                print(
                    f"{flush:>5} {repeat:>3} {_n(o.seen):>5} {_n(o.elapsed):>7} {sec:>7} "
                    f"{lag:>5} {_n(o.first_elapsed):>5}  {other}",
                    flush=True,
                )
    print("median per flush period (steps seen / elapsed after the onset; runs named):")
    for flush, outs in results.items():
        named = [o for o in outs if o.seen is not None]
        seen = statistics.median(o.seen for o in named) if named else None
        elapsed = (
            statistics.median(o.elapsed for o in named if o.elapsed is not None) if named else None
        )
        firsts = [o.first_elapsed for o in outs if o.first_elapsed is not None]
        first = statistics.median(firsts) if firsts else None
        print(
            f"  flush every {flush:>2} steps: seen {_n(seen)}, elapsed {_n(elapsed)}, named {len(named)}/{len(outs)}, first alert on the rank {_n(first)}, false alarms {sum(len(o.other) for o in outs)}"
        )


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


if __name__ == "__main__":
    main()
