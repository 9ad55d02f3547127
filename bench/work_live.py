"""Work given, on live runs of the trainer: does a hot expert or a sequence skew read as a
``load_imbalance`` on the ranks that were given the work, run after run?

    .venv/bin/python bench/work_live.py                 # 10 repeats of each case, ~15 min
    .venv/bin/python bench/work_live.py --repeats 3 --steps 20

Cases (4 gloo ranks at most, on this machine's 2 cores; issue 34's shapes):

* ``hot_expert``: ``megascope train --dp 2 --ep 2 --experts 4 --top-k 2`` with
  ``hot_expert:expert=0,share=0.5``: expert 0's holders (position 0 of every ``ep`` group) get
  twice the even share of the assignments;
* ``seq_skew``: ``--dp 4 --data varlen`` with ``seq_skew:rank=1,factor=2``: rank 1's replica
  gets twice the tokens;
* each configuration again without the fault (``healthy``).

A fault run is **right** when a ``load_imbalance`` finding names exactly the ranks given the
work (worked out from the mesh, not from the report), and **top-1** when it is the report's
first finding. A healthy run raises a **false alarm** with any ``straggler``, ``slow_link``,
``hang``, ``crash``, ``regression`` or ``load_imbalance``. Every run is held under the
machine's CPU lock, one at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from analyzer.db import open_run  # noqa: E402
from analyzer.findings import analyze  # noqa: E402
from trainer.config import ParallelConfig  # noqa: E402
from trainer.parallel.mesh import expert_groups  # noqa: E402

LOCK = "/tmp/megascope-cpu.lock"
ALARMS = {"straggler", "slow_link", "hang", "crash", "regression", "load_imbalance"}
EXPERTS = 4
CASES: dict[str, tuple[list[str], str]] = {
    # name: (train arguments, fault)
    "hot_expert": (["--dp", "2", "--ep", "2", "--experts", str(EXPERTS), "--top-k", "2"],
                   "hot_expert:expert=0,share=0.5"),
    "seq_skew": (["--dp", "4", "--data", "varlen"], "seq_skew:rank=1,factor=2"),
}  # fmt: skip


def truth(case: str) -> list[int]:
    """The ranks given the work, from the mesh alone."""
    if case == "seq_skew":
        return [1]  # dp 4: rank 1 is its replica
    parallel = ParallelConfig(dp=2, ep=2)
    per_rank = EXPERTS // parallel.ep
    return sorted(g["ranks"][0 // per_rank] for g in expert_groups(parallel) if g["name"] == "ep")


def run_one(case: str, fault: bool, out: str, steps: int) -> dict:
    args, spec = CASES[case]
    cmd = ["flock", LOCK, sys.executable, "-m", "analyzer", "train", *args, "--steps",
           str(steps), "--device", "cpu", "--out", out]  # fmt: skip
    if fault:
        cmd += ["--inject", spec]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"work_live: {case} failed:\n{done.stderr[-2000:]}")
    run = open_run(out)
    try:
        return analyze(run)
    finally:
        run.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--keep", help="keep the runs in this folder")
    args = p.parse_args()
    tmp = args.keep or tempfile.mkdtemp(prefix="megascope-work-")
    os.makedirs(tmp, exist_ok=True)
    try:
        for case in args.cases.split(","):
            want = truth(case)
            right = top1 = alarms = 0
            seen: Counter[str] = Counter()
            for i in range(args.repeats):
                for fault in (True, False):
                    out = os.path.join(tmp, f"{case}-{int(fault)}-{i}")
                    shutil.rmtree(out, ignore_errors=True)
                    found = run_one(case, fault, out, args.steps)["findings"]
                    if not args.keep:
                        shutil.rmtree(out, ignore_errors=True)
                    kinds = [(f["kind"], sorted(f["ranks"])) for f in found]
                    said = ", ".join(f"{k} {r}" for k, r in kinds) or "none"
                    if fault:
                        ok = ("load_imbalance", want) in kinds
                        right += ok
                        top1 += bool(kinds) and kinds[0] == ("load_imbalance", want)
                        seen.update(k for k, _ in kinds)
                        print(f"  {case} {i + 1} fault: {said}{'' if ok else '  <- missed'}",
                              flush=True)  # fmt: skip
                    else:
                        bad = [k for k, _ in kinds if k in ALARMS]
                        alarms += bool(bad)
                        print(f"  {case} {i + 1} healthy: {said}{'  <- alarm' if bad else ''}",
                              flush=True)  # fmt: skip
            n = args.repeats
            print(f"{case}: load_imbalance on {want} in {right}/{n} fault runs (top-1 {top1}/{n});"
                  f" healthy runs with an alarm {alarms}/{n}; kinds in fault runs "
                  f"{dict(seen)}", flush=True)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
