"""Does ``megascope compare --fail-above PCT`` hold on real runs? False failures over healthy
twins, detection over pairs with a slowed rank, per script.

    .venv/bin/python bench/compare_gate.py                         # trainer and ddp, full size
    .venv/bin/python bench/compare_gate.py --script trainer=trainer:--dp,2 --healthy 4 --slow 2
    .venv/bin/python bench/compare_gate.py --keep runs/gate        # keep the runs ...
    .venv/bin/python bench/compare_gate.py --reanalyze runs/gate   # ... and score them again
    .venv/bin/python bench/compare_gate.py --rounds 20 --script ddp --factors 1.11,1.28

Each run is trained once and reused across pairs: per script, ``--healthy H`` healthy runs and
``--slow S`` runs per factor of ``--factors``, interleaved in time (one rank, ``--slow-rank``,
that many times slower: the trainer's ``slow_rank`` fault, the examples' ``--slow-rank`` and
``--slow-factor``), each under the machine's CPU lock (bench/framework_accuracy.py's ``trace``:
the same script rows, ``NAME``, ``NAME=PATH``, ``NAME=trainer:ARG,ARG``). Then every pair is
compared (:func:`analyzer.compare.compare_sides`, each run read once):

* **healthy twins**: every ordered pair of two healthy runs (H x (H - 1) pairs): a failure is
  a false failure;
* **slow pairs**: each healthy run against each slowed run (H x S pairs per factor): a failure
  is a detection;
* **the baseline form** (``compare A1 A2 A3 -- B``): each healthy run against the other healthy
  runs (H tests), each slowed run against all healthy runs (S per factor);
* **rounds** (``--rounds R``, as a CI job compares: the base branch's run and the change's run
  trained side by side): per round a reference run ``ref_i`` and one B of each kind, a healthy
  twin and one slowed run per factor; each B is compared with its own round's reference (R
  independent pairs per kind, rows ``round:``). The references count as healthy runs in the
  baseline form, and in the pairs across rounds with ``--all-pairs``.

Pairs that share a run are not independent: H + S runs make H x S pairs, whose rates say how the
gate reads those runs, not H x S independent draws. The table also gives the step change the
slowed runs measured (their median step over the healthy runs' median, less one): a rank slowed
by F does not slow the step by F - 1 where the others' collectives hide part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from framework_accuracy import Script, parse_script, trace  # noqa: E402

from analyzer.compare import Side, compare_sides, read_side  # noqa: E402
from analyzer.compare_gate import DRIFT_PRIOR  # noqa: E402
from analyzer.db import open_run  # noqa: E402

FACTORS = (1.1, 1.25)
SCRIPTS = ("trainer=trainer:--dp,2", "ddp")


@dataclass
class Pair:
    """One comparison scored: which runs, what the gate said."""

    script: str
    kind: str  # twin, slow1.1, ...; "base:" before it for the baseline form
    a: str
    b: str
    change_pct: float | None
    drift_pct: float | None
    evidence: bool
    failed: bool


def run_names(healthy: int, slow: int, factors: tuple[float, ...]) -> list[tuple[str, float]]:
    """The runs of one script: (name, factor), factor 1.0 for a healthy run, in the order they
    train: interleaved (a healthy run, then one per factor, and again), so that the machine's
    drift over the session falls on healthy and slowed runs alike."""
    kinds = [("healthy", 1.0, healthy)] + [(f"slow{f:g}", f, slow) for f in factors]
    out = []
    for i in range(max(healthy, slow)):
        out += [(f"{kind}_{i}", f) for kind, f, n in kinds if i < n]
    return out


def round_names(rounds: int, factors: tuple[float, ...]) -> list[tuple[str, float]]:
    """The runs of ``--rounds``: per round a reference ``ref_i`` and one B of each kind
    (``healthy_i``, ``slow<F>_i``), as a CI job trains the base branch and the change side by
    side. The Bs' order rotates from round to round, and the reference trains first in even
    rounds and last in odd ones, so that neither a kind nor the reference is always the later
    run while the machine's speed drifts."""
    kinds = [("healthy", 1.0)] + [(f"slow{f:g}", f) for f in factors]
    out = []
    for i in range(rounds):
        shift = i % len(kinds)
        bs = [(f"{kind}_{i}", f) for kind, f in kinds[shift:] + kinds[:shift]]
        ref = [(f"ref_{i}", 1.0)]
        out += ref + bs if i % 2 == 0 else bs + ref
    return out


def train(script: Script, root: str, args: argparse.Namespace) -> None:
    """Every run of ``script`` not already in ``root/<script>``, one at a time."""
    names = (
        round_names(args.rounds, args.factors)
        if args.rounds
        else run_names(args.healthy, args.slow, args.factors)
    )
    for name, factor in names:
        run = os.path.join(root, script.name, name)
        if os.path.exists(os.path.join(run, "run.json")):
            continue
        slow = args.slow_rank if factor > 1 else -1
        print(f"  training {script.name}/{name}", file=sys.stderr, flush=True)
        trace(script, run, slow, factor, args.steps, args.timeout, nproc=args.nproc)


