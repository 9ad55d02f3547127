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
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from analyzer.findings.cost import NOISE  # noqa: E402
from analyzer.synth import SynthConfig, parse_injections, synthesize  # noqa: E402
from tracer.rundir import coords_of, mesh_groups, read_run_json  # noqa: E402

# fault kind -> finding kind
EXPECTED = {
    "slow_rank": "straggler",
    "slow_link": "slow_link",
    "hang": "hang",
    "crash": "crash",
    "pause": "transient_stall",
    "slow_data": "data_stall",
    "hot_expert": "load_imbalance",
    "seq_skew": "load_imbalance",
}
ALARM_KINDS = ("straggler", "slow_link", "hang", "crash", "load_imbalance")
WORK_KINDS = ("hot_expert", "seq_skew")  # the work given (scenarios of work_scenarios)
WORK_LEVELS = (1.1, 1.25, 2.0)
# mixture-of-experts meshes: (mesh, experts, ep)
MOE_MESHES = (
    ({"dp": 4, "pp": 2, "tp": 1, "cp": 1}, 8, 4),
    ({"dp": 4, "pp": 1, "tp": 2, "cp": 1}, 4, 2),
)
MESHES = ({"dp": 2, "pp": 2, "tp": 2, "cp": 1}, {"dp": 4, "pp": 2, "tp": 2, "cp": 1})


@functools.cache
def healthy_step_ms(mesh_items: tuple[tuple[str, int], ...]) -> float:
    """The median step of a healthy run of this mesh, so that a stall of level L adds
    (L - 1) of a real step (a short simulation, cached per mesh)."""
    with tempfile.TemporaryDirectory(prefix="megascope-accuracy-") as out:
        cfg = SynthConfig(mesh=dict(mesh_items), steps=6, microbatches=4, seed=1)
        return float(synthesize(cfg, out)["summary"]["median_step_ms"])


@dataclass
class Scenario:
    name: str
    mesh: dict[str, int]
    specs: list[str]
    severity: str  # the level's name ("1.05x" ...) or "healthy"
    steps: int = 24
    seed: int = 0
    real: bool = False
    experts: int = 0
    ep: int = 1


@dataclass
class Score:
    faults: int = 0
    quiet: int = 0  # faults that cost less than NOISE and were not reported (not counted above)
    found: int = 0
    top1: int = 0
    findings: int = 0
    true_pos: int = 0
    by_severity: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    factor_ratios: list[float] = field(default_factory=list)  # reported / injected factor


def world(mesh: dict[str, int]) -> int:
    return mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]


def random_link(rng: random.Random, mesh: dict[str, int]) -> tuple[int, int]:
    """Two ranks that really talk: neighbours in a tp, dp or pp group."""
    group = rng.choice(mesh_groups(mesh))
    ranks = group["ranks"]
    i = rng.randrange(len(ranks) - 1)
    return (ranks[i], ranks[i + 1]) if group["name"] == "pp" else tuple(rng.sample(ranks, 2))


LEVELS = (1.05, 1.1, 1.25, 2.0)  # severities: x slower (or 1 + the share of a step a stall adds)


def level_name(level: float) -> str:
    return f"{level:g}x"


