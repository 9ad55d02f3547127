"""`megascope export chrome`: valid trace-event JSON with one process per rank, slices that
never partly overlap on a thread, and flows that pair up inside their slices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from analyzer.export.chrome import ExportError, export_chrome
from analyzer.importers.flight_recorder import import_flight_recorder
from analyzer.importers.kineto import import_kineto
from tracer.rundir import read_run_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("export")
    kineto = str(root / "kineto")
    import_kineto(os.path.join(DATA, "kineto", "two_rank_recsys"), kineto)
    fr = str(root / "fr")
    import_flight_recorder(os.path.join(DATA, "flight_recorder", "gpu_error_2nd"), fr)
    return {"kineto": kineto, "fr": fr}


def check_trace(path: str) -> dict:
    """Parse and validate a trace file; returns a few facts for the caller's assertions."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    procs, slices, flows = {}, defaultdict(list), defaultdict(list)
    for ev in events:
        assert ev["ph"] in {"M", "X", "s", "f"}, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        if ev["ph"] == "M":
            assert ev["name"] in {"process_name", "process_sort_index", "thread_name",
                                  "thread_sort_index"} and isinstance(ev["args"], dict)  # fmt: skip
            if ev["name"] == "process_name":
                assert ev["pid"] not in procs
                procs[ev["pid"]] = ev["args"]["name"]
        elif ev["ph"] == "X":
            assert isinstance(ev["name"], str) and ev["name"]
            assert ev["ts"] >= 0 and ev["dur"] >= 0 and isinstance(ev["args"], dict)
            slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
        else:
            flows[ev["id"]].append(ev)
    for lane in slices.values():  # no partial overlap on one thread
        lane.sort()
        for (_, end), (start, _) in zip(lane, lane[1:], strict=False):
            assert start >= end - 1e-3
    for fid, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], fid
        for e in pair:  # each end lies inside a slice of its own thread
            assert any(a - 1e-3 <= e["ts"] <= b + 1e-3 for a, b in slices[(e["pid"], e["tid"])])
        assert next(e for e in pair if e["ph"] == "f")["bp"] == "e"
    return {"procs": procs, "flows": len(flows), "slices": sum(map(len, slices.values())),
            "other": doc["otherData"]}  # fmt: skip


def test_flight_recorder_run_exports(runs, tmp_path):
    out = str(tmp_path / "fr.json")
    stats = export_chrome(runs["fr"], out)
    facts = check_trace(out)
    assert sorted(facts["procs"]) == list(range(16))
    assert facts["procs"][9] == "rank 9 (dp0 pp1 tp1)"
    assert facts["slices"] == stats["collectives"] == 278
    assert facts["flows"] == stats["flows"] > 0
    with open(out) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert "all_gather tp (incomplete)" in names
    assert facts["other"]["status"] == "hung"


def test_kineto_run_exports_with_lanes_and_flows(runs, tmp_path):
    out = str(tmp_path / "k.json")
    stats = export_chrome(runs["kineto"], out)
    facts = check_trace(out)
    assert sorted(facts["procs"]) == [0, 1]
    assert stats["spans"] == 2362 and stats["collectives"] == 20
    # the ten collectives of rank 0 pair with rank 1's by seq: one arrow each
    assert facts["flows"] == 10
    meta = read_run_json(runs["kineto"])
    assert facts["other"]["run_id"] == meta["run_id"]


def test_cli_export_and_errors(runs, tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, "-m", "analyzer", "export", "chrome", runs["fr"], "--out", str(out)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0 and "wrote" in proc.stdout and out.is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "analyzer", "export", "chrome", str(tmp_path / "nope"), "--out",
         str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("megascope: error:") and "nope" in line and "\n" not in line
    with pytest.raises(ExportError):
        export_chrome(str(tmp_path / "nope"), str(tmp_path / "y.json"))
