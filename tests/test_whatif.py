"""What-if analysis: the study's ST trace against the study's own numbers, import errors, and
synth runs whose injected fault is known (slow rank, long stage, healthy)."""

from __future__ import annotations

import itertools
import json
import os

import pandas as pd
import pytest
from helpers.cli import megascope
from helpers.report import diagnose

from analyzer.importers.common import TraceError
from analyzer.importers.whatif import import_whatif
from analyzer.synth import Extras, SynthConfig, parse_injections, synthesize
from analyzer.whatif import analyze_whatif, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ST = os.path.join(ROOT, "tests", "data", "whatif", "ST")


def _json(name: str) -> dict:
    with open(os.path.join(ST, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def st_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("st") / "run")
    p = megascope("import", "whatif", f"{ST}/trace-ST.parquet", "--meta", f"{ST}/meta-ST.yaml",
                  "--out", out)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "8 ranks" in p.stdout
    return out


@pytest.fixture(scope="module")
def st_report(st_run) -> dict:
    p = megascope("whatif", st_run, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_st_matches_the_study(st_report):
    study, ms, mw = _json("result-ST.json"), _json("ms-ST.json"), _json("mw-ST.json")
    r = st_report
    for key in ("slowdown", "by_rank", "by_dp_rank", "by_stage", "by_op", "by_step", "m_w", "m_s"):
        assert key in r
    assert close(r["slowdown"], study["blocking_slowdown"])
    for stage, s in study["blocking_decompose_by_stage"].items():
        assert close(r["by_stage"][stage], s), (stage, r["by_stage"])
    for dp, s in study["blocking_decompose_by_dp_rank"].items():
        assert close(r["by_dp_rank"][dp], s)
    assert close(r["m_s"], ms["Ms"])
    assert abs(r["m_w"] - mw["Mw"]) < 0.05  # no individual worker problem
    assert close(r["t_ideal_s"], ms["tideal"], 0.01)
    assert close(r["t_measured_s"], ms["tori"], 0.01)
    assert close(r["by_op"]["forward"], study["blocking_decompose_by_optype"]["forward-compute"])
    # the slowest steps are the study's slowest
    worst = sorted(r["by_step"], key=lambda s: -r["by_step"][s])[:2]
    assert set(worst) == {"23", "25"}
    assert max(r["by_stage"], key=r["by_stage"].get) == "3"


def test_st_text_report(st_run):
    p = megascope("whatif", st_run)
    assert p.returncode == 0, p.stderr
    assert "slowdown S = 1.18" in p.stdout and "M_S (last stage) = 1.2" in p.stdout


def test_import_keeps_ranks_and_coordinates(st_run):
    with open(os.path.join(st_run, "run.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["mesh"] == {"dp": 2, "pp": 4, "tp": 1, "cp": 1}
    assert meta["status"] == "finished" and meta["import"]["recorded_ranks"] == list(range(8))
    trace = pd.read_parquet(f"{ST}/trace-ST.parquet")
    for rank, dp, stage in trace[["rank", "dp_rank", "stage"]].drop_duplicates().itertuples(False):
        assert meta["coords"][rank][:2] == [dp, stage]


def test_one_worker_per_tp_group(tmp_path):
    """A trace of global ranks 0, 2, 4, ... at tp2: the other ranks are unrecorded, not
    crashed, and the what-if is that of the same trace at tp1."""
    trace = pd.read_parquet(f"{ST}/trace-ST.parquet")
    trace["rank"] = (trace["rank"] * 2).astype("int16")
    trace.to_parquet(tmp_path / "t.parquet")
    (tmp_path / "m.yaml").write_text(
        "trial_name: ST2\ndp_size: 2\npp_size: 4\ntp_size: 2\ndsp_size: 1\nvpp_size: 1\n"
        "world_size: 16\n"
    )
    out = str(tmp_path / "run")
    result = import_whatif(str(tmp_path / "t.parquet"), str(tmp_path / "m.yaml"), out)
    assert result.ranks == list(range(0, 16, 2))
    r = analyze_whatif(out)
    assert r["run"]["world_size"] == 16 and r["run"]["ranks"] == 8
    assert close(r["slowdown"], 1.1787)
    p = megascope("analyze", out, "--json")
    assert p.returncode == 0, p.stderr
    kinds = {f["kind"] for f in json.loads(p.stdout)["findings"]}
    assert "crash" not in kinds and "hang" not in kinds


@pytest.mark.parametrize(
    "case, message",
    [
        ("not_parquet", "not a Parquet file"),
        ("missing_column", "missing column"),
        ("bad_sizes", "not world_size"),
    ],
)
def test_import_errors(tmp_path, case, message):
    trace, meta = f"{ST}/trace-ST.parquet", f"{ST}/meta-ST.yaml"
    if case == "not_parquet":
        trace = str(tmp_path / "x.parquet")
        (tmp_path / "x.parquet").write_text("hello")
    elif case == "missing_column":
        trace = str(tmp_path / "x.parquet")
        pd.read_parquet(f"{ST}/trace-ST.parquet").drop(columns=["seq_id"]).to_parquet(trace)
    else:
        meta = str(tmp_path / "m.yaml")
        (tmp_path / "m.yaml").write_text("dp_size: 2\npp_size: 4\ntp_size: 2\nworld_size: 8\n")
    p = megascope("import", "whatif", trace, "--meta", meta, "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(TraceError):
        import_whatif(trace, meta, str(tmp_path / "out2"))


def _synth(path, *specs, mesh, steps=6, extras=None, seed=0, noise=0.02, detail="coarse") -> str:
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    cfg = SynthConfig(mesh=dict(mesh), steps=steps, microbatches=4,
                      faults=parse_injections(specs, world), seed=seed, noise=noise,
                      extras=extras or Extras(), detail=detail)  # fmt: skip
    synthesize(cfg, str(path), specs)
    return str(path)


MESH = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> str:
    return _synth(tmp_path_factory.mktemp("w") / "healthy", mesh=MESH)


def test_slow_rank_saving_matches_the_run_without_it(tmp_path, healthy):
    slow = _synth(tmp_path / "slow", "slow_rank:rank=5,factor=1.4", mesh=MESH)
    r = analyze_whatif(slow)
    base = analyze_whatif(healthy)
    saving = 1 - base["t_measured_s"] / r["t_measured_s"]  # the same run without the fault
    assert abs(r["saving"] - saving) < 0.03, (r["saving"], saving)
    assert r["m_w_ranks"] == [5] and r["m_w"] > 0.8
    assert max(r["by_rank"], key=r["by_rank"].get) == "5"
    assert max(r["by_stage"], key=r["by_stage"].get) == "1"  # rank 5: pp1


def test_healthy_run_is_close_to_ideal(healthy):
    r = analyze_whatif(healthy)
    assert 0.99 < r["slowdown"] < 1.03
    assert r["run"]["steps_left_out"] == []


def test_long_stage_is_the_stage(tmp_path):
    run = _synth(tmp_path / "imb", mesh={"dp": 2, "pp": 4, "tp": 1, "cp": 1},
                 extras=Extras(imbalance=((3, 1.5),)))  # fmt: skip
    r = analyze_whatif(run)
    assert max(r["by_stage"], key=r["by_stage"].get) == "3"
    assert r["m_s"] is not None and r["m_s"] > 0.8
    assert r["m_w"] < r["m_s"]


def test_engine_api_replays_subsets(healthy):
    w = prepare(healthy)
    t_all = w.replay()
    assert (abs(w.replay(keep=w.coords["rank"] >= 0) - t_all) < 1e-6).all()
    assert (w.ideal() <= t_all * 1.001).all()
    assert len(t_all) == len(w.steps) == 6


def test_batched_reader_reads_what_the_whole_run_reader_reads(
    tmp_path, healthy, st_run, monkeypatch
):
    """The batched reader (a few ranks per query) gives the same template, steps and times as
    the whole-run reader (one window over every row), on a synth run with a step left out, and
    when its first batch does not tell the template step (it then reads that step alone)."""
    from analyzer.whatif import load

    hung = _synth(tmp_path / "hang", "hang:rank=3,step=4", mesh=MESH)
    cases = [(healthy, None), (healthy, (1, 4)), (st_run, None), (hung, None)]
    for (run, window), n in itertools.product(cases, (1, 3, 1024, -3)):
        whole = load.read_times(run, window, batch_ranks=0)
        if run == hung:
            assert whole.left_out == [4]
        with monkeypatch.context() as m:
            if n < 0:  # no guess from the first batch: the template step is read alone
                m.setattr(load, "_has_step", lambda *a: False)
            got = load.read_times(run, window, batch_ranks=abs(n))
            assert got.template_step == whole.template_step
            assert got.steps.tolist() == whole.steps.tolist()
            assert got.left_out == whole.left_out
            for name in ("rank", "cls", "label", "grp", "seq", "peer", "nbytes", "t0", "t1"):
                a, b = getattr(got.template, name), getattr(whole.template, name)
                assert a.dtype == b.dtype and (a == b).all(), name
            assert got.t0.dtype == whole.t0.dtype and (got.t0 == whole.t0).all()
            assert (got.t1 == whole.t1).all()


# -- severity is the what-if saving (analyzer.findings.severity.cost) ----------------------------------


def test_st_findings_are_priced_by_the_whatif(st_run):
    """The study's ST: stage 3 is the finding, its severity the study's saving 1 - 1/S; the
    two dp links the detector suspects save nothing and are dismissed, not reported."""
    study = _json("result-ST.json")
    report = diagnose(st_run)
    top, *rest = report["findings"]
    assert (top["kind"], top["ranks"], top["evidence"]["stage"]) == ("stage_imbalance", [6, 7], 3)
    saving = 1 - 1 / study["blocking_slowdown"]
    assert abs(top["severity"] - saving) <= 0.1 * saving, (top["severity"], saving)
    assert all(f["severity"] <= 0.02 for f in rest), rest
    assert report["run"]["severity"]["method"] == "whatif"
    assert {f["kind"] for f in report["dismissed"]} <= {"slow_link"}
    assert all(f["severity"] < 0.01 for f in report["dismissed"])


def test_straggler_severity_is_what_the_run_without_it_saves(tmp_path, healthy):
    slow = _synth(tmp_path / "slow", "slow_rank:rank=5,factor=1.4", mesh=MESH)
    (f,) = diagnose(slow)["findings"]
    assert (f["kind"], f["ranks"]) == ("straggler", [5])
    t_fault = analyze_whatif(slow)["t_measured_s"]
    saving = 1 - analyze_whatif(healthy)["t_measured_s"] / t_fault  # the same run without it
    assert abs(f["severity"] - saving) <= 0.2 * saving, (f["severity"], saving)
    assert f["evidence"]["saving_alone"] == f["severity"]


def test_a_straggler_with_one_peer_is_not_capped_at_the_study_ideal(tmp_path):
    """dp2: the study's typical over two peers is their mean, so its ideal saves about half of
    what removing the straggler does; the severity is the run without it, not that cap."""
    mesh = {"dp": 2, "pp": 1, "tp": 1, "cp": 1}
    slow = _synth(tmp_path / "slow", "slow_rank:rank=1,factor=1.6", mesh=mesh)
    clean = _synth(tmp_path / "clean", mesh=mesh)
    (f,) = diagnose(slow)["findings"]
    assert (f["kind"], f["ranks"]) == ("straggler", [1])
    r = analyze_whatif(slow)
    saving = 1 - analyze_whatif(clean)["t_measured_s"] / r["t_measured_s"]
    assert r["saving"] < 0.7 * saving, (r["saving"], saving)  # the capped value would be off
    assert abs(f["severity"] - saving) <= 0.2 * saving, (f["severity"], saving)


@pytest.mark.parametrize("axis, jitter_cost", [("cp", 0.07), ("dp", 0.0), ("tp", 0.0)])
def test_a_straggler_fixed_keeps_its_own_noise(tmp_path, axis, jitter_cost):
    """Ranks that jitter wait for each other at every collective, with or without a straggler.
    Set to its peers' median, a straggler would lose its jitter with its slowness: with one
    peer and collectives in every layer (context parallel), that wait is several percent of
    the step. The severity is the run without the fault (same seed, same noise), not the run
    without the fault and without the noise."""
    from analyzer.findings.severity.cost import Costs

    mesh = {"dp": 1, "pp": 1, "tp": 1, "cp": 1} | {axis: 2}
    kw = {"mesh": mesh, "steps": 16, "noise": 0.12, "seed": 4, "detail": "fine"}
    slow = _synth(tmp_path / "slow", "slow_rank:rank=1,factor=1.5", **kw)
    clean = _synth(tmp_path / "clean", **kw)
    (f,) = diagnose(slow)["findings"]
    assert (f["kind"], f["ranks"]) == ("straggler", [1])
    saving = 1 - analyze_whatif(clean)["t_measured_s"] / analyze_whatif(slow)["t_measured_s"]
    assert abs(f["severity"] - saving) <= 0.05 * saving, (f["severity"], saving)
    costs = Costs(prepare(slow, typical="study"))
    at_median = costs.saving(costs.ranks_compute([1]), cap=False)
    assert at_median >= saving * (1 + jitter_cost), (at_median, saving)  # the noise removed


@pytest.mark.parametrize(
    "sigma, dp, pp, tp, found",
    [(0.0, 4, 2, 2, False), (0.15, 4, 2, 2, True), (0.15, 8, 1, 1, True)],
)
def test_spread_work_imbalance_is_one_load_imbalance_finding(tmp_path, sigma, dp, pp, tp, found):
    """Compute that varies per step and dp rank (uneven sequence lengths), no fixed culprit:
    one load_imbalance finding worth what replacing every rank's compute by its peers'
    median saves, no straggler, no transient stalls; none on the same run without it."""
    mesh = {"dp": dp, "pp": pp, "tp": tp, "cp": 1}
    run = _synth(tmp_path / "wi", mesh=mesh, steps=16, seed=3, extras=Extras(work_imbalance=sigma))
    report = diagnose(run)
    kinds = [f["kind"] for f in report["findings"]]
    if not found:
        assert kinds == [], report["findings"]
        return
    assert kinds == ["load_imbalance"], report["findings"]
    f = report["findings"][0]
    whatif = analyze_whatif(run, typical="median")
    assert 0.05 <= f["severity"] <= whatif["saving"] + 0.01, (f["severity"], whatif["saving"])
    assert f["evidence"]["m_w"] < 0.5 and f["evidence"]["m_s"] < 0.5
    assert len(f["ranks"]) == dp * pp * tp and len(f["evidence"]["steps_most_affected"]) == 5
    assert f["evidence"]["replica_share"] > 0.9


def test_a_transfer_no_other_stage_shares_is_fixed_per_byte(tmp_path, train):
    """A real dp2 pp2 run: stage 0's gradient sync (embedding) and stage 1's (head) differ in
    size, so fixing a data-parallel link in stage 0 finds no same-size peer for its transfers.
    They are set to the other stage's time per byte, not left at their measured time."""
    import numpy as np

    from analyzer.findings.severity.cost import Costs

    run = str(tmp_path / "run")
    p = train("--dp", "2", "--pp", "2", "--steps", "6", "--out", run)
    assert p.returncode == 0, p.stderr[-2000:]
    costs = Costs(prepare(run, typical="study"))
    mask = costs.link([0, 1], {"dp"})  # rank = pp * 2 + dp: ranks 0 and 1 are stage 0's pair
    rows = np.flatnonzero(mask)
    # transfers whose peer key (same kind, same size) no rank outside the mask has
    lone = rows[~np.isin(costs.peer[rows], costs.peer[~mask])]
    assert len(lone) and (costs.nbytes[lone] > 0).all()
    label = costs.label[lone[0]]
    same = costs.label == label
    # a step in which a lone rank spent no time in that kind of transfer (a gloo transfer can
    # read 0 ns) still gets its bytes at the others' rate, not its zero
    idle = same & (costs.rank == costs.rank[lone[0]])
    costs.w.measured[idle, 1] = 0.0
    fixed = costs.fixed(mask)
    assert not np.allclose(fixed[lone], costs.w.measured[lone])
    # per step, each lone rank's time per byte in that kind of transfer is the other ranks'
    rates = {r: costs.w.measured[same & (costs.rank == r)].sum(0)
             / costs.nbytes[same & (costs.rank == r)].sum()
             for r in np.unique(costs.rank[same & ~mask])}  # fmt: skip
    per_byte = np.median(np.stack(list(rates.values())), axis=0)
    for r in np.unique(costs.rank[lone]):
        mine = same & (costs.rank == r)
        got = fixed[mine].sum(0) / costs.nbytes[mine].sum()
        np.testing.assert_allclose(got, per_byte, rtol=1e-4)


def test_a_stage_holding_a_straggler_is_priced_beyond_it(tmp_path):
    """Stage 1 is 1.3x long and its rank 5 is 1.5x slower still. Each cause's severity is what
    removing it saves in the same run, checked against runs with only the other cause: the
    stage's saving does not count the straggler's a second time."""
    mesh, stage = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}, Extras(imbalance=((1, 1.3),))
    both = _synth(tmp_path / "b", "slow_rank:rank=5,factor=1.5", mesh=mesh, steps=12,
                  extras=stage)  # fmt: skip
    stage_only = _synth(tmp_path / "s", mesh=mesh, steps=12, extras=stage)
    slow_only = _synth(tmp_path / "r", "slow_rank:rank=5,factor=1.5", mesh=mesh, steps=12)
    t = {k: analyze_whatif(r)["t_measured_s"] for k, r in
         (("both", both), ("stage", stage_only), ("slow", slow_only))}  # fmt: skip
    got = {f["kind"]: f for f in diagnose(both)["findings"]}
    assert set(got) == {"straggler", "stage_imbalance"}
    assert got["straggler"]["ranks"] == [5]
    assert got["stage_imbalance"]["evidence"]["beyond"] == [{"kind": "straggler", "ranks": [5]}]
    for kind, without in (("straggler", "stage"), ("stage_imbalance", "slow")):
        saving = 1 - t[without] / t["both"]
        assert abs(got[kind]["severity"] - saving) <= 0.1 * saving, (kind, got[kind], saving)