def fault_spec(
    kind: str, level: float, rng: random.Random, mesh: dict[str, int], steps: int
) -> str:
    """One spec of ``kind`` at a random place. ``level`` is the slow-down: the compute or
    transfer factor, or for stalls 1 + the share of a step the stall adds (2.0: a whole step)."""
    r = rng.randrange(world(mesh))
    if kind == "slow_rank":
        return f"slow_rank:rank={r},factor={level:g}"
    if kind == "slow_link":
        a, b = random_link(rng, mesh)
        return f"slow_link:ranks={a}-{b},factor={level * (2 if level >= 2 else 1):g}"
    if kind in ("hang", "crash"):
        return f"{kind}:rank={r},step={rng.randrange(steps // 3, steps - 2)}"
    ms = healthy_step_ms(tuple(sorted(mesh.items()))) * (level - 1.0)
    if kind == "pause":
        return f"pause:rank={r},every={rng.choice([3, 5])},ms={ms:.1f}"
    return f"slow_data:rank={r},ms={ms:.1f}"


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    """Every kind at every level and ``places`` random places, pairs of faults, healthy runs."""
    rng = random.Random(seed)
    out: list[Scenario] = []
    places = 1 if quick else 2
    for kind in EXPECTED:
        if kind in WORK_KINDS:
            continue
        if kind in ("hang", "crash"):
            grid = [2.0] * (places + 1)
        else:
            grid = [lvl for lvl in LEVELS for _ in range(places)]
        for n, level in enumerate(grid):
            mesh = MESHES[n % len(MESHES)]
            spec = fault_spec(kind, level, rng, mesh, 24)
            name = kind if kind in ("hang", "crash") else f"{kind}/{level_name(level)}"
            out.append(Scenario(name, mesh, [spec], level_name(level), seed=rng.randrange(1 << 30)))
    pairs = [("slow_rank", "slow_link"), ("slow_rank", "slow_data"), ("slow_link", "pause")]
    for a, b in pairs[: 2 if quick else 3]:
        mesh = MESHES[1]
        specs = [fault_spec(a, 1.25, rng, mesh, 24), fault_spec(b, 1.25, rng, mesh, 24)]
        out.append(Scenario(f"{a}+{b}", mesh, specs, "1.25x", seed=rng.randrange(1 << 30)))
    for i in range(3 if quick else 6):
        out.append(Scenario("healthy", MESHES[i % 2], [], "healthy", seed=rng.randrange(1 << 30)))
    return out + work_scenarios(quick, seed)


