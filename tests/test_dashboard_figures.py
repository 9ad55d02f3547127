"""The dashboard's figure builders on known data: values land on the right rank."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dashboard import figures as F
from dashboard import figures_detail as D
from dashboard.views import fold_cp
from tracer.rundir import coords_of

MESH = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}


def cells(values: dict[int, float], mesh: dict[str, int] = MESH) -> pd.DataFrame:
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh.get("cp", 1)
    rows = [
        {"rank": r, "host": f"node{r // 4}", **coords_of(r, mesh), "value": values.get(r, 1.0)}
        for r in range(world)
    ]
    return pd.DataFrame(rows)


def _by_rank(trace) -> dict[int, tuple]:
    """rank -> (x, y, z, colour) of a Scatter3d trace built by topology_3d."""
    ranks = [int(c) for c in trace.customdata]
    colors = trace.marker.color if trace.marker.color is not None else [None] * len(ranks)
    if isinstance(colors, str):
        colors = [colors] * len(ranks)
    return {
        r: (int(x), int(y), int(z), c)
        for r, x, y, z, c in zip(ranks, trace.x, trace.y, trace.z, colors, strict=True)
    }


def test_3d_puts_each_rank_at_its_coordinates_with_its_value():
    values = {r: 10.0 + r for r in range(8)}
    fig = F.topology_3d(cells(values), label="compute", unit="ms")
    got = _by_rank(fig.data[0])
    assert set(got) == set(range(8))
    for r in range(8):
        c = coords_of(r, MESH)
        # x = dp, y = tp, z = pp, colour = the rank's value
        assert got[r] == (c["dp"], c["tp"], c["pp"], 10.0 + r)
    assert got[5][:3] == (0, 1, 1)
    assert fig.data[0].marker.colorscale is not None


def test_3d_greys_ranks_without_data_and_marks_findings_and_selection():
    values = {r: 1.0 for r in range(8)}
    values[3] = math.nan
    fig = F.topology_3d(cells(values), label="x", unit="ms", marked=[5], selected=[2, 6])
    assert 3 not in _by_rank(fig.data[0])
    assert set(_by_rank(fig.data[1])) == {3}
    marked, selected = fig.data[2], fig.data[3]
    assert marked.name == "finding" and set(_by_rank(marked)) == {5}
    assert _by_rank(marked)[5][:3] == (0, 1, 1)
    assert marked.marker.symbol == "square-open" and marked.marker.color == F.MARK_COLOR
    assert set(_by_rank(selected)) == {2, 6}


def test_high_is_good_metrics_reverse_the_colour_scale():
    bad_high = F.topology_3d(cells({}), label="x", unit="ms")
    bad_low = F.topology_3d(cells({}), label="x", unit="GB/s", high_is_bad=False)
    assert bad_high.data[0].marker.colorscale != bad_low.data[0].marker.colorscale


def test_slice_keeps_the_cells_of_one_slab():
    c = cells({r: float(r) for r in range(8)})
    assert sorted(F.slice_cells(c, "pp", 1)["rank"]) == [4, 5, 6, 7]
    assert sorted(F.slice_cells(c, "tp", 0)["rank"]) == [0, 2, 4, 6]
    assert sorted(F.slice_cells(c, "dp", 1)["rank"]) == [2, 3, 6, 7]
    assert len(F.slice_cells(c, None, None)) == 8
    with pytest.raises(ValueError):
        F.slice_cells(c, "rank; drop table spans", 0)


def test_slab_heatmap_places_values_by_the_other_two_axes():
    c = F.slice_cells(cells({r: 100.0 + r for r in range(8)}), "pp", 1)
    fig = F.topology_slab(c, "pp", label="x", unit="ms", marked=[5])
    heat = fig.data[0]
    z, ranks = np.array(heat.z), np.array(heat.customdata)
    # rows = dp, columns = tp; rank 5 is dp0 tp1, rank 6 is dp1 tp0
    assert z[0, 1] == 105.0 and ranks[0, 1] == "5"
    assert z[1, 0] == 106.0 and ranks[1, 0] == "6"
    assert list(fig.data[1].customdata) == ["5"]  # strings: see figures.click_ids


def test_fold_cp_means_over_context_parallel_ranks():
    mesh = {"dp": 1, "pp": 1, "tp": 2, "cp": 2}
    c = cells({0: 1.0, 1: 2.0, 2: 3.0, 3: 6.0}, mesh)
    folded = fold_cp(c, None)
    assert len(folded) == 2
    row = folded[folded["tp"] == 1].iloc[0]
    assert row["value"] == 4.0 and row["rank"] == 1 and row["ranks"] == 2
    assert sorted(fold_cp(c, 1)["rank"]) == [2, 3]


def grid() -> pd.DataFrame:
    rows = []
    for rbin, (lo, hi, host) in enumerate([(0, 3, "node0"), (4, 7, "node1")]):
        for sbin, (s0, s1) in enumerate([(0, 1), (2, 3), (4, 5)]):
            worst = 5 if rbin == 1 else lo
            rows.append(
                dict(
                    rbin=rbin,
                    sbin=sbin,
                    rank_lo=lo,
                    rank_hi=hi,
                    host_lo=host,
                    host_hi=host,
                    step_lo=s0,
                    step_hi=s1,
                    compute_ms=10.0 * rbin + sbin,
                    step_ms=0.0,
                    comm_ms=0.0,
                    exposed_ms=0.0,
                    worst_rank=worst,
                )
            )
    return pd.DataFrame(rows)


def test_rank_step_heatmap_rows_are_rank_bins_and_marks_the_findings_row():
    fig = F.rank_step_heatmap(grid(), "compute_ms", label="compute", unit="ms", marked=[5])
    heat = fig.data[0]
    assert list(heat.y) == ["node0 r0-3", "◆ node1 r4-7"]
    assert list(heat.x) == ["0-1", "2-3", "4-5"]
    assert np.array(heat.z)[1, 2] == 12.0 and np.array(heat.z)[0, 1] == 1.0
    assert np.array(heat.customdata)[1, 0] == "5"


def test_rank_step_heatmap_of_nothing_says_so():
    empty = grid().iloc[0:0]
    fig = F.rank_step_heatmap(empty, "compute_ms", label="c", unit="ms")
    assert "no steps" in fig.layout.annotations[0].text


MS = 1_000_000


def timeline_data() -> tuple[pd.DataFrame, pd.DataFrame]:
    spans = pd.DataFrame(
        [
            dict(rank=1, microbatch=-1, name="forward", kind="compute", start_ns=0, end_ns=10 * MS),
            dict(rank=5, microbatch=-1, name="forward", kind="compute", start_ns=0, end_ns=15 * MS),
        ]
    )
    coll = dict(group_size=2, nbytes=4, gid=0)
    colls = pd.DataFrame(
        [
            dict(
                rank=1,
                op="send",
                group_name="pp",
                src=1,
                dst=5,
                seq=0,
                start_ns=10 * MS,
                end_ns=11 * MS,
                **coll,
            ),
            dict(
                rank=5,
                op="recv",
                group_name="pp",
                src=1,
                dst=5,
                seq=0,
                start_ns=2 * MS,
                end_ns=12 * MS,
                **coll,
            ),
            dict(
                rank=1,
                op="all_reduce",
                group_name="dp",
                src=-1,
                dst=-1,
                seq=3,
                start_ns=12 * MS,
                end_ns=20 * MS,
                **coll,
            ),
            dict(
                rank=5,
                op="all_reduce",
                group_name="dp",
                src=-1,
                dst=-1,
                seq=3,
                start_ns=18 * MS,
                end_ns=None,
                **{**coll, "gid": 1},
            ),
            dict(
                rank=5,
                op="all_reduce",
                group_name="tp",
                src=-1,
                dst=-1,
                seq=7,
                start_ns=16 * MS,
                end_ns=None,
                **coll,
            ),
        ]
    )
    return spans, colls


def test_collective_links_match_by_analyzer_keys():
    _, colls = timeline_data()
    links = D.collective_links(colls)
    # send issue on 1 -> recv end on 5; the dp all_reduces are of different groups (gid)
    assert links == [("pp", [(1, 10 * MS), (5, 12 * MS)])]


def test_timeline_bars_start_where_the_spans_start_and_flag_unfinished():
    spans, colls = timeline_data()
    topo = cells({})
    fig = D.timeline(spans, colls, topo, step=3, ranks=[1, 5], selected=[5])
    by_name = {t.name: t for t in fig.data}
    compute = by_name["span: compute"]
    assert list(compute.base) == [0.0, 0.0] and list(compute.x) == [10.0, 15.0]
    assert list(compute.y) == ["r1 dp0 pp0 tp1", "▶ r5 dp0 pp1 tp1"]
    open_ = by_name["never completed"]
    assert sorted(open_.customdata) == ["5", "5"]
    assert by_name["link: pp"].x[:2] == (10.0, 12.0)
    assert list(fig.layout.yaxis.categoryarray) == ["▶ r5 dp0 pp1 tp1", "r1 dp0 pp0 tp1"]


def test_links_figure_lists_the_slowest_pair_first():
    p2p = pd.DataFrame(
        dict(
            src=[0, 1, 2],
            dst=[4, 5, 6],
            gbps=[10.0, 2.0, 9.0],
            transfers=[1, 1, 1],
            nbytes=[1, 1, 1],
        )
    )
    groups = pd.DataFrame(
        dict(
            group_name=["dp", "dp", "tp"],
            gid=[0, 1, 0],
            first_rank=[0, 1, 0],
            group_size=[2, 2, 2],
            gbps=[5.0, 1.0, 50.0],
            calls=[1, 1, 1],
        )
    )
    fig = D.links_figure(p2p, groups, slowest=2)
    bars = fig.data[0]
    assert list(bars.y) == ["2→6", "1→5"]  # slowest at the top of a horizontal bar chart
    assert [t.name for t in fig.data[1:]] == ["dp", "tp"]
    assert any("median 9" in (a.text or "") for a in fig.layout.annotations)


def test_gpu_figure_colours_the_findings_rank():
    gpu = pd.DataFrame(
        dict(
            rank=[0, 1, 2],
            host=["a", "a", "b"],
            sm_clock_mhz=[1980, 1200, 1980],
            power_w=[1.0, 2.0, 3.0],
            temp_c=[60, 80, 60],
            util_gpu=[90, 90, 90],
        )
    )
    fig = D.gpu_figure(gpu, marked=[1], selected=[2])
    colors = list(fig.data[0].marker.color)
    assert (
        colors[1] == F.MARK_COLOR
        and colors[2] == F.SELECT_COLOR
        and colors[0] not in (F.MARK_COLOR, F.SELECT_COLOR)
    )
    assert list(fig.data[0].y) == [1980, 1200, 1980]
    assert "no GPU" in D.gpu_figure(gpu.iloc[0:0]).layout.annotations[0].text


def whatif_tables() -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    grid = pd.DataFrame(
        dict(
            dp=[0, 0, 1, 1, 2, 2],
            pp=[0, 1, 0, 1, 0, 1],
            ranks=[2] * 6,
            first_rank=[0, 6, 2, 8, 4, 10],
            excess_s=[0.0, 0.3, 0.0, 0.0, 0.01, 0.0],
            replayed=[True, True, True, False, True, False],
            slowdown=[1.0, 1.25, 1.01, math.nan, 1.02, math.nan],
        )
    )
    steps = pd.DataFrame(
        dict(
            step=[3, 4, 5],
            measured_s=[0.3, 0.36, 0.3],
            ideal_s=[0.25] * 3,
            slowdown=[1.2, 1.44, 1.2],
        )
    )
    summary = dict(
        slowdown=1.28, t_measured_s=0.32, t_ideal_s=0.25, steps=3, steps_left_out=[2],
        cells=6, cells_replayed=4,
    )  # fmt: skip
    return grid, steps, summary


def test_whatif_grid_puts_each_worker_at_its_dp_and_stage():
    from dashboard import figures_whatif as W

    fig = W.whatif_figure(*whatif_tables())
    heat = fig.data[0]
    z, ranks, text = np.array(heat.z, dtype=float), np.array(heat.customdata), np.array(heat.text)
    assert z.shape == (2, 3)  # rows: stages, columns: dp ranks
    assert z[1, 0] == 1.25 and ranks[1, 0] == "6"  # dp0 stage 1: the slow worker, rank 6 first
    assert z[0, 2] == 1.02 and ranks[0, 2] == "4"
    assert np.isnan(z[1, 1]) and "not replayed" in text[1, 1] and ranks[1, 1] == "8"
    assert heat.zmax == 1.25 and heat.zmin == 1.0
    bars = fig.data[1]
    assert list(bars.x) == ["3", "4", "5"] and list(bars.y) == [1.2, 1.44, 1.2]
    assert "measured 360 ms" in bars.hovertext[1]
    line = fig.data[2]
    assert list(line.y) == [1.28, 1.28] and "1.280" in line.name
    assert "S = 1.280" in fig.layout.title.text and "saving 21.9%" in fig.layout.title.text
    info = W.whatif_info(whatif_tables()[2])
    assert "3 steps replayed" in info and "1 left out" in info and "4 of 6 workers" in info


def test_whatif_figure_of_nothing_says_so():
    from dashboard import figures_whatif as W

    grid, steps, summary = whatif_tables()
    fig = W.whatif_figure(grid.iloc[0:0], steps.iloc[0:0], {})
    assert "nothing to replay" in fig.layout.annotations[0].text


def test_a_relative_heatmap_starts_its_scale_at_the_peers_median():
    g = grid().assign(peer_ratio=lambda d: 1.0 + 0.01 * d["sbin"])
    fig = F.rank_step_heatmap(g, "peer_ratio", label="vs peers", unit="× peers", relative=True)
    assert (fig.data[0].zmin, fig.data[0].zmax) == (1.0, 1.25)  # healthy noise stays pale
    g.loc[g["rbin"] == 1, "peer_ratio"] = 1.6
    fig = F.rank_step_heatmap(g, "peer_ratio", label="vs peers", unit="× peers", relative=True)
    assert fig.data[0].zmax == pytest.approx(1.6)
    raw = F.rank_step_heatmap(g, "compute_ms", label="compute", unit="ms")
    assert raw.data[0].zmin is None  # raw times keep plotly's own range
