"""How soon ``megascope watch`` names a rank that turns slow while the run trains, at default
settings, and what the tracer costs with a watch attached.

    .venv/bin/python bench/watch_alert.py                       # both shapes, 8 runs each
    .venv/bin/python bench/watch_alert.py --repeats 2 --untraced 1 --shape "dp4=--dp 4"
    .venv/bin/python bench/watch_alert.py --flush-steps 1,default  # compare flush settings

Each run: ``megascope train SHAPE --steps N --inject slow_rank:rank=R,factor=F,step=S`` with
the tracer at its defaults (``--flush-steps K`` sets ``MEGASCOPE_FLUSH_STEPS``; ``default``
leaves it unset), and beside it ``megascope watch RUN`` at its defaults (``--interval`` 5 s;
``--no-whatif`` only where asked), whose lines the bench stamps as they arrive. The watch's
marker makes the tracers write each step as it ends (tracer/budget.py). Shapes (``--shape
NAME=TRAIN``, repeatable): by default ``dp4`` (``--dp 4``: 4 ranks on this machine's 2 cores)
and ``dp2`` (``--dp 2 --micro-batch-size 32``: a core per rank). Per run it prints:

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
  of R at the onset, before the straggler, counts apart as ``onset stall``);
* **step** (ms, median before the onset), the tracer's steady CPU share (run.json
  ``tracer_cpu``, median over ranks) and its flush interval at the end.

Then per shape: the distribution of elapsed steps, how many runs were named within 3 steps of
the onset (or 2 s where steps are shorter than 0.7 s), alerts before the onset, and the
traced/untraced step ratio with a watch attached: the traced runs' median step before the
onset (the **step** column) over the median of ``--untraced`` runs of the same shape with
``--no-trace``, no watch and no fault (their run.json's median step). A run with the fault's
median falls at the onset, between a healthy and a slow step, and swings with where the
warm-up ends.

Held under the machine's CPU lock (``flock /tmp/megascope-cpu.lock``) run by run.
"""

from __future__ import annotations

import argparse
import json
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
    shape: str
    flush_steps: str
    repeat: int
    seen: int | None = None
    elapsed: int | None = None
    seconds: float | None = None
    lag: float | None = None  # seconds from the close of the look's newest step to the line
    other: list[str] = field(default_factory=list)
    onset_stall: bool = False
    first_elapsed: int | None = None  # the first announcement of any kind on rank R: elapsed
    step_ms: float | None = None  # the median step before the onset (rank R's step spans)
    early: int = 0  # announcements from looks that ended before the onset
    share: float | None = None  # the tracer's steady CPU share (median over ranks)
    flush_every: int | None = None  # the tracer's flush interval in steps at the end (median)
    median_ms: float | None = None  # run.json's median step

    def within(self, onset_steps: int = 3, short_s: float = 0.7, seconds: float = 2.0) -> bool:
        """Named within ``onset_steps`` steps of the onset, or ``seconds`` where steps are
        shorter than ``short_s``."""
        if self.elapsed is None:
            return False
        if self.elapsed <= onset_steps:
            return True
        short = self.step_ms is not None and self.step_ms < short_s * 1e3
        return short and self.seconds is not None and self.seconds <= seconds


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


