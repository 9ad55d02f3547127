"""Tracing's cost on whole runs, megascope beside TraceML 0.5: the same script untraced, traced
by megascope, and under TraceML, alternated round by round.

    .venv/bin/python bench/tracer_overhead.py --runs             # the same as:
    .venv/bin/python bench/overhead_runs.py                      # train, fsdp2_tp, ddp; 5 rounds
    .venv/bin/python bench/overhead_runs.py --targets train --rounds 5 --steps 40

The targets, 4 gloo ranks each:

* ``train``: ``megascope train --dp 2 --tp 2 --steps N --device cpu`` (``--no-trace``
  untraced). TraceML does not apply: it needs its step context in the training loop, and the
  trainer is megascope's own;
* ``fsdp2_tp``: examples/fsdp2_tp.py ``--tp 2``, FSDP2 over dp 2 and tensor parallelism 2 on a
  2-D DeviceMesh;
* ``ddp``: examples/ddp.py, plain DDP.

Untraced, a script runs under torchrun; traced by megascope, under ``torchrun -m tracer.run``
(the script unmodified); under TraceML, as its users run it: TraceML's three lines added to a
copy of the script (bench/traceml_side_by_side.py writes it) and TraceML's launcher starting
the ranks. Each round runs every mode of a target back to back, each run alone on the machine
(under the CPU lock of the other benches), so a round's ratios are the least disturbed by
other load; the mode that goes first turns from round to round, so that no mode always
runs after another (on this machine a run's second half is often faster or slower than
its first).

Measured per run: the median step (the script's own print; the trainer's run.json summary),
the CPU time of every process of the run (the children's rusage: the launcher, the ranks and,
under TraceML, its aggregator), and for megascope each rank's own count of its CPU time
(run.json ``tracer_cpu``, tracer/budget.py). Printed per target and mode: the median step, the
ratio to untraced (the median of the rounds' ratios, and each round's), the CPU ratio, and
megascope's CPU share and ms per step per rank (the median over the rounds, in steady state:
attach's one-time work apart). The targets: step ratio <= 1.03 on CPU (issue 35), the tracer's
own share under its budget (1%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

# framework_accuracy puts the repository on sys.path
from framework_accuracy import LOCK, ROOT, Script, free_port
from traceml_side_by_side import traceml_site, traceml_variant

MODES = ("untraced", "megascope", "traceml")
STEP = re.compile(r"median step ([0-9.]+) ms")
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = {
    "fsdp2_tp": Script("fsdp2_tp", os.path.join(EXAMPLES, "fsdp2_tp.py"), ("--tp", "2")),
    "ddp": Script("ddp", os.path.join(EXAMPLES, "ddp.py")),
}
TARGETS = ("train", *SCRIPTS)


def cpu_of(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` under the CPU lock; its result and the CPU seconds of all its processes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(["flock", LOCK, *cmd], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return done, cpu


def run_train(mode: str, out: str, steps: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "analyzer", "train", "--dp", "2", "--tp", "2", "--steps",
           str(steps), "--device", "cpu", "--out", out]  # fmt: skip
    if mode == "untraced":
        cmd.append("--no-trace")
    done, cpu = cpu_of(cmd, {**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(f"overhead_runs: train ({mode}) failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "run.json")) as f:
        return float(json.load(f)["summary"]["median_step_ms"]), cpu


def run_script(script: Script, mode: str, out: str, steps: int, variant: str,
               site: str) -> tuple[float, float]:  # fmt: skip
    args = [*script.args, "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, EXAMPLES])}
    if mode == "traceml":
        env["PYTHONPATH"] += os.pathsep + site
        cmd = [sys.executable, "-m", "traceml_ai.launcher.cli", "run", variant,
               "--nproc-per-node", "4", "--master-port", str(free_port()), "--aggregator-port",
               str(free_port()), "--logs-dir", out, "--run-name", "traceml", "--args", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
               f"--master-port={free_port()}"]  # fmt: skip
        if mode == "megascope":
            cmd += ["-m", "tracer.run"]
            env["MEGASCOPE_TRACE"] = out
        cmd += [script.path, *args]
    done, cpu = cpu_of(cmd, env)
    found = STEP.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise SystemExit(f"overhead_runs: {script.name} ({mode}) failed:\n"
                         f"{done.stdout[-1500:]}{done.stderr[-1500:]}")  # fmt: skip
    return float(found[-1]), cpu


def own_cpu(out: str) -> dict[str, dict]:
    """megascope's count of its own CPU time, by rank (run.json ``tracer_cpu``)."""
    try:
        with open(os.path.join(out, "run.json")) as f:
            return json.load(f).get("tracer_cpu", {})
    except (OSError, ValueError):
        return {}


