"""Where the tracer's own CPU goes in a traced run: py-spy samples of every rank, by part.

    .venv/bin/python bench/tracer_profile.py                    # dp2 x tp2, 40 steps, on CPU
    .venv/bin/python bench/tracer_profile.py --args "--dp 4 --steps 60" --rate 250

Runs ``megascope train ARGS`` (traced) under ``py-spy record --subprocesses --threads --format
raw`` (the ranks are the launcher's children) and sorts the samples in which a thread was busy
(py-spy leaves idle ones out) by the innermost frame of this project's tracer they hold:

* ``capture``: the hot path of the training thread: spans, the collective wrappers and works,
  the automatic module and optimizer hooks, the step clock (tracer/spans.py, autospans.py,
  collectives.py, works.py, api.py, core.py's step);
* ``flight recorder``: reading the Flight Recorder rings (tracer/flight.py);
* ``digests``: the per-step sums made at each flush (tracer/digest.py);
* ``parquet``: turning rows into columns and writing and merging parts (tracer/writer.py,
  tracer/rundir.py);
* ``watchdog``, ``clock``, ``nvml``: the watchdog thread, the clock re-estimates, the sampler;
* ``budget``: the tracer counting its own time and reviewing its flush interval
  (tracer/budget.py);
* ``tracer, other``: any other frame of tracer/;
* ``import``: importing a module from inside the tracer (pyarrow at the first flush: once);
* ``training``: samples holding no tracer frame, or training code inside a tracer wrapper
  (a collective, a backward);
* ``idle``: the tracer threads' waits between rounds (:data:`WAITS`), which py-spy counted as
  busy here; left out of the shares.

Prints each part's samples and share of the ranks' busy samples (the launcher's own left
out). A sample is
1/rate s of one thread's time on a core, so the shares are CPU shares; on 2 cores shared by 4
ranks they are what the tracer takes from training.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
PY_SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
LOCK = "/tmp/megascope-cpu.lock"

# (part, file of tracer/, function or None for any): the first that matches the innermost
# tracer frame of a sample names its part
PARTS = [
    ("flight recorder", "flight.py", None),
    ("digests", "digest.py", None),
    ("parquet", "writer.py", None),
    ("parquet", "rundir.py", None),
    ("watchdog", "watchdog.py", None),
    ("watchdog", "stacks.py", None),
    ("nvml", "nvml.py", None),
    ("clock", "clock.py", None),
    ("budget", "budget.py", None),
    ("capture", "spans.py", None),
    ("capture", "autospans.py", None),
    ("capture", "collectives.py", None),
    ("capture", "works.py", None),
    ("capture", "api.py", None),
    ("capture", "core.py", "step"),
]
# waits that py-spy here counts as busy (it reads the threads' state from /proc, and a thread
# blocked in a C call under these frames showed as running): the flusher's and the watchdog's
# sleeps between rounds
WAITS = ("Condition.wait", "Event.wait", "Watchdog._signalled")
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+):\d+\)$")


def part_of(frames: list[str]) -> str:
    """The part of a stack (outermost frame first): that of its innermost tracer frame when no
    training code (torch, the trainer) runs inside it, else training (a wrapper of the tracer
    around a collective or a backward holds the training's time, not its own)."""
    innermost = FRAME.match(frames[-1].strip()) if frames else None
    if innermost is not None and innermost.group("func") in WAITS:
        return "idle"
    if any("importlib" in f for f in frames) and any(
        f.split(" (")[-1].startswith("tracer/") for f in frames
    ):
        return "import"
    for frame in reversed(frames):
        m = FRAME.match(frame.strip())
        path = m.group("file") if m is not None else ""
        if "/torch/" in path or path.startswith(("trainer/", "torch/")):
            return "training"
        if not (path.startswith("tracer/") or "/tracer/" in path):
            continue
        name, func = os.path.basename(path), m.group("func")
        for part, file, fn in PARTS:
            if name == file and (fn is None or fn == func):
                return part
        return "tracer, other"
    return "training"


def tally(raw: str) -> collections.Counter:
    """Samples per part: py-spy's raw lines are ``frame;frame;... count``, the processes (with
    ``--subprocesses``, outermost first: a rank is a ``-m trainer.train``) and the thread
    (``--threads``) as their first frames."""
    parts: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        if not procs or "-m trainer.train" not in procs[-1]:  # the launcher, torchrun
            parts["launcher"] += int(count)
            continue
        parts[part_of(frames)] += int(count)
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--args", default="--dp 2 --tp 2 --steps 40", help="megascope train's arguments")
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument("--keep", help="write py-spy's raw output here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="megascope-profile-") as tmp:
        out = args.keep or os.path.join(tmp, "profile.txt")
        run = os.path.join(tmp, "run")
        cmd = ["flock", LOCK, PY_SPY, "record", "--subprocesses", "--threads", "--format", "raw",
               "--rate", str(args.rate), "--output", out, "--",
               sys.executable, "-m", "analyzer", "train", *shlex.split(args.args), "--out", run]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            sys.exit(
                f"tracer_profile: the profiled run failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        with open(out, encoding="utf-8") as f:
            parts = tally(f.read())
    ranks = sum(n for part, n in parts.items() if part not in ("launcher", "idle"))
    tracer = sum(n for part, n in parts.items() if part not in ("launcher", "idle", "training"))
    print(f"megascope train {args.args}: {ranks} busy samples of the ranks at {args.rate}/s "
          f"({ranks / args.rate:.1f} CPU s); left out: the launcher's {parts['launcher']}, "
          f"{parts['idle']} of the tracer's threads waiting")  # fmt: skip
    print(f"{'part':<16} {'samples':>8} {'of the ranks':>13}")
    for part, n in sorted(parts.items(), key=lambda kv: -kv[1]):
        if part not in ("launcher", "idle"):
            print(f"{part:<16} {n:>8} {n / ranks:>12.2%}")
    print(f"{'tracer, all':<16} {tracer:>8} {tracer / ranks:>12.2%}")


if __name__ == "__main__":
    main()
