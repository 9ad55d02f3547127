"""Severity against the saving really measured: each fault run next to the same run without it.

    .venv/bin/python bench/severity.py            # one core per rank: 5 cases x 3 pairs, ~15 min
    .venv/bin/python bench/severity.py --shared   # and 6 more (two ranks per core, a slow stage)
    .venv/bin/python bench/severity.py --only dp2 --repeat 5

A finding's severity promises the share of step time saved without the fault (docs/spec.md §3:
the what-if saving). Here the promise is checked: for each case the trainer runs the same
configuration with and without the fault, alternately (``--repeat`` pairs, so that a change in
the machine's load hits both), and the measured saving is ``1 - t_clean / t_fault`` with ``t``
the median over the runs of each run's median step. The severity printed is the mean over the
fault runs of the finding that names the fault; a case holds when every fault run names it
and the mean is within ±20% of the measured saving. ``bench/accuracy.py --severity`` runs this.

The cases that count give each rank a core of its own (world size 2 on a 2-core machine): a
slowed rank's injected sleep then leaves its peers as they were, as a slow GPU does. With more
ranks than cores the sleep hands the core to another rank, which runs faster than it did in
the run without the fault, so the measured saving is not what the fault costs on one device
per rank; ``--shared`` prints those cases apart, for what they are. Even with a core per rank
the ranks share caches, memory and the host's other threads: the last column is the compute
per step of the ranks the fault does not name, in the fault runs over the clean runs
(:func:`peer_compute`). Where it is far from 1 the clean run is not the fault run without the
fault, and neither is its saving.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Case:
    name: str
    mesh: dict[str, int]
    fault: str
    kind: str  # the finding that must name it
    ranks: tuple[int, ...]
    args: tuple[str, ...] = ()  # more `megascope train` flags


BIG = ("--micro-batch-size", "8")
# The cases that count (one core per rank, see above) vary the mesh, the rank and the factor;
# tensor and context parallelism use larger microbatches, so that compute, not gloo's
# per-message cost, sets their step.
FAIR = (
    Case("slow rank 1.6x, dp2", {"dp": 2}, "slow_rank:rank=1,factor=1.6", "straggler", (1,)),
    Case("slow rank 1.3x, dp2 (rank 0)", {"dp": 2}, "slow_rank:rank=0,factor=1.3", "straggler",
         (0,)),
    Case("slow rank 2x, dp2", {"dp": 2}, "slow_rank:rank=1,factor=2", "straggler", (1,)),
    Case("slow rank 1.6x, tp2", {"tp": 2}, "slow_rank:rank=1,factor=1.6", "straggler", (1,), BIG),
    Case("slow rank 1.6x, cp2", {"cp": 2}, "slow_rank:rank=0,factor=1.6", "straggler", (0,), BIG),
)  # fmt: skip
# Shown for what they are, not counted: with two ranks per core a sleeping rank hands its core
# to another rank, which then runs faster than in the run without the fault; a stage of one
# rank is priced as a stage imbalance (its compute at the other stages'), not as the run
# without the fault.
SHARED = (
    Case("slow rank 1.3x, pp2 (a slow stage)", {"pp": 2}, "slow_rank:rank=0,factor=1.3",
         "stage_imbalance", (0,), BIG),  # not a straggler: priced by balancing the stages
    Case("slow rank 1.6x, dp2 tp2", {"dp": 2, "tp": 2}, "slow_rank:rank=1,factor=1.6",
         "straggler", (1,)),
    Case("slow rank 1.3x, dp2 pp2", {"dp": 2, "pp": 2}, "slow_rank:rank=2,factor=1.3",
         "straggler", (2,), BIG),
    Case("slow rank 1.6x, dp4", {"dp": 4}, "slow_rank:rank=3,factor=1.6", "straggler", (3,)),
    Case("slow link 4x, dp 0-1 (stage 0)", {"dp": 2, "pp": 2}, "slow_link:ranks=0-1,factor=4",
         "slow_link", (0, 1)),
    Case("slow link 4x, pp 0-2", {"dp": 2, "pp": 2}, "slow_link:ranks=0-2,factor=4",
         "slow_link", (0, 2)),
)  # fmt: skip
CASES = FAIR + SHARED


def train(out: str, case: Case, fault: bool, steps: int) -> float:
    """One run; returns its median step in ms."""
    cmd = [sys.executable, "-m", "analyzer", "train", "--steps", str(steps), "--out", out]
    cmd += [f"--{k}={v}" for k, v in case.mesh.items()] + list(case.args)
    if fault:
        cmd += ["--inject", case.fault]
    subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True, cwd=ROOT)
    with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
        return float(json.load(f)["summary"]["median_step_ms"])


def severity(out: str, case: Case) -> tuple[float | None, str]:
    from analyzer.db import open_run
    from analyzer.findings import analyze

    run = open_run(out)
    try:
        report = analyze(run)
    finally:
        run.close()
    top = ", ".join(f"{f['kind']}{f['ranks']} {f['severity']:.1%}" for f in report["findings"][:3])
    for f in report["findings"]:
        if f["kind"] == case.kind and tuple(f["ranks"]) == case.ranks:
            return f["severity"], top
    return None, top or "no findings"


def peer_compute(out: str, case: Case) -> float:
    """The compute per step (ms) of the ranks the fault does not name: the what-if's compute
    pieces (collectives left out) summed per rank and step, the median over steps and ranks.
    Its ratio between the fault and the clean runs shows how the host couples the ranks: on
    one device per rank it is 1, and where it is not, the clean run's step is not the fault
    run's without the fault."""
    import numpy as np

    from analyzer.db import open_run
    from analyzer.findings import step_window
    from analyzer.findings.severity.cost import open_costs

    run = open_run(out)
    try:
        costs, why = open_costs(run, *step_window(run, None))
    finally:
        run.close()
    if costs is None:
        raise SystemExit(f"severity.py: no what-if for {out}: {why}")
    per = [np.median(costs.w.measured[costs.compute & (costs.rank == r)].sum(axis=0))
           for r in np.unique(costs.rank) if r not in case.ranks]  # fmt: skip
    return float(np.median(per)) * 1e3