def score(script: str, root: str, pct: float, drift: float = DRIFT_PRIOR,
          all_pairs: bool | None = None) -> list[Pair]:  # fmt: skip
    """Every pair of the runs in ``root/<script>`` (module docstring); where they were trained
    in rounds, the pairs across rounds only with ``all_pairs``."""
    here = os.path.join(root, script)
    sides: dict[str, Side] = {}
    for name in sorted(os.listdir(here)):
        try:
            db = open_run(os.path.join(here, name))
        except Exception as e:  # a run that did not finish: left out, said once
            print(f"  {script}/{name}: left out ({str(e).splitlines()[0]})", file=sys.stderr)
            continue
        try:
            sides[name] = read_side(db)  # what-if on, as compare runs by default
        finally:
            db.close()
    healthy = [n for n in sides if n.startswith(("healthy_", "ref_"))]
    slowed = [n for n in sides if n.startswith("slow")]
    out = []

    def one(kind: str, a: list[str], b: str) -> None:
        rep = compare_sides([sides[n] for n in a], sides[b], fail_above=pct, drift_prior=drift)
        g = rep["fail_above"]
        out.append(Pair(script, kind, "+".join(a), b, rep["step"]["change_pct"],
                        g["drift_pct"], bool(g["evidence"]), g["failed"]))  # fmt: skip

    rounds = any(n.startswith("ref_") for n in sides)
    for a in healthy if all_pairs or (all_pairs is None and not rounds) else ():
        for b in healthy:
            if a != b:
                one("twin", [a], b)
        for b in slowed:
            one(b.split("_")[0], [a], b)
    for ref in (n for n in sides if n.startswith("ref_")):  # --rounds: the run beside it
        i = ref.split("_", 1)[1]
        for b in sides:
            if b.endswith(f"_{i}") and b != ref:
                one("round:" + ("twin" if b.startswith("healthy_") else b.split("_")[0]), [ref], b)
    if len(healthy) >= 3:
        for b in healthy:
            one("base:twin", [h for h in healthy if h != b], b)
        for b in slowed:
            one("base:" + b.split("_")[0], healthy, b)
    return out


def summarize(pairs: list[Pair], root: str) -> None:
    """One row per script and kind of pair: pairs, failures, the change measured."""
    head = ("script", "pairs", "n", "failed", "step change (median, range)", "drift (median)",
            "named slow rank")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for script in dict.fromkeys(p.script for p in pairs):
        for kind in dict.fromkeys(p.kind for p in pairs if p.script == script):
            rows = [p for p in pairs if p.script == script and p.kind == kind]
            ch = [p.change_pct for p in rows if p.change_pct is not None]
            dr = [p.drift_pct for p in rows if p.drift_pct is not None]
            cells = [
                script,
                kind,
                str(len(rows)),
                f"{sum(p.failed for p in rows)} of {len(rows)}",
                f"{statistics.median(ch):+.1f}% ({min(ch):+.1f} to {max(ch):+.1f})" if ch else "-",
                f"{statistics.median(dr):.1f}%" if dr else "-",
                f"{sum(p.evidence for p in rows)} of {len(rows)}",
            ]
            print("| " + " | ".join(cells) + " |")
    with open(os.path.join(root, "pairs.json"), "w") as f:
        json.dump([asdict(p) for p in pairs], f, indent=1)


def main() -> int:
    """Train (or reuse) the runs, score every pair, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", action="append", help="NAME, NAME=PATH, NAME=trainer:ARG,ARG")
    p.add_argument("--healthy", type=int, default=5, help="healthy runs per script")
    p.add_argument("--slow", type=int, default=4, help="slowed runs per script and factor")
    p.add_argument("--factors", type=lambda s: tuple(float(x) for x in s.split(",")),
                   default=FACTORS)  # fmt: skip
    p.add_argument("--rounds", type=int, default=0,
                   help="train in rounds instead: a reference and one B of each kind a round "
                   "(--healthy and --slow are then unused)")  # fmt: skip
    p.add_argument("--all-pairs", action="store_true",
                   help="with --rounds, also every pair across rounds (H x (H - 1) twins: "
                   "minutes of scoring at 20 rounds)")  # fmt: skip
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2, help="ranks of a script row")
    p.add_argument("--fail-above", type=float, default=5.0)
    p.add_argument(
        "--drift",
        type=float,
        default=DRIFT_PRIOR,
        help="the gate's prior on the run-to-run spread, %% (compare --drift)",
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", help="train into this folder and keep the runs (and pairs.json)")
    p.add_argument("--reanalyze", metavar="DIR", help="score the runs kept in DIR again")
    args = p.parse_args()
    if args.reanalyze:
        root = args.reanalyze
        scripts = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    else:
        import tempfile

        root = args.keep or tempfile.mkdtemp(prefix="compare_gate_")
        rows = [parse_script(s) for s in (args.script or SCRIPTS)]
        for script in rows:
            train(script, root, args)
        scripts = [s.name for s in rows]
    pairs = [pair for s in scripts
             for pair in score(s, root, args.fail_above, args.drift, args.all_pairs or None)]  # fmt: skip
    summarize(pairs, root)
    print(f"runs and pairs.json in {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
