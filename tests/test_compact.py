"""``megascope compact``: a run rewritten as a few large files per table reads the same.

Every answer is compared before and after: the findings (exact path, and the scale path that
reads the suspect groups' ranks alone through ``Run.restricted``), every view and digest, the
what-if read in batches of ranks, and the dashboard's per-rank queries; on a simulated run
and on a real trainer sample. Then the command's safety: a running run, a bad path, a second
compact, a swap cut short.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers.cli import megascope

from analyzer import compact as compact_cmd
from analyzer.db import open_run
from analyzer.digests import CACHE
from analyzer.findings import analyze
from analyzer.synth import SynthConfig, parse_injections, synthesize
from analyzer.whatif.load import read_times

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples")
MESH = {"dp": 4, "pp": 2, "tp": 8, "cp": 1}  # 64 ranks
VIEWS = (
    "topology", "spans", "collectives", "gpu", "heartbeats", "stacks", "steps",
    "collective_rows", "collective_instances", "group_members", "rank_coords",
    "digest_spans", "digest_collectives", "rank_step_sums", "gpu_breakdown", "comm_overlap",
)  # fmt: skip


def _synth(path, *specs: str, steps: int = 6) -> str:
    cfg = SynthConfig(
        mesh=dict(MESH), steps=steps, microbatches=4, faults=parse_injections(specs, 64), seed=5
    )
    synthesize(cfg, str(path), specs)
    return str(path)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for c in df.columns:  # lists (collective_instances) compare as text
        if df[c].dtype == object:
            df[c] = df[c].map(lambda v: repr(list(v)) if isinstance(v, (list, np.ndarray)) else v)
    cols = list(df.columns)
    return df.sort_values(cols, na_position="last", kind="mergesort").reset_index(drop=True)


def _answers(run_dir: str) -> dict:
    run = open_run(run_dir)
    try:
        out = {"findings": analyze(run), "scaled": analyze(run, exact_max_ranks=8)}
        for view in VIEWS:
            out[view] = _sorted(run.sql(f"select * from {view}"))
        ranks = [3, 11, 19, 27]  # one dp group of stage 0 on the synth mesh
        sub = run.restricted(ranks)
        for view in ("collective_instances", "collectives", "spans"):
            out["restricted_" + view] = _sorted(sub.sql(f"select * from {view}"))
    finally:
        run.close()
    times = read_times(run_dir, batch_ranks=5)  # batches that cut through compacted folders
    out["whatif"] = (times.template_step, times.steps.tolist(), times.t0, times.t1)
    return out


def _assert_same(before: dict, after: dict) -> None:
    assert json.dumps(before["findings"], sort_keys=True, default=str) == json.dumps(
        after["findings"], sort_keys=True, default=str
    )
    assert json.dumps(before["scaled"], sort_keys=True, default=str) == json.dumps(
        after["scaled"], sort_keys=True, default=str
    )
    for key, value in before.items():
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(value, after[key], check_dtype=True, obj=key)
    tb, sb, t0b, t1b = before["whatif"]
    ta, sa, t0a, t1a = after["whatif"]
    assert (tb, sb) == (ta, sa)
    np.testing.assert_array_equal(t0b, t0a)
    np.testing.assert_array_equal(t1b, t1a)


def _parquet_files(run_dir: str) -> list[str]:
    """The tables' parts (not the analyzer's cache of digests, which a sample opened by an
    earlier test holds, and its copies with it)."""
    return sorted(
        os.path.relpath(os.path.join(d, f), run_dir)
        for d, _, fs in os.walk(run_dir)
        for f in fs
        if f.endswith(".parquet") and f != CACHE
    )


def test_a_compacted_synth_run_gives_every_answer_it_gave_before(tmp_path):
    run_dir = _synth(tmp_path / "run", "slow_rank:rank=13,factor=1.3")
    before = _answers(run_dir)
    n_before = len(_parquet_files(run_dir))
    # a small file size, so that each table is cut into several rank ranges
    res = compact_cmd.compact(run_dir, file_mb=0.05)
    files = _parquet_files(run_dir)
    assert n_before >= 4 * 64 and len(files) < n_before / 8
    by_table: dict[str, list[str]] = {}
    for f in files:
        by_table.setdefault(f.split(os.sep)[0], []).append(f)
    assert len(by_table["collectives"]) > 1  # several ranges ...
    spans = []
    # ... that never overlap, each one file sorted by kind of channel, then by rank
    for f in by_table["collectives"]:
        folder = f.split(os.sep)[1]
        assert folder.startswith("ranks=") and f.endswith("part-000000.parquet")
        lo, hi = (int(x) for x in folder[len("ranks=") :].split("-"))
        spans.append((lo, hi))
        rows = pq.read_table(os.path.join(run_dir, f), columns=["group", "rank"]).to_pandas()
        rk = rows["rank"].to_numpy()
        assert rk.min() >= lo and rk.max() <= hi
        kinds = rows["group"].fillna("").to_numpy()
        assert (kinds[1:] >= kinds[:-1]).all() and len(set(kinds)) > 1
        for _, of_kind in rows.groupby(rows["group"].fillna("")):
            assert (np.diff(of_kind["rank"].to_numpy()) >= 0).all()
    spans.sort()
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sum(t.rows for t in res.tables) > 0
    assert not [n for n in os.listdir(run_dir) if n.startswith(".compact")]
    after = _answers(run_dir)
    _assert_same(before, after)
    assert ("straggler", [13]) in [(f["kind"], f["ranks"]) for f in after["findings"]["findings"]]
    # a second compact finds nothing to do
    again = compact_cmd.compact(run_dir, file_mb=0.05)
    assert all(t.skipped for t in again.tables if t.files_before)
    assert _parquet_files(run_dir) == files


@pytest.mark.parametrize("sample", ["slow_rank", "hang"])
def test_a_compacted_trainer_sample_reads_the_same(tmp_path, sample):
    run_dir = str(tmp_path / sample)
    shutil.copytree(os.path.join(SAMPLES, sample), run_dir)
    run = open_run(run_dir)
    try:
        before = {"findings": analyze(run)}
        before.update({v: _sorted(run.sql(f"select * from {v}")) for v in VIEWS})
    finally:
        run.close()
    compact_cmd.compact(run_dir)
    tables = [t for t in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, t))]
    for t in tables:
        if not t.startswith("."):
            assert len(_parquet_files(os.path.join(run_dir, t))) == 1, t
    run = open_run(run_dir)
    try:
        assert json.dumps(before["findings"], sort_keys=True, default=str) == json.dumps(
            analyze(run), sort_keys=True, default=str
        )
        for v in VIEWS:
            pd.testing.assert_frame_equal(before[v], _sorted(run.sql(f"select * from {v}")), obj=v)
    finally:
        run.close()


def test_the_dashboard_reads_a_compacted_run(tmp_path):
    from dashboard import source as dash_source
    from dashboard import views
    from dashboard.source import RunSource

    run_dir = _synth(tmp_path / "run", "slow_rank:rank=13,factor=1.3", steps=4)

    def look() -> tuple:
        src = RunSource(run_dir)
        first, last = views.step_bounds(src)
        values = views.rank_values(src, "compute", first, last)
        spans, colls = views.timeline_rows(src, views.neighbourhood(src, 13), first + 1)
        return (_sorted(values), _sorted(spans), _sorted(colls))

    old = dash_source.DRAW_EXACT_MAX_RANKS
    dash_source.DRAW_EXACT_MAX_RANKS = 8  # the timeline reads through Run.restricted
    try:
        before = look()
        compact_cmd.compact(run_dir, file_mb=0.05)
        after = look()
    finally:
        dash_source.DRAW_EXACT_MAX_RANKS = old
    assert len(before[1]) and len(before[2])
    for b, a in zip(before, after, strict=True):
        pd.testing.assert_frame_equal(b, a)


def test_compact_refuses_a_running_run_and_bad_paths_in_one_line(tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(SAMPLES, "slow_rank"), run_dir)
    with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    meta["status"] = "running"
    with open(os.path.join(run_dir, "run.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    files = _parquet_files(run_dir)
    for args in ([run_dir], [str(tmp_path / "nowhere")], [os.path.join(run_dir, "run.json")],
                 [str(tmp_path)]):  # fmt: skip
        res = megascope("compact", *args)
        assert res.returncode == 2, res.stderr
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("megascope: error:")
    assert "running" in megascope("compact", run_dir).stderr
    assert _parquet_files(run_dir) == files  # untouched
    res = megascope("compact", run_dir, "--force")
    assert res.returncode == 0, res.stderr
    files = _parquet_files(run_dir)
    assert len(files) == 5 and "digests/ranks=00000-00007/part-000000.parquet" in files  # written


def test_compact_refuses_unreadable_parts_and_a_second_compact(tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(SAMPLES, "slow_rank"), run_dir)
    bad = os.path.join(run_dir, "spans", "rank=00002", "part-000099.parquet")
    with open(bad, "wb") as f:
        f.write(b"not parquet")
    with pytest.raises(compact_cmd.CompactError, match="unreadable"):
        compact_cmd.compact(run_dir)
    os.remove(bad)
    with open(os.path.join(run_dir, compact_cmd.LOCK), "w") as f:
        json.dump({"host": "elsewhere", "pid": 1}, f)
    with pytest.raises(compact_cmd.CompactError, match="another compact"):
        compact_cmd.compact(run_dir)
    os.remove(os.path.join(run_dir, compact_cmd.LOCK))
    compact_cmd.compact(run_dir)
    assert len(_parquet_files(run_dir)) == 5  # the four tables and the digests compact writes


def test_a_swap_cut_between_its_renames_is_finished_by_the_next_compact(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(SAMPLES, "slow_rank"), run_dir)
    monkeypatch.setattr(compact_cmd, "_renameat2", lambda: None)  # the two-rename fallback
    real_rename = os.rename
    calls = []

    def crash_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed between moving the old table out and the new in
        real_rename(src, dst)

    monkeypatch.setattr(compact_cmd.os, "rename", crash_on_second)
    monkeypatch.setattr(compact_cmd.shutil, "rmtree", lambda *a, **k: None)  # as a kill would
    with pytest.raises(KeyboardInterrupt):
        compact_cmd.compact(run_dir)
    monkeypatch.undo()
    missing = [t for t in ("topology", "spans", "collectives", "heartbeats")
               if not os.path.isdir(os.path.join(run_dir, t))]  # fmt: skip
    assert len(missing) == 1
    compact_cmd.compact(run_dir)
    assert len(_parquet_files(run_dir)) == 5  # the four tables and the digests compact writes
    assert not [n for n in os.listdir(run_dir) if n.startswith(".compact")]
    run = open_run(run_dir)
    try:
        kinds = [(f["kind"], f["ranks"]) for f in analyze(run)["findings"]]
    finally:
        run.close()
    ref = open_run(os.path.join(SAMPLES, "slow_rank"))
    try:
        assert kinds == [(f["kind"], f["ranks"]) for f in analyze(ref)["findings"]]
    finally:
        ref.close()
