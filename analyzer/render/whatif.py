"""The what-if report (``megascope whatif``) as text: the slowdown over the ideal and who
causes it."""

from __future__ import annotations

from typing import Any


def _top(d: dict[str, Any], n: int = 4) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in list(d.items())[:n])


def render(r: dict[str, Any]) -> str:
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
