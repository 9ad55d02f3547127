"""Flight Recorder, real data: does ``analyze`` name exactly the ranks that caused a hang?

    .venv/bin/python bench/accuracy.py --flight-recorder   # this section only (also in --real)
    .venv/bin/python bench/fr_accuracy.py [--sweep N] [--seed S] [--generate]

Sets, each with its ground truth (``fault_injection.log``):

* every folder of ``tests/data/flight_recorder``: the NVIDIA Megatron set (NCCL, two failed
  GPUs) and the gloo sets made by real processes here (megascope's trainer at dp2 pp2 tp2 with
  a hung, a killed, a GIL-holding rank; an expert-parallel job with ``all_to_all``), see
  ``tests/helpers/fr_cases.py``; ``--generate`` makes those gloo sets afresh first (minutes);
* the NCCL-shaped sets of ``tests/helpers/nccl_fr.py`` (copies of real entries; p2p, coalesced
  batches, MoE groups, groups named by number, only-active or whole buffers, with and without
  times, pickle and JSON);
* the ten sets of ``tests/helpers/fr_own_sets.py``, one fault kind each (a death in an expert
  all_to_all, two GPUs lost in different groups, a held GIL, lost dumps, wrapped buffers...);
* ``--sweep N`` random NCCL-shaped jobs (mesh, fault kind, rank and place drawn at random;
  one fault, two ranks of one group failing alike at the same point, or a second fault in
  another group). The truth is the faults the dumps can show (``tests/helpers/fr_truth.py``).

Each set is imported and analyzed; the culprits are the ranks of its ``hang`` and ``crash``
findings, scored *exact* when they equal the truth, else by how many ranks are named over
the truth and how many of it are left *under* (missed). PyTorch's own ``torchfrtrace`` (in the
virtual environment) reads the same dumps (as pickles) with ``--allow-incomplete-ranks``;
its answer is the union of the "missing ranks" it prints (and, apart, the first one), scored
the same way where it gives one.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers import fr_cases, fr_own_sets, fr_truth, nccl_fr  # noqa: E402

from analyzer.db import open_run  # noqa: E402
from analyzer.findings import analyze  # noqa: E402
from analyzer.importers.flight_recorder import import_flight_recorder, load_dump  # noqa: E402

FR_DATA = os.path.join(REPO, "tests", "data", "flight_recorder")
TORCHFRTRACE = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
_MISSING = re.compile(r"missing ranks: \{([\d, ]*)\}")


def megascope(src: str, root: str) -> list[int]:
    out = tempfile.mkdtemp(dir=root)
    shutil.rmtree(out)
    import_flight_recorder(src, out)
    run = open_run(out)
    try:
        report = analyze(run)
    finally:
        run.close()
    return sorted({r for f in report["findings"] if f["kind"] in ("hang", "crash")
                   for r in f["ranks"]})  # fmt: skip


def torchfrtrace(src: str, root: str) -> tuple[list[int] | None, list[int] | None, str]:
    """(union of missing ranks, first missing ranks, note); None when it gives no answer."""
    folder = tempfile.mkdtemp(dir=root)
    for name in os.listdir(src):
        if name.endswith((".log", ".txt", ".md")):
            continue
        dump = load_dump(os.path.join(src, name))
        rank = fr_cases_rank(name)
        with open(os.path.join(folder, f"_dump_{rank}"), "wb") as f:
            f.write(pickle.dumps(dump))
    proc = subprocess.run(
        [TORCHFRTRACE, folder, "-p", "_dump_", "--allow-incomplete-ranks"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    found = [sorted(int(x) for x in m.group(1).split(",") if x.strip())
             for m in _MISSING.finditer(text)]  # fmt: skip
    if proc.returncode != 0 and not found:
        last = [ln for ln in text.strip().splitlines() if ln.strip()]
        return None, None, f"error: {last[-1][:70] if last else proc.returncode}"
    if not found:
        return [], [], "no mismatch"
    union = sorted({r for f in found for r in f})
    return union, found[0], f"{len(found)} mismatches"


def fr_cases_rank(name: str) -> int:
    from analyzer.importers.common import rank_from_filename

    rank = rank_from_filename(name)
    if rank is None:
        raise ValueError(f"{name}: no rank in the name")
    return rank


def sweep_jobs(n: int, seed: int) -> list[nccl_fr.Job]:
    rng = random.Random(seed)
    jobs = []
    meshes = [(2, 2, 2), (1, 4, 2), (2, 2, 4), (4, 2, 1), (1, 2, 2), (2, 4, 1)]
    while len(jobs) < n:
        dp, pp, tp = rng.choice(meshes)
        ep = rng.random() < 0.6
        world = dp * pp * tp
        kind = rng.choice(["dead_gpu", "cpu_stop", "killed"])
        rank = rng.randrange(world)
        base = nccl_fr.Job("x", dp=dp, pp=pp, tp=tp, ep=ep)
        tags = [o.tag for o in nccl_fr._program(rank, base) if o.it == 1]
        tag = rng.choice(tags)
        nth = rng.randrange(tags.count(tag))
        faults = [nccl_fr.Fault(kind, rank, 1, tag, nth)]
        draw = rng.random()
        if draw < 0.3:  # a second rank of the same group fails at the same point
            axis = tag if tag in ("tp", "ep", "dp", "pp") else "tp"
            group = next((g.ranks for g in nccl_fr._groups(base)[axis] if rank in g.ranks), ())
            others = [r for r in group if r != rank]
            if others:
                faults.append(nccl_fr.Fault(kind, rng.choice(others), 1, tag, nth))
        elif draw < 0.6:  # a second fault, in another tensor group, at the same point or not
            tp_of = next(g.ranks for g in nccl_fr._groups(base)["tp"] if rank in g.ranks)
            other = rng.choice([r for r in range(world) if r not in tp_of])
            theirs = [o.tag for o in nccl_fr._program(other, base) if o.it == 1]
            if rng.random() < 0.5 and theirs.count(tag) > nth:
                tag2, nth2 = tag, nth
            else:
                tag2 = rng.choice(theirs)
                nth2 = rng.randrange(theirs.count(tag2))
            kind2 = rng.choice([kind, "dead_gpu"])
            faults.append(nccl_fr.Fault(kind2, other, 1, tag2, nth2))
        jobs.append(
            nccl_fr.Job(
                f"sweep{len(jobs):03d}", dp=dp, pp=pp, tp=tp, ep=ep, faults=tuple(faults),
                named=rng.random() < 0.5, only_active=rng.random() < 0.5,
                timing=rng.random() < 0.5, fmt=rng.choice(["json", "pickle"]),
                p2p_on_default=rng.random() < 0.3, buffer=rng.choice([40, 200]),
                what=", ".join(f"{f.kind} {f.rank} at {f.op}#{f.nth}" for f in faults),
            )
        )  # fmt: skip
    return jobs


def fmt(ranks: list[int] | None, truth: list[int]) -> str:
    if ranks is None:
        return "–"
    return f"{ranks} {'✓' if ranks == truth else '✗'}"


def score(ranks: list[int], truth: list[int]) -> tuple[int, int]:
    """(over, under): ranks named beyond the truth, and ranks of the truth not named."""
    return len(set(ranks) - set(truth)), len(set(truth) - set(ranks))


def run(sweep: int = 40, seed: int = 0, generate: bool = False) -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    root = tempfile.mkdtemp(prefix="megascope-fr-accuracy-")
    sets: list[tuple[str, str, str, list[int]]] = []  # name, source, folder, truth
    if generate:
        for name, case in fr_cases.CASES.items():
            t0 = time.monotonic()
            folder = fr_cases.make(case, os.path.join(root, "generated", name))
            print(f"generated {name} in {time.monotonic() - t0:.0f} s", flush=True)
            sets.append((name + " (new)", f"gloo, {case.job}", folder, list(case.culprits)))
    for name in sorted(os.listdir(FR_DATA)):
        folder = os.path.join(FR_DATA, name)
        truth = fr_cases.truth(folder)
        if truth is None:
            continue
        source = "NCCL, NVIDIA" if name == "gpu_error_2nd" else "gloo, " + name.split("_")[0]
        sets.append((name, source, folder, truth))
    for name, job in sorted(nccl_fr.JOBS.items()):
        folder = os.path.join(root, "nccl", name)
        sets.append((name, "NCCL-shaped", folder, nccl_fr.write(job, folder)))
    for name, own in fr_own_sets.SETS.items():
        folder = os.path.join(root, "own", name)
        sets.append((name, f"own: {own.kind}", folder, fr_own_sets.write(own, folder)))
    print("| set | dumps | truth | megascope | over | under | torchfrtrace (all missing) "
          "| (first) | note |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    totals = {"sets": 0, "ours": 0, "theirs_answered": 0, "theirs_all": 0, "theirs_first": 0}
    own_exact = 0
    for name, source, folder, truth in sets:
        ours = megascope(folder, root)
        over, under = score(ours, truth)
        union, first, note = torchfrtrace(folder, root)
        totals["sets"] += 1
        totals["ours"] += ours == truth
        own_exact += ours == truth and source.startswith("own")
        if union is not None:
            totals["theirs_answered"] += 1
            totals["theirs_all"] += union == truth
            totals["theirs_first"] += first == truth
        print(f"| {name} | {source} | {truth} | {fmt(ours, truth)} | {over} | {under} "
              f"| {fmt(union, truth)} | {fmt(first, truth)} | {note} |", flush=True)  # fmt: skip
    print(
        f"\nsets: megascope exact {totals['ours']}/{totals['sets']} (own sets "
        f"{own_exact}/{len(fr_own_sets.SETS)}); torchfrtrace answers "
        f"{totals['theirs_answered']}/{totals['sets']}, exact {totals['theirs_all']} (all "
        f"missing ranks) and {totals['theirs_first']} (first mismatch)"
    )
    if sweep:
        ours_ok = theirs_ok = answered = over_n = under_n = 0
        misses = []
        t0 = time.monotonic()
        for job in sweep_jobs(sweep, seed):
            folder = os.path.join(root, "sweep", job.name)
            truth = fr_truth.write(job, folder)
            ours = megascope(folder, root)
            union, _, _ = torchfrtrace(folder, root)
            ours_ok += ours == truth
            over, under = score(ours, truth)
            over_n += over > 0
            under_n += under > 0
            answered += union is not None
            theirs_ok += union == truth
            if ours != truth:
                misses.append(f"{job.name} {job.dp}x{job.pp}x{job.tp}{' ep' if job.ep else ''} "
                              f"{job.what}{' timing' if job.timing else ''}: truth {truth}, "
                              f"named {ours}")  # fmt: skip
        print(
            f"sweep of {sweep} random NCCL-shaped jobs (seed {seed}, "
            f"{time.monotonic() - t0:.0f} s): megascope exact {ours_ok}/{sweep} (naming a rank "
            f"too many in {over_n}, missing one in {under_n}); torchfrtrace answers {answered}, "
            f"exact {theirs_ok}"
        )
        for m in misses:
            print(f"  miss: {m}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=int, default=40, help="random NCCL-shaped jobs (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generate", action="store_true", help="make the gloo sets afresh first")
    args = p.parse_args(argv)
    return run(args.sweep, args.seed, args.generate)


if __name__ == "__main__":
    raise SystemExit(main())
