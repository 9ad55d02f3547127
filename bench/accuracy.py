"""How often does the analyzer name the right culprit? Precision, recall and top-1 per kind.

    .venv/bin/python bench/accuracy.py            # simulated scenarios, a few minutes on 2 cores
    .venv/bin/python bench/accuracy.py --real     # plus a few real CPU runs of `megascope train`
    .venv/bin/python bench/accuracy.py --quick    # fewer scenarios
    .venv/bin/python bench/accuracy.py --kineto-hta   # only: Kineto import vs HTA on real data
    .venv/bin/python bench/accuracy.py --flight-recorder  # only: hang culprits on real FR sets
    .venv/bin/python bench/accuracy.py --severity # only: severity vs the saving of a clean run
    .venv/bin/python bench/accuracy.py --work     # only: given work (hot_expert, seq_skew) vs slow

Scenarios (simulated with ``megascope synth`` on small meshes, 20-30 steps): every fault kind of
the SPEC at random places and at severities from subtle (1.05-1.1x, or a few percent of a step)
to gross; two faults at once; healthy runs. Each run is analyzed with
``analyzer.findings.analyze`` and scored against its injections:

* a fault is **found** (recall) when some finding of its kind names it: ``straggler`` with the
  rank first, ``slow_link`` with exactly the two ends, ``hang``/``crash`` listing the rank,
  ``transient_stall`` (pause) and ``data_stall`` (slow data) naming the rank;
* a straggler or slow link whose removal saves less than :data:`NOISE` (2%) of the step (the
  same simulated run without it, :func:`saving_without`) is no finding by the SPEC (§3:
  dismissed): when nothing names it, it is counted apart (column ``<2%``), not as missed;
* it is **top-1** when the *first* finding of its kind names it;
* a finding is a **true positive** (precision) when it names an injected fault of its kind;
  findings of kind straggler, slow_link, hang or crash on a healthy run are **false alarms**.

Work given (``--work``, also part of the default run): ``hot_expert`` and ``seq_skew`` must read
as ``load_imbalance`` naming every holder of the expert (exactly) or the skewed rank's replica
(containing the rank), and a ``slow_rank`` on a rank of a mixture-of-experts run as a
``straggler`` (its work is even); healthy MoE runs count false alarms of load_imbalance too. A
level L is the compute factor of the ranks given the work: ``seq_skew`` factor L; for
``hot_expert`` the share S that makes each holder's expert tokens x = (3L - 1) / 2 times the even
share, so that its compute, one third attention and two thirds MLP (the simulator's model),
is 1/3 + 2/3 x = L times what it was (:func:`hot_share`).

Detection needs the analyzer's ``open_run`` and ``analyze``; the script says so and exits when
they are not importable yet.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accuracy_scenarios import (  # noqa: E402
    Scenario,
    real_scenarios,
    scenarios,
    work_scenarios,
    world,
)
from accuracy_scoring import Score, print_table, score  # noqa: E402

from analyzer.synth import SynthConfig, parse_injections, synthesize  # noqa: E402
from tracer.rundir import read_run_json  # noqa: E402


# fault kind -> finding kind
def synth_run(sc: Scenario, out: str) -> None:
    cfg = SynthConfig(
        mesh=dict(sc.mesh),
        steps=sc.steps,
        microbatches=4,
        faults=parse_injections(sc.specs, world(sc.mesh)),
        seed=sc.seed,
        experts=sc.experts,
        ep=sc.ep,
    )
    synthesize(cfg, out, sc.specs)


def saving_without(sc: Scenario, out: str, spec: str) -> float:
    """What removing fault ``spec`` from the simulated run ``out`` of ``sc`` really saves:
    ``1 - t / t_fault``, ``t`` the median step of the same scenario (same seed, so the same
    noise) without it. A cause that saves less than :data:`NOISE` is no finding (SPEC §3):
    such a fault is not counted as missed when nothing names it."""
    alt = out + "-without"
    synth_run(replace(sc, specs=[x for x in sc.specs if x != spec]), alt)
    try:
        return 1.0 - _median_step(alt) / _median_step(out)
    finally:
        shutil.rmtree(alt, ignore_errors=True)


def _median_step(out: str) -> float:
    return float(read_run_json(out)["summary"]["median_step_ms"])


def real_run(sc: Scenario, out: str) -> bool:
    """A CPU run of the real trainer; False (with a message) when it cannot run here."""
    cmd = [sys.executable, "-m", "analyzer", "train", "--device", "cpu", "--steps", str(sc.steps)]
    cmd += [f"--{k}={v}" for k, v in sc.mesh.items() if k != "cp"] + [
        "--out",
        out,
        "--hang-timeout",
        "20",
    ]
    for s in sc.specs:
        cmd += ["--inject", s]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print(f"  real run {sc.name}: timed out; skipped")
        return False
    if not os.path.isfile(os.path.join(out, "run.json")):
        print(
            f"  real run {sc.name}: trainer unavailable ({p.stderr.strip().splitlines()[-1:]}); skipped"
        )
        return False
    return True


def load_analyzer():
    try:
        from analyzer.db import open_run
        from analyzer.findings import analyze
    except ImportError as e:
        print(f"accuracy: the analyzer is not available yet ({e}); nothing to score")
        raise SystemExit(0) from None
    return open_run, analyze


def kineto_vs_hta() -> int:
    """Real data: megascope's ``gpu_breakdown`` and ``comm_overlap`` of imported Kineto traces
    next to Holistic Trace Analysis 0.5's temporal breakdown and comm/comp overlap of the same
    files (HTA run here): the shared two-rank set and every trace of the test corpus
    (tests/helpers/kineto_corpus.py). Prints a markdown table; needs the ``test`` extra (HTA)."""
    import math
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "tests"))
    from helpers.kineto_corpus import shapes, write_shape
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace

    from analyzer.db import open_run
    from analyzer.importers.kineto import import_kineto

    root = tempfile.mkdtemp(prefix="megascope-kineto-hta-")
    recsys = os.path.join(repo, "tests", "data", "kineto", "two_rank_recsys")
    cases = [("two_rank_recsys (shared, real)", recsys, {"sampled_rank-0.json.gz": 0,
              "sampled_rank-1.json.gz": 1}, False)]  # fmt: skip
    for shape in shapes():
        folder = write_shape(shape, os.path.join(root, "corpus", shape.name))
        cases.append((shape.name, folder, shape.ranks, bool(shape.options.get("exact_ns"))))
    print("| trace | rank | idle % (HTA) | compute % (HTA) | non-compute % (HTA) "
          "| comm/comp overlap % (HTA) | max Δ points |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, folder, ranks, exact_ns in cases:
        out = os.path.join(root, "runs", name.split()[0])
        import_kineto(folder, out, exact_ns=exact_ns)
        run = open_run(out)
        mine = run.execute("select * from gpu_breakdown").set_index("rank")
        overlap = run.execute("select * from comm_overlap").set_index("rank")["overlap_pct"]
        if exact_ns:
            os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
        t = Trace(
            trace_files={r: os.path.join(folder, f) for f, r in ranks.items()}, trace_dir=os.sep
        )
        t.load_traces(use_multiprocessing=False, use_memory_profiling=False)
        os.environ.pop("HTA_DISABLE_NS_ROUNDING", None)
        theirs = BreakdownAnalysis.get_temporal_breakdown(t, visualize=False).set_index("rank")
        hta_overlap = CommunicationAnalysis.get_comm_comp_overlap(t, visualize=False)
        hta_overlap = hta_overlap.set_index("rank")["comp_comm_overlap_pctg"]
        for rank in sorted(theirs.index):
            m = mine.loc[rank]
            ours = [
                100 * m[c] / m["kernel_ns"] for c in ("idle_ns", "compute_ns", "non_compute_ns")
            ]
            hta = [theirs.loc[rank, f"{c}_pctg"] for c in ("idle_time", "compute_time",
                                                            "non_compute_time")]  # fmt: skip
            delta = max(abs(a - b) for a, b in zip(ours, hta, strict=True))
            worst = max(worst, delta)
            o, ho = overlap.loc[rank], hta_overlap.loc[rank]
            cells = [f"{a:.2f} ({b:.2f})" for a, b in zip(ours, hta, strict=True)]
            ov = "– (–)" if math.isnan(ho) else f"{o:.2f} ({ho:.2f})"
            print(f"| {name}{' --exact-ns' if exact_ns else ''} | {rank} | {' | '.join(cells)} "
                  f"| {ov} | {delta:.2f} |")  # fmt: skip
    print(f"\nlargest difference: {worst:.2f} percentage points")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if worst < 1.0 else 1


def flight_recorder_real(sweep: int = 40, seed: int = 0) -> int:
    """Real data: every Flight Recorder set of the repository (and NCCL-shaped ones, and a
    sweep of random ones), megascope's exact-culprit score next to PyTorch's ``torchfrtrace``
    on the same dumps (bench/fr_accuracy.py)."""
    from bench.fr_accuracy import run

    print("\n## Flight Recorder: exact culprit sets, megascope and torchfrtrace\n")
    return run(sweep=sweep, seed=seed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer scenarios")
    p.add_argument("--real", action="store_true", help="also a few real CPU runs of the trainer")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")
    p.add_argument("--kineto-hta", action="store_true",
                   help="only compare imported Kineto traces with HTA (real data)")  # fmt: skip
    p.add_argument("--flight-recorder", action="store_true",
                   help="only score hang/crash culprits on Flight Recorder sets (real data)")  # fmt: skip
    p.add_argument("--work", action="store_true",
                   help="only: work given (hot_expert, seq_skew) against a slow MoE rank")  # fmt: skip
    p.add_argument("--severity", action="store_true",
                   help="only: severities against the saving of the same run without the fault")  # fmt: skip
    args = p.parse_args()
    if args.severity:
        from bench.severity import run as severity_run

        return severity_run()
    if args.kineto_hta:
        return kineto_vs_hta()
    if args.flight_recorder:
        return flight_recorder_real()
    logging.basicConfig(level=logging.WARNING)
    open_run, analyze = load_analyzer()
    if args.work:
        todo = work_scenarios(args.quick, args.seed)
    else:
        todo = scenarios(args.quick, args.seed) + (real_scenarios() if args.real else [])
    root = args.keep or tempfile.mkdtemp(prefix="megascope-accuracy-")
    scores: dict[str, Score] = defaultdict(Score)
    alarms: list[str] = []
    t0, healthy = time.monotonic(), 0
    for i, sc in enumerate(todo):
        out = os.path.join(root, f"{i:03d}")
        shutil.rmtree(out, ignore_errors=True)
        if sc.real:
            if not real_run(sc, out):
                continue
        else:
            synth_run(sc, out)
        try:
            report = analyze(open_run(out))
        except Exception as e:  # an analyzer failure is a result, not the end of the benchmark
            print(
                f"[{i + 1:3d}/{len(todo)}] {sc.name:<26} analyzer failed: {e.__class__.__name__}: {e}"
            )
            continue
        healthy += not sc.specs
        saving = None if sc.real else functools.partial(saving_without, sc, out)
        verdicts = score(sc, report, scores, alarms, saving)
        got = (
            ", ".join(f"{f['kind']}{f['ranks']}" for f in report.get("findings", [])[:4])
            or "no findings"
        )
        print(
            f"[{i + 1:3d}/{len(todo)}] {sc.name:<26} {'; '.join(verdicts) or 'healthy'}  -> {got}"
        )
    print_table(scores, alarms, healthy)
    print(f"\n{len(todo)} scenarios in {time.monotonic() - t0:.0f} s")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.real:
        flight_recorder_real()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
