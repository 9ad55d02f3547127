"""Kineto import over a corpus of traces in the shapes users have, each compared with
Holistic Trace Analysis (HTA) 0.5 itself, run here on the same files.

Every shape of tests/helpers/kineto_corpus.py imports under its own file name (exit 0), gets the
ranks and world its traces state, and its ``gpu_breakdown`` equals HTA's default temporal
breakdown (to the microsecond where no event is shorter than a microsecond, within 1 point
always) and its ``comm_overlap`` HTA's communication/computation overlap. The shared two-rank
recommendation-model set (tests/data/kineto/two_rank_recsys) is compared the same way.
"""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest
from helpers.kineto_corpus import shapes, write_shape
from hta.analyzers.breakdown_analysis import BreakdownAnalysis
from hta.analyzers.communication_analysis import CommunicationAnalysis
from hta.common.trace import Trace

from analyzer import cli
from analyzer.db import open_run
from tracer.rundir import read_run_json

# HTA 0.5 on pandas 3 warns about its own pandas calls; those warnings are not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The inplace keyword:Warning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECSYS = os.path.join(REPO, "tests", "data", "kineto", "two_rank_recsys")
SHAPES = {s.name: s for s in shapes()}


def hta_views(files: dict[int, str], exact_ns: bool, monkeypatch) -> tuple[dict, dict]:
    """HTA 0.5's temporal breakdown (µs) and comm/comp overlap (%) of ``{rank: file}``, as
    ``TraceAnalysis`` computes them by default (last profiler step left out)."""
    if exact_ns:
        monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    else:
        monkeypatch.delenv("HTA_DISABLE_NS_ROUNDING", raising=False)
    t = Trace(trace_files=files, trace_dir=os.sep)
    t.load_traces(include_last_profiler_step=False, use_multiprocessing=False,
                  use_memory_profiling=False)  # fmt: skip
    b = BreakdownAnalysis.get_temporal_breakdown(t, visualize=False)
    o = CommunicationAnalysis.get_comm_comp_overlap(t, visualize=False)
    cols = ("idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)")
    breakdown = {int(r["rank"]): tuple(float(r[c]) for c in cols) for _, r in b.iterrows()}
    overlap = {int(r["rank"]): float(r["comp_comm_overlap_pctg"]) for _, r in o.iterrows()}
    return breakdown, overlap


def megascope_views(run_dir: str) -> tuple[dict, dict]:
    """``gpu_breakdown`` in µs (idle, compute, non-compute, kernel) and ``comm_overlap``."""
    run = open_run(run_dir)
    b = run.execute("select * from gpu_breakdown")
    o = run.execute("select * from comm_overlap")
    breakdown = {
        int(r.rank): (r.idle_ns / 1e3, r.compute_ns / 1e3, r.non_compute_ns / 1e3, r.kernel_ns / 1e3)
        for r in b.itertuples()
    }  # fmt: skip
    overlap = {int(r.rank): (math.nan if pd.isna(r.overlap_pct) else float(r.overlap_pct))
               for r in o.itertuples()}  # fmt: skip
    return breakdown, overlap


def assert_same_as_hta(mine: tuple[dict, dict], hta: tuple[dict, dict], exact: bool) -> None:
    (b, o), (hb, ho) = mine, hta
    assert sorted(b) == sorted(hb) and sorted(o) == sorted(ho)
    for rank, theirs in hb.items():
        ours = b[rank]
        if exact:
            assert ours == pytest.approx(theirs, abs=1e-6), rank
        kernel = theirs[3]
        for a, h in zip(ours[:3], theirs[:3], strict=True):
            assert abs(100 * a / ours[3] - 100 * h / kernel) < 1.0, (rank, ours, theirs)
        if math.isnan(ho[rank]):
            assert math.isnan(o[rank])
        else:
            assert o[rank] == pytest.approx(ho[rank], abs=0.01 if exact else 1.0)