def report(target: str, rows: dict[str, list[tuple[float, float]]], own: list[dict]) -> None:
    base = rows["untraced"]
    print(f"\n{target}: {len(base)} rounds")
    print(
        f"  {'mode':10} {'median step':>12} {'step ratio':>11}  {'per round':30} {'CPU ratio':>9}"
    )
    for mode, got in rows.items():
        if not got:
            continue
        ratios = [m[0] / u[0] for m, u in zip(got, base, strict=True)]
        cpu = [m[1] / u[1] for m, u in zip(got, base, strict=True)]
        each = " ".join(f"{r:.3f}" for r in ratios)
        print(f"  {mode:10} {statistics.median(m[0] for m in got):10.1f}ms "
              f"{statistics.median(ratios):11.3f}  {each:30} {statistics.median(cpu):9.3f}")  # fmt: skip
    if own:
        ranks = sorted({r for o in own for r in o}, key=int)
        cells = []
        for r in ranks:
            share = statistics.median(o[r]["steady_share"] for o in own if r in o)
            ms = statistics.median(o[r]["ms_per_step"] or 0 for o in own if r in o)
            cells.append(f"rank {r} {share:.2%} ({ms:.2f} ms/step)")
        widest = max(o[r]["flush_every_steps"] for o in own for r in o)
        print(f"  megascope's own CPU, steady state: {', '.join(cells)}; widest flush interval "
              f"{widest} steps")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="of: " + ", ".join(TARGETS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-traceml", action="store_true", help="untraced and megascope only")
    p.add_argument("--traceml-site", help="import TraceML from this folder (as "
                   "bench/traceml_side_by_side.py: by default a cache it installs into)")  # fmt: skip
    args = p.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"overhead_runs: no target {t!r} (of {', '.join(TARGETS)})")
    site = "" if args.no_traceml else traceml_site(args.traceml_site)[0]
    tmp = tempfile.mkdtemp(prefix="megascope-overhead-")
    variants = {}
    if site:
        variants = {n: traceml_variant(s, tmp) for n, s in SCRIPTS.items() if n in targets}
    try:
        for target in targets:
            modes = [m for m in MODES if m != "traceml" or (target in variants)]
            rows: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            own = []
            for r in range(args.rounds):
                k = r % len(modes)  # each mode goes first in turn: no mode always runs second
                for mode in modes[k:] + modes[:k]:
                    out = os.path.join(tmp, f"{target}-{mode}-{r}")
                    if target == "train":
                        got = run_train(mode, out, args.steps)
                    else:
                        got = run_script(SCRIPTS[target], mode, out, args.steps,
                                         variants.get(target, ""), site)  # fmt: skip
                    rows[mode].append(got)
                    if mode == "megascope":
                        own.append(own_cpu(out))
                    shutil.rmtree(out, ignore_errors=True)
                print(f"  {target} round {r + 1}: " + ", ".join(
                    f"{m} {rows[m][-1][0]:.1f} ms" for m in modes), flush=True)  # fmt: skip
            report(target, rows, [o for o in own if o])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
