"""`megascope export chrome`: valid trace-event JSON with one process per rank, slices that
never partly overlap on a thread, and flows that pair up inside their slices."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
from helpers.cli import megascope

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
    proc = megascope("export", "chrome", runs["fr"], "--out", str(out))
    assert proc.returncode == 0 and "wrote" in proc.stdout and out.is_file()
    proc = megascope("export", "chrome", str(tmp_path / "nope"), "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("megascope: error:") and "nope" in line and "\n" not in line
    with pytest.raises(ExportError):
        export_chrome(str(tmp_path / "nope"), str(tmp_path / "y.json"))


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> str:
    from analyzer.synth import SynthConfig, parse_injections, synthesize

    out = str(tmp_path_factory.mktemp("export") / "slow5")
    specs = ("slow_rank:rank=5,factor=1.4",)
    cfg = SynthConfig(mesh={"dp": 2, "pp": 2, "tp": 2, "cp": 1}, steps=6, microbatches=4,
                      faults=parse_injections(specs, 8), seed=0, detail="coarse")  # fmt: skip
    synthesize(cfg, out, specs)
    return out


def _by_step(events: list[dict], pids: set[int]) -> dict[int, tuple[float, float]]:
    """step -> (first start, last end) of the slices of ``pids`` (microseconds)."""
    out: dict[int, tuple[float, float]] = {}
    for e in events:
        if e["ph"] == "X" and e["pid"] in pids and e["args"].get("step") is not None:
            lo, hi = out.get(e["args"]["step"], (float("inf"), float("-inf")))
            out[e["args"]["step"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    return out


def test_ideal_replay_is_exported_beside_the_measured_timeline(slow_run, tmp_path):
    from analyzer.whatif import analyze_whatif

    out = str(tmp_path / "ideal.json")
    stats = export_chrome(slow_run, out, ideal=True)
    facts = check_trace(out)  # valid trace events, no partial overlap on any thread
    with open(out) as f:
        events = json.load(f)["traceEvents"]
    offset = facts["other"]["ideal"]["pid_offset"]
    assert offset == 10
    for r in range(8):
        assert facts["procs"][r].startswith(f"rank {r} (")
        assert facts["procs"][offset + r] == f"rank {r} (ideal)"
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort[5] == 10 and sort[offset + 5] == 11  # each rank's ideal right after it
    ideal = [e for e in events if e["ph"] == "X" and e["pid"] >= offset]
    assert len(ideal) == stats["ideal"] > 0 and {e["cat"] for e in ideal} == {"ideal"}
    threads = {
        e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] >= offset
    }
    assert {"ideal compute", "ideal collectives"} <= threads
    names = {e["name"] for e in ideal}
    assert {"forward", "backward", "send pp", "recv pp"} <= names and any("tp" in n for n in names)
    assert all(e["dur"] > 0 for e in ideal if e["tid"] < 4001)  # no empty compute pieces

    def forward(rank: int) -> float:  # measured over ideal forward time of a rank
        args = [e["args"] for e in ideal if e["pid"] == offset + rank and e["name"] == "forward"]
        return sum(a["measured_ms"] for a in args) / sum(a["ideal_ms"] for a in args)

    # the slow rank's forward is measured 1.4x as long as a healthy rank's (the ideal is
    # the mean over all ranks, the slow one included: a healthy rank is a little under it)
    assert 0.9 < forward(1) <= 1.0 and forward(5) > 1.3 * forward(1)
    # every step replayed: the ideal step starts with the measured one and ends earlier
    measured = _by_step(events, set(range(8)))
    replayed = _by_step(events, {offset + r for r in range(8)})
    assert sorted(replayed) == facts["other"]["ideal"]["steps"] == list(range(6))
    for step, (lo, hi) in replayed.items():
        m_lo, m_hi = measured[step]
        assert m_lo - 1e-3 <= lo and hi <= m_hi, (step, lo, hi, m_lo, m_hi)
        assert (hi - lo) < 0.9 * (m_hi - m_lo)  # rank 5 computes 1.4x slower
    report = analyze_whatif(slow_run)
    assert facts["other"]["ideal"]["slowdown"] == pytest.approx(report["slowdown"], rel=1e-4)
    plain = str(tmp_path / "plain.json")
    export_chrome(slow_run, plain)
    assert max(check_trace(plain)["procs"]) == 7  # no ideal without --ideal


def test_cli_ideal_and_a_run_without_a_replay(slow_run, runs, tmp_path):
    out = tmp_path / "i.json"
    cmd = ["export", "chrome"]
    proc = megascope(*cmd, slow_run, "--out", str(out), "--ideal")
    assert proc.returncode == 0, proc.stderr
    assert "ideal slices" in proc.stdout and out.is_file()
    # a hung Flight Recorder run: no collective finished in its steps, nothing to replay
    bad = tmp_path / "fr.json"
    proc = megascope(*cmd, runs["fr"], "--out", str(bad), "--ideal")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("megascope: error:") and "no ideal replay" in line and "\n" not in line
    assert not bad.exists() and not list(tmp_path.glob("fr.json*"))