def import_cli(src: str, out: str, *extra: str) -> int:
    """``megascope import kineto SRC --out OUT``, in this process (the CLI's own code)."""
    return cli.main(["import", "kineto", src, "--out", out, *extra])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_imports_under_its_name_and_equals_hta(name, tmp_path, monkeypatch, capsys):
    shape = SHAPES[name]
    src = write_shape(shape, str(tmp_path / "traces"))
    out = str(tmp_path / "run")
    exact_ns = bool(shape.options.get("exact_ns"))
    assert import_cli(src, out, *(["--exact-ns"] if exact_ns else [])) == 0
    summary = capsys.readouterr().out
    assert summary.startswith("imported kineto:"), summary
    meta = read_run_json(out)
    files = meta["import"]["files"]
    assert dict(zip(files, meta["import"]["ranks"], strict=True)) == shape.ranks
    assert meta["world_size"] == shape.world
    by_rank = {rank: os.path.join(src, f) for f, rank in shape.ranks.items()}
    hta = hta_views(by_rank, exact_ns, monkeypatch)
    assert_same_as_hta(megascope_views(out), hta, shape.exact)


def test_recsys_set_equals_hta_run_here(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    assert import_cli(RECSYS, out) == 0
    files = {r: os.path.join(RECSYS, f"sampled_rank-{r}.json.gz") for r in (0, 1)}
    hta = hta_views(files, False, monkeypatch)
    assert_same_as_hta(megascope_views(out), hta, exact=True)
    # HTA reads the ranks from the files' distributedInfo itself: the same mapping
    t = Trace(trace_dir=RECSYS)
    assert {r: os.path.basename(p) for r, p in t.trace_files.items()} == {
        0: "sampled_rank-0.json.gz", 1: "sampled_rank-1.json.gz"}  # fmt: skip


def test_pre_window_events_are_counted_in_the_summary(tmp_path, capsys):
    shape = SHAPES["multi_stream_steps"]
    src = write_shape(shape, str(tmp_path / "traces"))
    assert import_cli(src, str(tmp_path / "run")) == 0
    summary = capsys.readouterr().out
    assert "left out 60 device events whose launch is not in the trace" in summary
    assert "rounded to whole microseconds" in summary
    meta = read_run_json(str(tmp_path / "run"))
    assert meta["import"]["left_out_unlaunched"] == 60
    assert meta["import"]["rounded_to_us"] == ["rank0.pt.trace.json.gz"]
    # one step: HTA keeps work launched before the profiler, and so does the import
    src = write_shape(SHAPES["no_number"], str(tmp_path / "one_step"))
    assert import_cli(src, str(tmp_path / "run2")) == 0
    assert "left out" not in capsys.readouterr().out


def test_several_rankless_traces_are_numbered_by_name_with_one_warning(tmp_path, caplog):
    src = write_shape(SHAPES["unranked_pair"], str(tmp_path / "traces"))
    with caplog.at_level("WARNING"):
        assert import_cli(src, str(tmp_path / "run")) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "node-a.json.gz=0, node-b.json.gz=1" in warnings[0]
    meta = read_run_json(str(tmp_path / "run"))
    assert meta["import"]["rank_from"] == {"node-a.json.gz": "file name order",
                                           "node-b.json.gz": "file name order"}  # fmt: skip


def test_mtia_and_hip_events_give_a_breakdown_row(tmp_path):
    for name in ("mtia", "rocm"):
        src = write_shape(SHAPES[name], str(tmp_path / name))
        assert import_cli(src, str(tmp_path / f"run-{name}")) == 0
        breakdown, _ = megascope_views(str(tmp_path / f"run-{name}"))
        assert list(breakdown) == [0] and breakdown[0][3] > 0


def test_collectives_under_annotations_that_end_before_the_kernel(tmp_path):
    """The host annotation (``nccl:all_reduce``) ends long before its kernel runs: the kernel
    is still found by its launch, in the step of the launch, after its issue."""
    src = write_shape(SHAPES["job_id"], str(tmp_path / "traces"))
    out = str(tmp_path / "run")
    assert import_cli(src, out) == 0
    run = open_run(out)
    rows = run.execute("select * from collectives")
    kernels = run.execute("select count(*) as n from spans where kind = 'comm'")["n"][0]
    assert len(rows) == kernels > 0
    assert set(rows["op"]) <= {"all_reduce", "all_gather", "reduce_scatter"}
    assert (rows["issue_ns"] <= rows["start_ns"]).all() and (
        rows["end_ns"] > rows["start_ns"]
    ).all()
    assert set(rows["step"]) <= {10, 11, 12} and sorted(rows["seq"]) == list(
        range(1, len(rows) + 1)
    )
