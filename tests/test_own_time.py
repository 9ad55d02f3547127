"""A rank that waits rather than computes, where the spans cover a small part of the step: named
from its own time and arrivals, and priced from them, not dismissed by a replay that cannot see
its excess (issue 47)."""

from __future__ import annotations

import duckdb
import pytest

from tests.helpers.report import diagnose, shown
from tests.helpers.waiting_run import write_waiting_run


def median_step_ms(run: str) -> float:
    """The median over steps of the ranks' median `step` span, as the report's median step."""
    rel = duckdb.sql(
        f"select median(ms) from (select step, median(end_ns - start_ns) / 1e6 as ms "
        f"from read_parquet('{run}/spans/*/*.parquet') where name = 'step' and step >= 2 "
        f"group by step)"
    )
    return float(rel.fetchall()[0][0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("waiting")
    slow = write_waiting_run(str(base / "slow"), slow_rank=1, factor=1.5)
    return slow, write_waiting_run(str(base / "twin"), slow_rank=-1)


def test_a_sleeping_rank_between_spans_is_named_and_priced(runs) -> None:
    slow_run, twin_run = runs
    slow = diagnose(slow_run)
    stragglers = [f for f in slow["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[1]], shown(slow)
    assert not [d for d in slow["dismissed"] if d["kind"] == "straggler"], shown(slow)
    f = stragglers[0]
    ev = f["evidence"]
    # the replay holds almost none of its excess (it lies between the spans): priced from its
    # own time and its arrivals, which its peers' waits corroborate
    assert ev["priced_by"] == "own_time", shown(slow)
    assert ev["replay_excess_ms_per_step"] < 0.5 * ev["excess_ms_per_step"]
    # its severity agrees with what the run without it saves (the twin, written without it)
    saving = 1.0 - median_step_ms(twin_run) / median_step_ms(slow_run)
    assert saving > 0.1
    assert abs(f["severity"] - saving) <= saving / 3, (f["severity"], saving)


def test_the_healthy_twin_raises_nothing(runs) -> None:
    twin = diagnose(runs[1])
    alarms = [f for f in twin["findings"] if f["kind"] in ("straggler", "slow_link", "hang")]
    assert not alarms, shown(twin)
