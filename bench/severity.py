"""Severity against the saving really measured: each fault run next to the same run without it.

    .venv/bin/python bench/severity.py            # real CPU runs of `megascope train`, ~5 min
    .venv/bin/python bench/severity.py --repeat 3 # more pairs per scenario (less noise)

A finding's severity promises the share of step time saved without the fault (docs/spec.md §3:
the what-if saving). Here the promise is checked: for each scenario the trainer runs the same
configuration with and without the fault, alternately (``--repeat`` pairs, so that a change in
the machine's load hits both), and the measured saving is ``1 - t_clean / t_fault`` with ``t``
the median over the runs of each run's median step. The severity printed is the mean over the
fault runs of the finding that names the fault. ``bench/accuracy.py --severity`` runs this.

On a machine with fewer cores than ranks the measured saving understates what the fault costs
on real hardware: a slowed rank's injected sleep frees a core that the other ranks use, so the
run loses less wall time than one GPU per rank would. The 2-rank cases (one core per rank here)
are the fair ones; the 4-rank ones show the effect. The pipeline cases use larger microbatches
so that compute, not per-message overhead, sets the step.
"""

from __future__ import annotations

import argparse
import json
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
CASES = (
    Case("slow rank 1.6x, dp2", {"dp": 2}, "slow_rank:rank=1,factor=1.6", "straggler", (1,)),
    Case("slow rank 1.3x, pp2", {"pp": 2}, "slow_rank:rank=0,factor=1.3", "stage_imbalance",
         (0,), BIG),  # one rank per stage: a slow rank is a slow stage
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


def run(repeat: int = 2, steps: int = 24, only: str | None = None) -> int:
    root = tempfile.mkdtemp(prefix="megascope-severity-")
    print("| scenario | t clean (ms) | t fault (ms) | measured saving | severity | ratio |")
    print("|---|---|---|---|---|---|")
    for i, case in enumerate(CASES):
        if only and only not in case.name:
            continue
        clean, fault, sev = [], [], []
        for j in range(repeat):
            clean.append(train(f"{root}/{i}-clean-{j}", case, False, steps))
            out = f"{root}/{i}-fault-{j}"
            fault.append(train(out, case, True, steps))
            s, top = severity(out, case)
            print(f"  {case.name} #{j}: {clean[-1]:.1f} / {fault[-1]:.1f} ms; {top}", flush=True)
            if s is not None:
                sev.append(s)
        tc, tf = statistics.median(clean), statistics.median(fault)
        saving = 1 - tc / tf
        got = statistics.mean(sev) if sev else None
        ratio = f"{got / saving:.2f}" if got is not None and saving > 0 else "-"
        shown = f"{got:.1%}" if got is not None else "not named"
        print(f"| {case.name} | {tc:.1f} | {tf:.1f} | {saving:.1%} | {shown} | {ratio} |",
              flush=True)  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2, help="clean/fault pairs per scenario")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--only", help="scenarios whose name holds this text")
    a = p.parse_args()
    return run(a.repeat, a.steps, a.only)


if __name__ == "__main__":
    raise SystemExit(main())
