"""The 3D view coloured by work per rank (the run's ``work`` table) as well as by time.

The run is a real traced one: four gloo ranks (dp2 x tp2) that record their tokens and their
expert's tokens with ``tracer.record_work`` and exchange uneven ``all_to_all_single`` splits,
whose ``a2a_sent`` rows the tracer writes itself. The data-level tests call the page's
callbacks through Dash's own endpoint; the browser test switches the control in headless
Chromium and reads the 3D view's colours back.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers.dash import array, callback
from helpers.small_run import write_small_run
from helpers.tables import QUIET

import tracer
from dashboard import serving

WORLD = 4
MESH = {"dp": 2, "pp": 2, "tp": 2}  # the small runs beside the traced one
TOKENS = (100, 300)  # per step, by dp replica: ranks 0, 1 are dp0, ranks 2, 3 dp1
EXPERT_TOKENS = (10, 20, 30, 40)  # per step, rank r holds expert r
HOT = 3  # every rank sends this rank two rows of its all_to_all, the others one
ROW_BYTES = 16  # 4 float32

# the work each rank is given over the median rank's (200 tokens, 25 expert tokens, 64 bytes)
RATIOS = {
    "tokens": {0: 0.5, 1: 0.5, 2: 1.5, 3: 1.5},
    "expert_tokens": {0: 0.4, 1: 0.8, 2: 1.2, 3: 1.6},
    "a2a_recv": {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0},
}
TOPOLOGY = "..topology.figure...slab.figure...slab-box.style.."
WORK_OPTIONS = "..work.options...work.value...work-box.style.."
POLL = "..version.data...poll.disabled...run-info.children.."


def _traced(rank: int, world: int, run: str) -> None:
    """Three steps of forward work with its work rows and one all_to_all per step."""
    tracer.attach(run, mesh={"dp": 2, "pp": 1, "tp": 2, "cp": 1}, config=QUIET)
    splits = [2 if peer == HOT else 1 for peer in range(world)]
    outs = [splits[rank]] * world
    for step in range(3):
        tracer.step(step)
        with tracer.span("forward", microbatch=0):
            tracer.record_work("tokens", TOKENS[rank // 2])
            tracer.record_work("expert_tokens", EXPERT_TOKENS[rank], key=rank)
            x = torch.ones(sum(splits), 4)
            dist.all_to_all_single(torch.empty(sum(outs), 4), x, outs, splits)
            time.sleep(0.01)
    tracer.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory, ranks) -> str:
    """A folder of two runs: ``work`` (traced, with work rows) and ``plain`` (none)."""
    base = tmp_path_factory.mktemp("work_runs")
    ranks(_traced, WORLD, str(base / "work"))
    write_small_run(str(base / "plain"), MESH, steps=3, slow_rank=5)
    return str(base)


@pytest.fixture(scope="module")
def client(root):
    from dashboard.app import create_app

    return create_app(root).server.test_client()


def _version(client, name: str) -> dict:
    got = callback(
        client, POLL, [("poll", "n_intervals", 0), ("run", "value", name)],
        [("version", "data", None)],
    )  # fmt: skip
    return got["version"]["data"]


def _colours(client, version: dict, work: str, metric: str = "compute") -> dict[int, float]:
    """The 3D view's colour value of each rank, as the topology callback draws it."""
    inputs = [
        ("version", "data", version),
        ("metric", "value", metric),
        ("steps", "value", [0, 2]),
        ("slice-axis", "value", "none"),
        ("slice-index", "value", 0),
        ("cp", "value", -1),
        ("selected", "data", []),
        ("work", "value", work),
    ]
    trace = callback(client, TOPOLOGY, inputs)["topology"]["figure"]["data"][0]
    colours = array(trace["marker"]["color"])
    return {int(r): float(c) for r, c in zip(trace["customdata"], colours, strict=True)}


def test_work_choices_are_the_kinds_the_run_has(client):
    got = callback(
        client, WORK_OPTIONS, [("version", "data", _version(client, "work"))],
        [("work", "value", "tokens")],
    )  # fmt: skip
    values = [o["value"] for o in got["work"]["options"]]
    assert values == ["time", "tokens", "expert_tokens", "a2a_recv"]
    assert got["work"]["value"] == "tokens" and got["work-box"]["style"] == {"display": "block"}


def test_the_3d_view_is_coloured_by_each_work_ratio(client):
    version = _version(client, "work")
    for kind, expected in RATIOS.items():
        assert _colours(client, version, kind) == pytest.approx(expected), kind
    by_time = _colours(client, version, "time")
    assert by_time != pytest.approx(RATIOS["tokens"]) and all(v > 0 for v in by_time.values())


def test_a_run_without_work_hides_the_control_and_still_draws(client):
    version = _version(client, "plain")
    got = callback(
        client, WORK_OPTIONS, [("version", "data", version)], [("work", "value", "tokens")]
    )
    assert [o["value"] for o in got["work"]["options"]] == ["time"]
    assert got["work"]["value"] == "time" and got["work-box"]["style"] == {"display": "none"}
    assert _colours(client, version, "time")[5] == pytest.approx(47.0)  # the slow rank's ms


# The 3D view's title and colour value per rank, as plotly drew them in the page.
DRAWN = """() => {
  const gd = document.querySelector('#topology .js-plotly-plot');
  if (!gd || !gd._fullData || !gd._fullData.length) return null;
  const t = gd._fullData[0], out = {};
  const ranks = Array.from(t.customdata || []), colours = Array.from(t.marker.color || []);
  ranks.forEach((r, i) => { out[r] = colours[i]; });
  return {title: gd._fullLayout.title.text, colours: out};
}"""
TITLED = "(prefix) => { const d = (" + DRAWN + ")(); return d && d.title.startsWith(prefix); }"


def test_switching_the_control_recolours_the_3d_view(root, browser):
    proc, url = serving.start(os.path.join(root, "work"))
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#work-box[style*='block']")
        page.wait_for_function(TITLED, arg="own time")  # the default measure (views.METRICS)
        before = page.evaluate(DRAWN)["colours"]
        page.get_by_label("expert tokens").check()
        page.wait_for_function(TITLED, arg="tokens routed")
        after = page.evaluate(DRAWN)["colours"]
        page.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert {int(r): v for r, v in after.items()} == pytest.approx(RATIOS["expert_tokens"])
    assert {int(r): v for r, v in before.items()} != pytest.approx(RATIOS["expert_tokens"])