def hot_share(level: float, experts: int, ep: int) -> float | None:
    """The hot_expert share that makes its holders compute ``level`` times as long (module
    docstring): held share H = x / ep of the assignments, of which S to the hot expert and the
    rest spread evenly, (1 - S) (h - 1) / (E - 1) to its h - 1 companions. None: out of reach
    (x above ep: the holders would need more than every assignment)."""
    x = (3.0 * level - 1.0) / 2.0
    held = x / ep
    a = (experts // ep - 1) / (experts - 1)
    share = (held - a) / (1.0 - a)
    return share if 0.0 < share <= 1.0 and held <= 1.0 else None


def work_scenarios(quick: bool, seed: int) -> list[Scenario]:
    """hot_expert and seq_skew at 1.1-2x, a slow rank of an MoE run, healthy MoE runs."""
    rng = random.Random(seed + 13)
    out: list[Scenario] = []
    places = 1 if quick else 2
    for n, level in enumerate(lvl for lvl in WORK_LEVELS for _ in range(places)):
        name = level_name(level)
        moe = [m for m in MOE_MESHES if hot_share(level, m[1], m[2]) is not None]
        mesh, experts, ep = moe[n % len(moe)]
        share = hot_share(level, experts, ep)
        spec = f"hot_expert:expert={rng.randrange(experts)},share={share:.4f}"
        out.append(Scenario(f"hot_expert/{name}", mesh, [spec], name, seed=rng.randrange(1 << 30),
                            experts=experts, ep=ep))  # fmt: skip
        mesh = MESHES[n % len(MESHES)]
        spec = f"seq_skew:rank={rng.randrange(world(mesh))},factor={level:g}"
        out.append(Scenario(f"seq_skew/{name}", mesh, [spec], name, seed=rng.randrange(1 << 30)))
        mesh, experts, ep = MOE_MESHES[n % len(MOE_MESHES)]
        spec = f"slow_rank:rank={rng.randrange(world(mesh))},factor={level:g}"
        out.append(Scenario(f"slow_rank(moe)/{name}", mesh, [spec], name,
                            seed=rng.randrange(1 << 30), experts=experts, ep=ep))  # fmt: skip
    for i in range(2 if quick else 4):
        mesh, experts, ep = MOE_MESHES[i % len(MOE_MESHES)]
        out.append(Scenario("healthy(moe)", mesh, [], "healthy", seed=rng.randrange(1 << 30),
                            experts=experts, ep=ep))  # fmt: skip
    return out


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


PRICED = ("slow_rank", "slow_link")  # faults whose findings the what-if prices (SPEC §3)


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


def link_groups(pair: tuple[int, int], mesh: dict[str, int]) -> list[list[int]]:
    """The collective groups (tp, cp, dp) holding both ends of a link."""
    return [
        sorted(g["ranks"])
        for g in mesh_groups(mesh)
        if g["name"] != "pp" and set(pair) <= set(g["ranks"])
    ]


def holders(expert: int, mesh: dict[str, int], experts: int, ep: int) -> list[int]:
    """Every rank whose ep index (dp index mod ep) holds ``expert``, on every stage."""
    index = expert // (experts // ep)
    return [r for r in range(world(mesh)) if coords_of(r, mesh)["dp"] % ep == index]


def names(fault, f: dict, mesh: dict[str, int], sc: Scenario | None = None) -> bool:
    """Whether finding ``f`` names injected ``fault`` (a tracer.faults.Fault).

    A slow link is named by its two ends; when the ends are not pipeline neighbours and share
    a single group, every member of that group sees the same slow collective and the pair
    cannot be told from the data, so naming that group's members (SPEC §3) counts too.
    """
    ranks = sorted(int(r) for r in f.get("ranks", []))
    if fault.kind == "slow_link":
        if ranks == sorted(fault.ranks):
            return True
        lo, hi = sorted(fault.ranks)
        stride = mesh["dp"] * mesh["cp"] * mesh["tp"]
        groups = link_groups(fault.ranks, mesh)
        return hi - lo != stride and len(groups) == 1 and ranks == groups[0]
    if fault.kind == "slow_rank":
        return [int(r) for r in f.get("ranks", [])][:1] == [fault.rank]
    if fault.kind == "hot_expert":
        return sc is not None and ranks == holders(fault.expert, mesh, sc.experts, sc.ep)
    return fault.rank in ranks


def score(
    sc: Scenario,
    report: dict,
    scores: dict[str, Score],
    alarms: list[str],
    saving: Callable[[str], float] | None = None,
) -> list[str]:
    """Add one run's outcome to the per-kind scores; returns a short verdict per fault.
    ``saving(spec)``: what removing a fault saves (:func:`saving_without`), asked only of a
    priced fault that nothing names."""
    faults = [f for f in parse_injections(sc.specs, world(sc.mesh)) if f.kind in EXPECTED]
    findings = report.get("findings", [])
    work = [f.kind for f in faults if f.kind in WORK_KINDS]

    def row(kind: str) -> str:
        """The table's row: a finding kind, by fault for the work given and MoE runs."""
        if kind == "load_imbalance" and len(work) == 1:
            return f"{kind} ({work[0]})"
        return f"{kind} (moe)" if sc.experts and kind == "straggler" else kind

    verdicts = []
    for fault in faults:
        kind = EXPECTED[fault.kind]
        s = scores[row(kind)]
        mine = [f for f in findings if f["kind"] == kind]
        found = any(names(fault, f, sc.mesh, sc) for f in mine)
        top1 = bool(mine) and names(fault, mine[0], sc.mesh, sc)
        cost = saving(fault.spec) if saving and not found and fault.kind in PRICED else None
        if cost is not None and cost < NOISE:
            s.quiet += 1
            verdicts.append(f"{fault.spec}: costs {cost:.2%}, below noise: no finding, right")
            continue
        s.faults += 1
        s.found += found
        s.top1 += top1
        s.by_severity[sc.severity][0] += top1
        s.by_severity[sc.severity][1] += 1
        named = next((f for f in mine if names(fault, f, sc.mesh, sc)), None)
        ratio = factor_ratio(fault, named)
        if ratio is not None:
            s.factor_ratios.append(ratio)
        got = f"; reported/injected {ratio:.2f}" if ratio is not None else ""
        verdicts.append(f"{fault.spec}: {'top-1' if top1 else 'found' if found else 'MISSED'}{got}")
    for f in findings:
        s = scores[row(f["kind"])]
        s.findings += 1
        ok = any(EXPECTED[x.kind] == f["kind"] and names(x, f, sc.mesh, sc) for x in faults)
        s.true_pos += ok
        if not faults and f["kind"] in ALARM_KINDS:
            alarms.append(
                f"{sc.name} seed {sc.seed}: {f['kind']} {f['ranks']} ({f.get('message', '')[:90]})"
            )
    return verdicts


def factor_ratio(fault, finding: dict | None) -> float | None:
    """For a slow_rank or slow_link fault and the finding that names it: the factor the
    message reports (SPEC §3: ``work_ratio``, ``transfer_ratio``) over the factor injected."""
    key = {"slow_rank": "work_ratio", "slow_link": "transfer_ratio"}.get(fault.kind)
    got = (finding or {}).get("evidence", {}).get(key) if key else None
    return float(got) / fault.factor if got and fault.factor else None


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:5.1f}%" if b else "    -"