def run(repeat: int = 3, steps: int = 24, only: str | None = None, shared: bool = False) -> int:
    root = tempfile.mkdtemp(prefix="megascope-severity-")
    cases = CASES if shared else FAIR
    print("| scenario | ranks per core | t clean (ms) | t fault (ms) | measured saving | severity "
          "| ratio | within ±20% | peers' compute, fault / clean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    held = total = 0
    for i, case in enumerate(cases):
        if only and only not in case.name:
            continue
        clean, fault, sev, pace = [], [], [], []
        for j in range(repeat):
            base, out = f"{root}/{i}-clean-{j}", f"{root}/{i}-fault-{j}"
            clean.append(train(base, case, False, steps))
            fault.append(train(out, case, True, steps))
            pace.append(peer_compute(out, case) / peer_compute(base, case))
            s, top = severity(out, case)
            print(f"  {case.name} #{j}: {clean[-1]:.1f} / {fault[-1]:.1f} ms "
                  f"(saving {1 - clean[-1] / fault[-1]:.1%}); {top}", flush=True)  # fmt: skip
            if s is not None:
                sev.append(s)
        tc, tf = statistics.median(clean), statistics.median(fault)
        saving = 1 - tc / tf
        got = statistics.mean(sev) if sev else None
        ok = got is not None and saving > 0 and len(sev) == repeat and abs(got / saving - 1) <= 0.2
        per_core = math.prod(case.mesh.values()) / (os.cpu_count() or 1)
        if case in FAIR:
            held, total = held + ok, total + 1
        ratio = f"{got / saving:.2f}" if got is not None and saving > 0 else "-"
        shown = f"{got:.1%}" if got is not None else "not named"
        if got is not None and len(sev) < repeat:
            shown += f" (named in {len(sev)} of {repeat})"
        print(f"| {case.name} | {per_core:g} | {tc:.1f} | {tf:.1f} | {saving:.1%} | {shown} "
              f"| {ratio} | {'yes' if ok else 'no'} | {statistics.median(pace):.2f} |",
              flush=True)  # fmt: skip
    if total:
        print(f"one core per rank: within ±20% of the measured saving in {held} of {total}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="clean/fault pairs per scenario")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--only", help="scenarios whose name holds this text")
    p.add_argument(
        "--shared",
        action="store_true",
        help="also the cases not counted (two ranks per core, a slow stage)",
    )
    a = p.parse_args()
    return run(a.repeat, a.steps, a.only, a.shared)


if __name__ == "__main__":
    raise SystemExit(main())