def tracer_cpu(run: str) -> tuple[float | None, int | None, float | None]:
    """The tracer's steady CPU share and final flush interval (medians over ranks), and the
    run's median step (ms), from run.json."""
    try:
        with open(os.path.join(run, "run.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None, None, None
    per = list((meta.get("tracer_cpu") or {}).values())
    share = statistics.median(p["steady_share"] for p in per) if per else None
    every = int(statistics.median(p["flush_every_steps"] for p in per)) if per else None
    return share, every, (meta.get("summary") or {}).get("median_step_ms")


def untraced(args: argparse.Namespace, shape: str, train_args: str, repeat: int,
             workdir: str) -> float | None:  # fmt: skip
    """The median step (ms) of the same shape with ``--no-trace``, no watch and no fault: the
    level the traced runs' steps before the onset are held against."""
    run = os.path.join(workdir, f"{shape}-untraced-{repeat}")
    subprocess.run(
        ["flock", LOCK, sys.executable, "-m", "analyzer", "train", *shlex.split(train_args),
         "--steps", str(args.steps), "--out", run, "--no-trace"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, timeout=args.timeout, check=False,
    )  # fmt: skip
    return tracer_cpu(run)[2]


def one(args: argparse.Namespace, shape: str, train_args: str, flush: str, repeat: int,
        workdir: str) -> Outcome:  # fmt: skip
    run = os.path.join(workdir, f"{shape}-flush{flush}-{repeat}")
    env = {k: v for k, v in os.environ.items() if k != "MEGASCOPE_FLUSH_STEPS"}
    env["PYTHONPATH"] = ROOT
    if flush != "default":
        env["MEGASCOPE_FLUSH_STEPS"] = flush
    py = sys.executable
    inject = f"slow_rank:rank={args.rank},factor={args.factor:g},step={args.step}"
    train = subprocess.Popen(
        ["flock", LOCK, py, "-m", "analyzer", "train", *shlex.split(train_args), "--steps",
         str(args.steps), "--out", run, "--inject", inject],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    nice = ["nice", "-n", str(args.nice)] if args.nice else []
    extra = ["--interval", str(args.interval)] if args.interval is not None else []
    if args.no_whatif:
        extra.append("--no-whatif")
    watch = subprocess.Popen(
        [*nice, py, "-m", "analyzer", "watch", run, *extra, "--wait", "600"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    alerts: list[Alert] = []
    reader = threading.Thread(target=read_lines, args=(watch, alerts), daemon=True)
    reader.start()
    train.wait(timeout=args.timeout)
    watch.wait(timeout=120)
    reader.join(timeout=10)
    out = Outcome(shape, flush, repeat)
    out.share, out.flush_every, out.median_ms = tracer_cpu(run)
    starts = step_starts(run, args.rank)
    before = sorted(t for s, t in starts.items() if s <= args.step)
    gaps = [b - a for a, b in zip(before, before[1:], strict=False)][2:]  # past the warm-up
    out.step_ms = statistics.median(gaps) / 1e6 if gaps else None
    mine = str(args.rank)
    for a in alerts:
        if a.hi < args.step:
            out.early += 1
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


SHAPES = ("dp4=--dp 4", "dp2=--dp 2 --micro-batch-size 32")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", metavar="NAME=TRAIN",
                   help=f"a shape: a name and the trainer's mesh and sizes (default: {SHAPES})")  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step", type=int, default=20, help="the first slow step")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--flush-steps", default="default",
                   help="the tracer's flush periods to compare (default: the tracer's own)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--untraced", type=int, default=2,
                   help="untraced runs per shape for the traced/untraced step ratio")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--interval", type=float, default=None,
                   help="the watch's --interval (default: the watch's own)")  # fmt: skip
    p.add_argument("--no-whatif", action="store_true", help="run the watch with --no-whatif")
    p.add_argument("--keep", metavar="DIR", help="keep the runs in DIR")
    p.add_argument("--nice", type=int, default=0,
                   help="run the watch at this niceness (a side process the ranks' cores "
                   "run when they wait)")  # fmt: skip
    args = p.parse_args()
    shapes = [tuple(x.split("=", 1)) for x in (args.shape or SHAPES)]
    flushes = args.flush_steps.split(",")
    print(f"rank {args.rank} {args.factor:g}x from step {args.step} of {args.steps}")
    print(f"{'shape':>5} {'flush':>7} {'rep':>3} {'seen':>5} {'elapsed':>7} {'seconds':>7} "
          f"{'lag':>5} {'first':>5} {'step':>5} {'share':>6} {'every':>5}  other")  # fmt: skip
    results: dict[tuple[str, str], list[Outcome]] = {}
    bare: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="megascope-watch-") as tmp:
        workdir = args.keep or tmp
        os.makedirs(workdir, exist_ok=True)
        for name, train_args in shapes:
            for repeat in range(args.repeats):
                for flush in flushes:
                    o = one(args, name, train_args, flush, repeat, workdir)
                    results.setdefault((name, flush), []).append(o)
                    sec = f"{o.seconds:.1f}" if o.seconds is not None else "-"
                    lag = f"{o.lag:.1f}" if o.lag is not None else "-"
                    step = f"{o.step_ms:.0f}" if o.step_ms is not None else "-"
                    share = f"{o.share:.2%}" if o.share is not None else "-"
                    other = ", ".join(o.other) + (" (onset stall)" if o.onset_stall else "")
                    print(
                        f"{name:>5} {flush:>7} {repeat:>3} {_n(o.seen):>5} {_n(o.elapsed):>7} "
                        f"{sec:>7} {lag:>5} {_n(o.first_elapsed):>5} {step:>5} {share:>6} "
                        f"{_n(o.flush_every):>5}  {other}",
                        flush=True,
                    )
            for repeat in range(args.untraced):
                ms = untraced(args, name, train_args, repeat, workdir)
                if ms is not None:
                    bare.setdefault(name, []).append(ms)
                    print(f"{name:>5} untraced {repeat}: median step {ms:.0f} ms", flush=True)
    print("per shape and flush setting (elapsed: steps rank R had begun after the onset):")
    for (name, flush), outs in results.items():
        named = [o for o in outs if o.seen is not None]
        dist = sorted(o.elapsed for o in named if o.elapsed is not None)
        within = sum(o.within() for o in outs)
        early = sum(o.early for o in outs)
        traced = [o.step_ms for o in outs if o.step_ms is not None]  # before the onset
        ratio = (
            f"{statistics.median(traced) / statistics.median(bare[name]):.3f}"
            if traced and bare.get(name)
            else "-"
        )
        shares = [o.share for o in outs if o.share is not None]
        share = f"{statistics.median(shares):.2%}" if shares else "-"
        print(
            f"  {name} flush {flush}: named {len(named)}/{len(outs)}, elapsed {dist}, within 3 "
            f"steps (or 2 s) {within}/{len(outs)}, alerts before the onset {early}, false "
            f"alarms {sum(len(o.other) for o in outs)}, traced/untraced step {ratio}, tracer "
            f"CPU share {share}"
        )


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


if __name__ == "__main__":
    main()
