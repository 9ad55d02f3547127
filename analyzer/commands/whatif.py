"""``megascope whatif RUN [--json]``: how much faster the run would be without its stragglers.

Replays the run's steps on their dependency graph with every operation at its typical duration
(the ideal) and with chosen subsets at their measured durations (ByteDance Seed's what-if
analysis, OSDI 2025): the slowdown S over the ideal, S by rank, dp rank, stage, op kind and step,
and the study's M_W (individual workers) and M_S (the last stage). Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import sys

from tracer.cliutil import ArgumentParser, UsageError, log_warnings, parse_steps


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope whatif", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--steps", metavar="A:B", help="only steps A..B (inclusive)")
    p.add_argument("--typical", choices=("study", "median"), default="study",
                   help="study: mean compute / median transfer over all steps (default); "
                        "median: median of the peers in the same step")  # fmt: skip
    p.add_argument("--max-groups", type=int, default=16, metavar="N",
                   help="replay at most N dp ranks past 2N (those over their typical the most)")  # fmt: skip
    return p


def _top(d: dict, n: int = 4) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in list(d.items())[:n])


def render(r: dict) -> str:
    """The report as text."""
    run = r["run"]
    mesh = run.get("mesh") or {}
    shape = " x ".join(f"{k}={v}" for k, v in mesh.items() if v and v > 1) or "1 rank"
    m_w = "n/a" if r["m_w"] is None else f"{r['m_w']:.3f}"
    m_s = "n/a" if r["m_s"] is None else f"{r['m_s']:.3f}"
    lines = [
        f"megascope whatif: {run['ranks']} ranks recorded of {run['world_size']} ({shape}), "
        f"{len(run['steps'])} steps replayed ({run['operations_per_step']} operations per step)",
        f"slowdown S = {r['slowdown']:.3f}: a step takes {r['t_measured_s'] * 1e3:.1f} ms, "
        f"{r['t_ideal_s'] * 1e3:.1f} ms with every operation at its typical duration "
        f"(saving {100 * (r['saving'] or 0):.1f}%)",
        f"by stage:   {_top(r['by_stage'])}",
        f"by dp rank: {_top(r['by_dp_rank'])}",
        f"by rank:    {_top(r['by_rank'])}  ({r['by_rank_method']})",
        f"by op:      {_top(r['by_op'])}",
        f"M_W (top {len(r['m_w_ranks'])} worker(s): {r['m_w_ranks'][:8]}) = {m_w}; "
        f"M_S (last stage) = {m_s}",
    ]
    worst = sorted(r["by_step"].items(), key=lambda kv: -(kv[1] or 0))[:3]
    lines.append("slowest steps: " + ", ".join(f"{k} {v:.3f}" for k, v in worst if v))
    if run["steps_left_out"]:
        lines.append(
            f"left out (other operations than the rest): steps {run['steps_left_out'][:10]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_groups < 1:
        raise UsageError(f"--max-groups must be >= 1, got {args.max_groups}")
    from analyzer.whatif import WhatIfError, analyze_whatif

    log_warnings()

    try:
        report = analyze_whatif(
            args.run, parse_steps(args.steps), max_groups=args.max_groups, typical=args.typical
        )
    except WhatIfError as e:
        raise UsageError(str(e)) from None
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text if args.json else render(report), file=sys.stdout)
    return 0