def print_table(scores: dict[str, Score], alarms: list[str], healthy_runs: int) -> None:
    known = (*EXPECTED.values(), "stage_imbalance", "throttle", "regression")
    kinds = [k for k in dict.fromkeys(known) if k in scores]
    kinds += sorted(k for k in scores if k not in kinds)
    print()
    head = (f"{'kind':<29} {'faults':>6} {f'<{NOISE:.0%}':>4} {'recall':>7} {'top-1':>7} {'findings':>8} "
            f"{'precision':>9}   top-1 by level")  # fmt: skip
    print(head)
    print("-" * len(head))
    for k in kinds:
        s = scores[k]
        sev = "  ".join(
            f"{lvl}: {pct(*s.by_severity[lvl]).strip()} ({s.by_severity[lvl][1]})"
            for lvl in map(level_name, LEVELS)
            if s.by_severity[lvl][1]
        )
        print(
            f"{k:<29} {s.faults:>6} {s.quiet:>4} {pct(s.found, s.faults):>7} {pct(s.top1, s.faults):>7} "
            f"{s.findings:>8} {pct(s.true_pos, s.findings):>9}   {sev}"
        )
    hits = sum(v[0] for s in scores.values() for lvl, v in s.by_severity.items() if lvl != "1.05x")
    total = sum(v[1] for s in scores.values() for lvl, v in s.by_severity.items() if lvl != "1.05x")
    print(f"\ntop-1 at 1.1x and above (target 100%): {hits}/{total} = {pct(hits, total).strip()}")
    print(f"false alarms ({'/'.join(ALARM_KINDS)}) on {healthy_runs} healthy runs: {len(alarms)}")
    for a in alarms:
        print(f"  {a}")
    for k in kinds:
        r = sorted(scores[k].factor_ratios)
        if r:
            print(
                f"{k} factor reported/injected: median {r[len(r) // 2]:.2f}, "
                f"range {r[0]:.2f}-{r[-1]:.2f} ({len(r)} found; target 0.8-1.2)"
            )


def load_analyzer():
    try:
        from analyzer.db import open_run
        from analyzer.findings import analyze
    except ImportError as e:
        print(f"accuracy: the analyzer is not available yet ({e}); nothing to score")
        raise SystemExit(0) from None
    return open_run, analyze


def real_scenarios() -> list[Scenario]:
    mesh = {"dp": 2, "pp": 1, "tp": 2, "cp": 1}
    return [
        Scenario(
            "real slow_rank", mesh, ["slow_rank:rank=1,factor=1.6"], "2x", steps=20, real=True
        ),
        Scenario("real slow_data", mesh, ["slow_data:rank=2,ms=60"], "2x", steps=20, real=True),
        Scenario("real hang", mesh, ["hang:rank=3,step=8"], "2x", steps=20, real=True),
        Scenario("healthy", mesh, [], "healthy", steps=20, real=True),
    ]


def kineto_vs_hta() -> int:
    """Real data: megascope's ``gpu_breakdown`` and ``comm_overlap`` of imported Kineto traces
    next to Holistic Trace Analysis 0.5's temporal breakdown and comm/comp overlap of the same
    files (HTA run here): the shared two-rank set and every trace of the test corpus
    (tests/kineto_corpus.py). Prints a markdown table; needs the ``test`` extra (HTA)."""
    import math
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "tests"))
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace
    from kineto_corpus import shapes, write_shape

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
