"""The dashboard's first look shows the culprit: the 3D view opens on the finding's own measure
(own time over stage peers, the rank x step heatmap's computation), where the rank the
analyzer names is the darkest cell; compute time stays one choice away.

On the dashboard's figure data, through Dash's own endpoint as the browser calls it: the
layout's default "colour by" and the topology callback's colours over the whole run, on the
demo-like sample (samples/slow_rank: the trainer on 8 CPU ranks, dp2 x pp2 x tp2 with sequence
parallel, rank 5 at 1.6x, whose compute time reads its tensor-parallel peer darker) and on a
12,288-rank simulated run with one straggler (built once per module). The same in a real
browser is tests/test_dashboard_browser.py's.
"""

from __future__ import annotations

import os

import pytest
from helpers.dash import array, callback
from helpers.synth import synth_run

from dashboard import views
from dashboard.source import RunSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "samples", "slow_rank")
BIG = {"dp": 192, "pp": 8, "tp": 8, "cp": 1}  # 12,288 ranks
BIG_SLOW = 5123
POLL = "..version.data...poll.disabled...run-info.children.."
TOPOLOGY = "..topology.figure...slab.figure...slab-box.style.."


def first_look(run: str) -> tuple[str, dict[int, float], list[int]]:
    """The page's default "colour by", the 3D view's colour per rank as it opens (the whole
    run), and the ranks the analyzer's findings name."""
    from dashboard.app import create_app

    client = create_app(run).server.test_client()
    default = _value_of(client.get("/_dash-layout").get_json(), "metric")
    version = callback(
        client, POLL, [("poll", "n_intervals", 0), ("run", "value", ".")],
        [("version", "data", None)],
    )["version"]["data"]  # fmt: skip
    src = RunSource(run)
    first, last = views.step_bounds(src)
    named = sorted(
        {int(r) for f in views.findings(src, first, last)["findings"] for r in f["ranks"]}
    )
    inputs = [
        ("version", "data", version),
        ("metric", "value", default),
        ("steps", "value", [first, last]),
        ("slice-axis", "value", "none"),
        ("slice-index", "value", 0),
        ("cp", "value", -1),
        ("selected", "data", []),
        ("work", "value", "time"),
    ]
    trace = callback(client, TOPOLOGY, inputs)["topology"]["figure"]["data"][0]
    colours = array(trace["marker"]["color"])
    values = {int(r): float(c) for r, c in zip(trace["customdata"], colours, strict=True)}
    return default, values, named


def _value_of(node: object, component: str) -> object:
    """The initial ``value`` of the component with id ``component`` in a layout's JSON."""
    if isinstance(node, dict):
        props = node.get("props")
        if isinstance(props, dict) and props.get("id") == component:
            return props.get("value")
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        got = _value_of(child, component)
        if got is not None:
            return got
    return None


def _darkest(values: dict[int, float]) -> int:
    return max(values, key=values.__getitem__)


def test_the_sample_opens_on_its_straggler_and_compute_time_is_one_choice_away():
    default, values, named = first_look(SAMPLE)
    assert default == "peers" and named == [5]
    assert len(values) == 8 and _darkest(values) == 5, values
    assert "compute" in views.METRICS  # the other measure, in the same selector
    compute = views.rank_values(RunSource(SAMPLE), "compute", *views.step_bounds(RunSource(SAMPLE)))
    by_rank = dict(zip(compute["rank"], compute["value"], strict=True))
    assert (
        by_rank[5] > 0
    )  # (its tensor-parallel peer reads as dark there: why it is not the default)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    return synth_run(
        str(tmp_path_factory.mktemp("first_look") / "big"),
        f"slow_rank:rank={BIG_SLOW},factor=1.5",
        mesh=BIG,
        steps=6,
        detail="coarse",
    )


def test_a_12288_rank_run_opens_on_its_straggler(big):
    default, values, named = first_look(big)
    assert named == [BIG_SLOW]
    assert len(values) == 12288 and _darkest(values) == BIG_SLOW


def test_the_3d_view_reads_the_heatmap_computation(big):
    """One computation: the 3D view's value of a rank is the heatmap's cell of that rank over
    the same steps (one bin of steps)."""
    src = RunSource(big)
    first, last = views.step_bounds(src)
    per_rank = views.peer_values(src, first, last).set_index("rank")["value"]
    grid = views.rank_step_grid(src, first, last, rank_bins=12288, step_bins=1)
    assert (grid["rank_lo"] == grid["rank_hi"]).all()
    assert per_rank.loc[grid["rank_lo"]].tolist() == pytest.approx(grid["peer_ratio"].tolist())
