"""How bench/accuracy.py scores a report against what was injected: whether a finding names
the fault, top-1 and recall per level, the reported factor over the injected, false alarms;
and the table it prints."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accuracy_scenarios import (  # noqa: E402
    ALARM_KINDS,
    EXPECTED,
    LEVELS,
    PRICED,
    WORK_KINDS,
    Scenario,
    level_name,
    world,
)

from analyzer.findings.severity.cost import NOISE  # noqa: E402
from analyzer.synth import parse_injections  # noqa: E402
from tracer.rundir import coords_of, mesh_groups  # noqa: E402

# fault kind -> finding kind


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
