"""Does ``analyze`` name a slow rank in a user's DDP-style script? Precision, recall, top-1 and the
error in the reported factor, per script.

    .venv/bin/python bench/framework_accuracy.py                    # every script, the full matrix
    .venv/bin/python bench/framework_accuracy.py --repeats 1 --ranks 1,3 --factors 1.5
    .venv/bin/python bench/framework_accuracy.py --script ddp --script hf_trainer
    .venv/bin/python bench/framework_accuracy.py --script mine=path/to/train.py --accum 0
    .venv/bin/python bench/framework_accuracy.py --keep runs/bench      # keep the runs ...
    .venv/bin/python bench/framework_accuracy.py --reanalyze runs/bench # ... and score them again

The matrix: script x slow rank x factor (1.2, 1.5, 2.0 by default) x repeats, plus healthy runs
of each script. The scripts by default: examples/ddp.py, examples/compiled_ddp.py
(``torch.compile(DDP(model))``, inductor on CPU; its slow rank is slowed from step 4 on, past
the compiling steps; ``compiled_sleep=examples/compiled_ddp.py:--slow-mode,sleep`` is a row
whose slow rank sleeps) and the framework examples
(hf_trainer, lightning_ddp, accelerate_loop) whose framework is installed. Each run is
``torchrun --nproc-per-node 4 -m tracer.run SCRIPT --steps N --slow-rank R --slow-factor F``
on gloo (``--nproc 2``: two ranks, a core each on this machine, where a severity can be held
to the saving; a healthy run: ``--slow-rank -1``), held under the
machine's CPU lock (``flock /tmp/megascope-cpu.lock``) run by run, then
``analyzer.findings.analyze``. A script is a row by name: ``examples/NAME.py`` (any script that
takes ``--steps``, ``--slow-rank`` and ``--slow-factor`` as examples/ddp.py does and makes its
slow rank burn; ``NAME=PATH`` for one elsewhere; ``NAME:ARG,ARG`` adds arguments to its
command line). ``torchtitan`` is a row of torchtitan's own loop (:data:`TORCHTITAN`; its slow rank sleeps
unless ``--slow-by burn``). ``--slow-by sleep`` makes the slow rank sleep its extra time (``--slow-mode
sleep``: a host waiting on a slow device, disk or link, whose thread's CPU time is its peers'),
``--slow-by burn`` compute it; by default each script's own way. ``--accum N`` adds a row of plain DDP accumulating N microbatches under
``no_sync`` (0: none). ``NAME=trainer:ARG,ARG`` is a row of megascope's own trainer, ``megascope
train --device cpu ARGS`` with a ``slow_rank`` fault (its ranks sleep the extra time instead of
burning it), e.g. ``trainer_pp=trainer:--dp,2,--pp,2``.

Scores, per script (and per factor):

* **recall**: fault runs where a ``straggler`` finding names the slow rank; **top-1**: where the
  report's first finding is that straggler;
* **precision**: straggler findings that name the slow rank, over all straggler findings of the
  script's runs (healthy ones included);
* **false alarms**: healthy runs with a straggler, slow_link, hang, crash or regression finding;
* **factor error**: ``evidence.work_ratio`` of the straggler that names the slow rank over the
  injected factor, minus 1: its median and its largest magnitude;
* **severity** of the straggler that names the slow rank, beside the **saving** measured: one
  minus the median step of the script's healthy runs over the fault run's median step (both
  as ``analyze`` reports them; on a shared machine a few runs' medians move by 10-20%).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from analyzer.db import open_run  # noqa: E402
from analyzer.findings import analyze  # noqa: E402
from tracer.loopback import free_port  # noqa: E402

LOCK = "/tmp/megascope-cpu.lock"
ALARMS = ("straggler", "slow_link", "hang", "crash", "regression")
FACTORS = (1.2, 1.5, 2.0)
# the default rows: plain DDP and the framework examples whose framework is installed
# (compiled_ddp: ``torch.compile(DDP(model))``, its slow rank slowed past the compiling steps)
SCRIPTS = {"ddp": "torch", "compiled_ddp": "torch", "hf_trainer": "transformers",
           "lightning_ddp": "lightning", "accelerate_loop": "accelerate"}  # fmt: skip


@dataclass(frozen=True)
class Script:
    """One row of the matrix: a script and the arguments it always gets."""

    name: str
    path: str
    args: tuple[str, ...] = ()


@dataclass
class Result:
    script: str
    slow_rank: int  # -1: healthy
    factor: float
    repeat: int
    ok: bool  # the run finished
    named: bool = False  # a straggler finding names the slow rank
    top1: bool = False
    reported: float | None = None  # its work_ratio
    severity: float | None = None
    stragglers: int = 0  # straggler findings in the report
    wrong: int = 0  # straggler findings that do not name the slow rank
    alarms: tuple[str, ...] = ()  # alarm kinds on a healthy run
    top: str = ""
    step_ms: float | None = None  # the report's median step


# the path of a row that runs megascope's own trainer (``NAME=trainer:--dp,2,--pp,2``)
TRAINER = "trainer"
# the path of a row that runs torchtitan's own loop (``torchtitan=torchtitan``, or
# ``tt_tp=torchtitan:--parallelism.tensor_parallel_degree,2``): bench/tt_slow_launch.py with
# torchtitan's llama3 debug model on gloo (../shared/torchtitan/README.md). Its folder, a writable
# copy with the dataset built (make_data.py), is $TORCHTITAN_DIR (default ~/tt); where torchtitan
# is installed outside this interpreter's packages, $TORCHTITAN_PYTHONPATH adds it.
TORCHTITAN = "torchtitan"
TT_CONFIG = ("--module", "tt_cpu_config", "--config", "llama3_debugmodel_cpu")


def parse_script(text: str) -> Script:
    """``NAME``, ``NAME=PATH`` and either with ``:ARG,ARG``; ``NAME=trainer:ARG,ARG`` is
    ``megascope train ARGS``."""
    spec, _, extra = text.partition(":")
    name, _, path = spec.partition("=")
    if not path and name == TORCHTITAN:
        path = TORCHTITAN
    path = path or os.path.join(ROOT, "examples", f"{name}.py")
    if path not in (TRAINER, TORCHTITAN) and not os.path.exists(path):
        raise SystemExit(f"framework_accuracy: no script {path} for {name!r}")
    return Script(name, path, tuple(a for a in extra.split(",") if a))


def trace(
    script: Script,
    run: str,
    slow: int,
    factor: float,
    steps: int,
    timeout: float,
    nproc: int = 4,
    slow_by: str = "",
) -> bool:
    """One traced run of ``nproc`` ranks, under the CPU lock; whether it finished. The trainer's
    rows run ``megascope train`` with their mesh in ``script.args`` (its ranks are the mesh's)
    and the slow rank as its fault language puts it (``slow_rank``: the rank sleeps the extra
    time of each compute span, where the examples burn it)."""
    if script.path == TRAINER:
        fault = ["--inject", f"slow_rank:rank={slow},factor={factor:g}"] if slow >= 0 else []
        cmd = ["flock", LOCK, sys.executable, "-m", "analyzer", "train", "--device", "cpu",
               "--steps", str(steps), "--out", run, *fault, *script.args]  # fmt: skip
    else:
        cmd = ["flock", LOCK, sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={nproc}", f"--master-port={free_port()}", "-m", "tracer.run",
               script.path, "--steps", str(steps), "--slow-rank", str(slow), "--slow-factor",
               str(factor), *script.args]  # fmt: skip
        if slow_by and slow >= 0:  # the examples' --slow-mode (examples/common.py)
            cmd += ["--slow-mode", slow_by]
    env = {**os.environ, "MEGASCOPE_TRACE": run, "PYTHONPATH": ROOT}
    if script.path == TORCHTITAN:
        tt = os.path.expanduser(os.environ.get("TORCHTITAN_DIR", "~/tt"))
        launcher = os.path.join(ROOT, "bench", "tt_slow_launch.py")
        cmd = ["flock", LOCK, sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={nproc}", f"--master-port={free_port()}", "-m", "tracer.run",
               launcher, "--slow-rank", str(slow), "--slow-factor", str(factor),
               "--slow-mode", slow_by or "sleep", *TT_CONFIG, "--training.steps", str(steps),
               *script.args]  # fmt: skip
        extra = os.environ.get("TORCHTITAN_PYTHONPATH", "")
        env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, tt, extra) if p),
                   OMP_NUM_THREADS="1", TT_ASSETS=os.path.join(tt, "assets"),
                   TT_DUMP=tempfile.mkdtemp(prefix="tt-dump-"))  # fmt: skip
    # a session of its own: on a timeout every rank goes, and with it the CPU lock they inherit
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        print(f"  {run}: timed out after {timeout:.0f} s: {err.strip()[-600:]}", file=sys.stderr)
        return False
    if proc.returncode != 0:
        print(f"  {run}: exit {proc.returncode}: {err.strip()[-300:]}", file=sys.stderr)
    return proc.returncode == 0


def score(run: str, script: str, slow: int, factor: float, repeat: int) -> Result:
    """Analyze a finished run against its slow rank."""
    res = Result(script, slow, factor, repeat, ok=True)
    db = open_run(run)
    try:
        report = analyze(db)
    finally:
        db.close()
    findings = report["findings"]
    res.step_ms = report["run"].get("median_step_ms")
    if findings:
        top = findings[0]
        res.top = f"{top['kind']} {top['ranks']} {top['severity']:.1%}"
    stragglers = [f for f in findings if f["kind"] == "straggler"]
    res.stragglers = len(stragglers)
    mine = [f for f in stragglers if f["ranks"] == [slow]]
    res.wrong = len(stragglers) - len(mine)
    if mine:
        res.named = True
        res.top1 = findings[0] is mine[0]
        res.reported = mine[0]["evidence"].get("work_ratio")
        res.severity = mine[0]["severity"]
    if slow < 0:
        res.alarms = tuple(sorted({f["kind"] for f in findings if f["kind"] in ALARMS}))
    return res


def summarize(results: list[Result]) -> None:
    """The table: one row per script, then one per script and factor."""
    rows = []
    for script in dict.fromkeys(r.script for r in results):
        mine = [r for r in results if r.script == script]
        rows.append((script, "all", mine))
        for factor in sorted({r.factor for r in mine if r.slow_rank >= 0}):
            rows.append((script, f"{factor:g}x", [r for r in mine if r.factor == factor]))
    head = ("script", "factor", "runs", "recall", "top-1", "precision", "healthy: alarms",
            "reported/injected (median)", "factor error (median, worst)", "severity (median)",
            "saving (median)")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    clean = {}  # per script: the median step of its healthy runs
    for script in dict.fromkeys(r.script for r in results):
        steps = [r.step_ms for r in results if r.script == script and r.slow_rank < 0 and r.ok
                 and r.step_ms]  # fmt: skip
        clean[script] = statistics.median(steps) if steps else None
    for script, level, rs in rows:
        faults = [r for r in rs if r.slow_rank >= 0 and r.ok]
        base = clean[script]
        saved = [1 - base / r.step_ms for r in faults if base and r.step_ms]
        healthy = [r for r in rs if r.slow_rank < 0 and r.ok]
        named = [r for r in faults if r.named]
        found = sum(r.stragglers for r in rs if r.ok)
        right = sum(r.stragglers - r.wrong for r in rs if r.ok)
        ratios = [r.reported / r.factor for r in named if r.reported]
        errors = [x - 1 for x in ratios]
        sev = [r.severity for r in named if r.severity is not None]
        worst = max(errors, key=abs) if errors else None
        cells = [
            script,
            level,
            f"{len(faults)} + {len(healthy)}" if level == "all" else str(len(faults)),
            pct(len(named), len(faults)),
            pct(sum(r.top1 for r in faults), len(faults)),
            pct(right, found),
            f"{sum(bool(r.alarms) for r in healthy)} of {len(healthy)}" if healthy else "–",
            f"{statistics.median(ratios):.2f}" if ratios else "–",
            f"{statistics.median(errors):+.0%}, {worst:+.0%}" if errors else "–",
            f"{statistics.median(sev):.1%}" if sev else "–",
            f"{statistics.median(saved):.1%}" if saved else "–",
        ]
        print("| " + " | ".join(cells) + " |")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\n{len(failed)} runs did not finish: "
              + ", ".join(f"{r.script} rank {r.slow_rank} {r.factor}x" for r in failed))  # fmt: skip
    for r in results:
        if r.ok and (r.alarms or (r.slow_rank >= 0 and not r.top1)):
            what = f"alarms {list(r.alarms)}" if r.alarms else f"top: {r.top or 'nothing'}"
            print(f"  {r.script} rank {r.slow_rank} {r.factor}x #{r.repeat}: {what}")


def pct(n: int, d: int) -> str:
    return f"{n / d:.0%} ({n}/{d})" if d else "–"


def plan(args: argparse.Namespace) -> list[tuple[Script, int, float, int]]:
    names = args.script or [n for n, pkg in SCRIPTS.items() if importlib.util.find_spec(pkg)]
    scripts = [parse_script(s) for s in names]
    if args.accum > 1:
        ddp = parse_script("ddp")
        scripts.append(Script(f"ddp accum {args.accum}", ddp.path, ("--accum", str(args.accum))))
    ranks = [int(r) for r in args.ranks.split(",")]
    factors = [float(f) for f in args.factors.split(",")]
    cases = []
    for script in scripts:
        for rep in range(args.repeats):
            for i, factor in enumerate(factors):
                # each factor at every slow rank over the repeats, the ranks rotating; each
                # run its own number, so that one slow rank's runs of a factor keep their names
                cases += [(script, ranks[(j + i + rep) % len(ranks)], factor,
                           rep * args.per_factor + j)
                          for j in range(args.per_factor)]  # fmt: skip
        cases += [(script, -1, 1.0, rep) for rep in range(args.healthy)]
    return cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", action="append",
                   help="NAME (examples/NAME.py), NAME=PATH, either with :ARG,ARG; repeatable")  # fmt: skip
    p.add_argument("--ranks", default="0,1,2,3", help="slow ranks to place the fault on")
    p.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--per-factor", type=int, default=2,
                   help="runs per factor and repeat (slow ranks rotate over --ranks)")  # fmt: skip
    p.add_argument("--healthy", type=int, default=4, help="healthy runs per script")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2, help="a plain DDP row with --accum N (0: none)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--nproc",
        type=int,
        default=4,
        help="ranks per run (2 on a 2-core machine: a core per rank, for severity)",
    )
    p.add_argument("--slow-by", choices=("sleep", "burn"), default="",
                   help="the slow rank sleeps its extra time (as a host waiting on a slow device) "
                        "or burns it (default: each script's own way)")  # fmt: skip
    p.add_argument("--keep", help="keep the runs here (and results.json)")
    p.add_argument("--reanalyze", nargs="+", metavar="DIR",
                   help="score the runs kept by --keep again (several folders: together)")  # fmt: skip
    args = p.parse_args()
    if args.reanalyze:
        results = []
        for base in args.reanalyze:
            with open(os.path.join(base, "results.json")) as f:
                kept = [Result(**{**r, "alarms": tuple(r["alarms"])}) for r in json.load(f)]
            for r in kept:
                run = os.path.join(base, run_name(r.script, r.slow_rank, r.factor, r.repeat))
                results.append(score(run, r.script, r.slow_rank, r.factor, r.repeat) if r.ok else r)
        summarize(results)
        return 0
    base = args.keep or tempfile.mkdtemp(prefix="framework-accuracy-")
    os.makedirs(base, exist_ok=True)
    results: list[Result] = []
    t0 = time.monotonic()
    cases = plan(args)
    for n, (script, slow, factor, rep) in enumerate(cases, 1):
        run = os.path.join(base, run_name(script.name, slow, factor, rep))
        shutil.rmtree(run, ignore_errors=True)
        ok = trace(script, run, slow, factor, args.steps, args.timeout, args.nproc, args.slow_by)
        res = score(run, script.name, slow, factor, rep) if ok else Result(
            script.name, slow, factor, rep, ok=False)  # fmt: skip
        results.append(res)
        print(f"[{n}/{len(cases)} {time.monotonic() - t0:.0f}s] {script.name} rank {slow} "
              f"{factor}x: {res.top or 'no finding'}"
              + (f" (reported {res.reported:.2f}x)" if res.reported else ""), flush=True)  # fmt: skip
        with open(os.path.join(base, "results.json"), "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(f"\n{len(cases)} runs, {args.steps} steps each, {time.monotonic() - t0:.0f} s\n")
    summarize(results)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def run_name(script: str, slow: int, factor: float, rep: int) -> str:
    tag = "healthy" if slow < 0 else f"r{slow}-x{factor:g}"
    return f"{script.replace(' ', '_')}-{tag}-{rep}"


if __name__ == "__main__":
    sys.exit(main())
