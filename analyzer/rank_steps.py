"""The per-(rank, step) tables of a run that the dashboard draws and the trackers log.

:func:`build_rank_step_tables` makes, on an open run, ``dash_rank_step`` (each rank's step,
compute, communication and exposed communication per step: the exact interval unions up to
``DRAW_EXACT_MAX_RANKS`` ranks, the digests' sums past that), ``dash_topology``,
``dash_rank_class`` (a view: each rank's peer class, its stage, context shard and hardware
class), ``dash_rank_peer`` (each rank's compute spans over its stage peers', per step) and the
view ``dash_rank_score``: each rank's straggler score per step, its own time over its stage peers'
(``analyzer/sql/rank_steps/rank_step_score.sql``), the rank x step heatmap's default measure.
:func:`step_scores` reads that view per step, with the step's exposed communication: what
``analyze --log-to`` and ``watch --log-to`` send to a tracker (analyzer/trackers/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analyzer import duck
from analyzer.duck import DRAW_EXACT_MAX_RANKS


def _sql(name: str) -> str:
    return duck.sql_text(f"rank_steps/{name}")


def build_rank_step_tables(run: Any, exact: bool | None = None) -> None:
    """Make ``dash_rank_step_sums``, ``dash_rank_step``, ``dash_topology``, the view
    ``dash_rank_class``, ``dash_rank_peer`` and the view ``dash_rank_score`` on ``run`` (an
    open :class:`analyzer.db.Run`): ``exact`` (default: up to ``DRAW_EXACT_MAX_RANKS`` ranks) from every span and collective, else from
    the digests."""
    if exact is None:
        exact = run.world_size <= DRAW_EXACT_MAX_RANKS
    run.create_table("dash_rank_step_sums", _sql("rank_step_digest"))
    if exact:
        run.create_table("dash_rank_step", _sql("rank_step"))
    else:
        run.con.execute("create or replace view dash_rank_step as from dash_rank_step_sums")
    run.create_table("dash_topology", _sql("topology"))
    run.con.execute(f"create or replace view dash_rank_class as {_sql('rank_class')}")
    run.create_table("dash_rank_peer", _sql("rank_step_peer" if exact else "rank_step_peer_none"))
    run.con.execute(f"create or replace view dash_rank_score as {_sql('rank_step_score')}")


@dataclass(frozen=True)
class StepScores:
    """One step: each rank's straggler score (own time over its stage peers', 1.0 typical)
    and the step's exposed communication (the median rank's time blocked in collectives)."""

    step: int
    exposed_comm_ms: float | None
    scores: dict[int, float] = field(default_factory=dict)


def step_scores(run: Any, steps: tuple[int, int]) -> list[StepScores]:
    """Steps ``steps[0]..steps[1]`` of ``run``, after :func:`build_rank_step_tables`."""
    df = run.execute(_sql("step_scores"), {"first": int(steps[0]), "last": int(steps[1])})
    out: dict[int, StepScores] = {}
    for step, rank, ratio, exposed in zip(
        df["step"], df["rank"], df["peer_ratio"], df["exposed_comm_ms"], strict=True
    ):
        s = int(step)
        row = out.get(s)
        if row is None:
            ms = None if _missing(exposed) else float(exposed)
            row = out[s] = StepScores(s, ms)
        if not _missing(ratio):
            row.scores[int(rank)] = float(ratio)
    return [out[s] for s in sorted(out)]


def _missing(x: Any) -> bool:
    return x is None or x != x  # None, NaN or pandas' NA
