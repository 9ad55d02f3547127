"""The CI gate of ``megascope compare --fail-above PCT`` (analyzer/compare_gate.py).

Synth runs of one mesh, read once and compared in this process (the CLI for the baseline form
and bad input): twins whose steps drift between their halves pass though B's median is above
PCT; a 10% and a 25% slowdown of every rank, and a 1.5x rank, fail at --fail-above 5; a rank
slow in only the later steps of B (half of them, and fewer than half: its median hardly moves)
fails on the evidence of the straggler that appeared in B. Synth runs and the bootstrap are
deterministic: exact answers, no timing of this machine. The gate's own arithmetic is checked
on constructed series.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from helpers import cli
from helpers.synth import synth_run

from analyzer.compare import (
    CPU_STAGE_GROWTH,
    compare_sides,
    evidence,
    evidence_severity,
    read_side,
)
from analyzer.compare_gate import DRIFT_PRIOR, as_json, decide, drift, grown, halves, line, price
from analyzer.db import open_run
from analyzer.synth.config import Extras, HwClassRange

MESH = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
STEPS = 16


def speed(factor: float) -> tuple[HwClassRange, ...]:
    """Every rank's compute ``factor`` times as long: a slower build, no rank singled out."""
    return (HwClassRange("x", 0, 7, factor),)


RUNS = {
    "a": ((), {"seed": 1}),
    "twin": ((), {"seed": 2}),
    "a3": ((), {"seed": 3}),
    # twins that drift up 20% over the run; B of them 6% slower all along (another machine)
    "drift_a": ((), {"seed": 1, "extras": Extras(regression=1.2)}),
    "drift_b": ((), {"seed": 2, "extras": Extras(regression=1.2), "hw_classes": speed(1.06)}),
    "slow10": ((), {"seed": 2, "hw_classes": speed(1.13)}),
    "slow25": ((), {"seed": 2, "hw_classes": speed(1.3)}),
    "rank": (("slow_rank:rank=5,factor=1.5",), {"seed": 2}),
    "half": (("slow_rank:rank=5,factor=1.5,step=9",), {"seed": 2}),  # 7 of B's 14 steps
    "late": (("slow_rank:rank=5,factor=1.5,step=10",), {"seed": 2}),  # 6 of 14
    "rank2": (("slow_rank:rank=5,factor=2",), {"seed": 3}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    return {name: synth_run(str(root / name), *specs, mesh=MESH, steps=STEPS, **kw)
            for name, (specs, kw) in RUNS.items()}  # fmt: skip


@pytest.fixture(scope="module")
def sides(runs):
    out = {}
    for name, path in runs.items():
        db = open_run(path)
        try:
            out[name] = read_side(db, whatif=False)
        finally:
            db.close()
    return out


def gate(sides, a, b):
    refs = [sides[x] for x in a] if isinstance(a, list) else sides[a]
    return compare_sides(refs, sides[b], fail_above=5)["fail_above"]


def test_healthy_twins_pass(sides):
    g = gate(sides, "a", "twin")
    assert g["failed"] is False and g["evidence"] == []
    assert g["reason"].endswith("not above the limit (exit 0)")


def test_twins_that_drift_between_halves_pass_though_b_is_above_pct(sides):
    g = gate(sides, "drift_a", "drift_b")
    assert g["change_pct"] > 5  # the steps alone would call this a slowdown
    assert g["low_ms"] > 0 or g["drift_sd_ms"] > g["steps_sd_ms"]
    assert g["drift_from"] == "A's halves" and g["drift_pct"] > 5
    assert g["low_ms"] < 0 and g["failed"] is False
    assert g["reason"].endswith("above the limit but within the noise (exit 0)")


@pytest.mark.parametrize("b", ["slow10", "slow25", "rank"])
def test_a_slowdown_fails_at_fail_above_5(sides, b):
    g = gate(sides, "a", b)
    assert g["change_pct"] > (8 if b == "slow10" else 20)
    assert g["failed"] is True and g["low_ms"] > 0
    assert g["reason"].endswith("(exit 1)")
    assert g["evidence"] == ([5] if b == "rank" else [])


@pytest.mark.parametrize("b", ["half", "late"])
def test_a_rank_slow_in_the_later_steps_only_fails(sides, b):
    g = gate(sides, "a", b)
    assert g["evidence"] == [5]  # the straggler that appeared in B
    assert g["mean_change_pct"] > 5 and g["failed"] is True
    assert "rank 5 slower in B than in A" in g["reason"]
    if b == "late":  # slow in fewer than half of B's steps: the median hardly moves
        assert g["change_pct"] < 5


def test_baseline_runs_form(runs):
    out = cli.megascope("compare", runs["a"], runs["twin"], runs["a3"], "--", runs["late"],
                        "--fail-above", "5", "--no-whatif", "--json")  # fmt: skip
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["a"]["runs"] == [runs["a"], runs["twin"], runs["a3"]]
    assert report["fail_above"]["failed"] is True and report["fail_above"]["evidence"] == [5]
    assert report["fail_above"]["drift_prior_pct"] == 3.0
    ok = cli.megascope("compare", runs["a"], runs["a3"], "--", runs["twin"],
                       "--fail-above", "5", "--no-whatif")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "from the baselines'" in ok.stdout and ok.stdout.endswith("(exit 0)\n")


def test_a_finding_of_one_baseline_in_three_is_that_runs_own(sides):
    # one baseline of three had rank 5 slow (a healthy run on shared cores names a straggler
    # now and then): not the configuration's, so B naming rank 5 is still evidence
    g = gate(sides, ["a", "rank", "twin"], "late")
    assert g["evidence"] == [5] and g["failed"] is True, g["reason"]
    # two of three name it: A's, and B naming it changes nothing
    g = gate(sides, ["rank", "half", "a"], "late")
    assert g["evidence"] == [], g["reason"]


@pytest.mark.parametrize(
    "args",
    [
        ["A", "B", "--"],
        ["A", "--", "--json"],
        ["--", "B"],
        ["A", "B", "B"],
        ["A", "--", "B", "B"],
        ["A", "B", "--fail-above", "5", "--drift", "-1"],
    ],
    ids=[
        "nothing-after",
        "option-after",
        "nothing-before",
        "three-without-dashes",
        "two-after",
        "negative-drift",
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs, args):
    names = {"A": runs["a"], "B": runs["twin"]}
    proc = cli.megascope("compare", *[names.get(a, a) for a in args])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "error" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_evidence_is_a_culprit_that_appeared_on_a_rank_whose_own_work_grew():
    appeared = [{"kind": "stage_imbalance", "ranks": [1]}, {"kind": "straggler", "ranks": [3, 4]}]
    ranks = [{"rank": r, "own": {"diff_ms": d}} for r, d in ((1, 5.0), (3, 4.0), (4, -1.0))]
    # a stage that computes longer than the others is no evidence B changed; rank 4 sped up
    assert evidence({"findings": {"appeared": appeared}, "ranks": ranks}) == [3]


def test_the_evidence_is_priced_by_its_largest_severity_on_the_ranks_it_names():
    appeared = [{"kind": "straggler", "ranks": [3], "severity": 0.15},
                {"kind": "data_stall", "ranks": [5], "severity": 0.4},
                {"kind": "stage_imbalance", "ranks": [3], "severity": 0.6}]  # fmt: skip
    report = {"findings": {"appeared": appeared}}
    assert evidence_severity(report, [3]) == 0.15  # rank 5 is no evidence; no culprit's kind
    assert np.isnan(evidence_severity(report, []))
    # a culprit saving 20% of B's step stands for B 25% over a run without it
    assert price(0.2, 100.0) == pytest.approx(25.0)
    assert price(0.999, 100.0) == pytest.approx(1900.0) and np.isnan(price(float("nan"), 100.0))


def test_a_culprit_both_runs_name_is_evidence_where_its_price_grew_by_more_than_pct():
    # a healthy reference on shared cores named rank 1 (severity 0.09); B names it at 0.25
    def report(a_severity, severity=0.25):
        kept = [{"kind": "straggler", "ranks": [1], "severity": severity, "a_severity": a_severity}]
        ranks = [{"rank": 1, "own": {"diff_ms": 5.0}}]
        return {"findings": {"appeared": [], "kept": kept}, "ranks": ranks}

    assert evidence(report(0.09), 5) == [1]
    # priced at what it costs B more than A: 0.25 stands for +33.3%, 0.09 for +9.9%
    s = evidence_severity(report(0.09), [1], 5)
    assert s == grown(0.09, 0.25) and price(s, 100.0) == pytest.approx(100 / 3 - 900 / 91)
    assert evidence(report(0.09), 30) == []  # grew by 23.4%, not 30%
    assert evidence(report(0.24), 5) == []  # about A's: the reference's own, not a change
    assert evidence(report(0.09)) == [] and grown(0.3, 0.25) == 0.0  # no PCT; it shrank


def test_a_straggler_the_reference_names_too_is_priced_by_its_growth(sides):
    # A: rank 5 at 1.5x (named); B: at 2x, named too
    (a,), (b,) = sides["rank"].report["findings"], sides["rank2"].report["findings"]
    assert (a["kind"], a["ranks"]) == (b["kind"], b["ranks"]) == ("straggler", [5])
    g = gate(sides, "rank", "rank2")
    assert g["evidence"] == [5] and g["failed"] is True, g["reason"]
    assert "rank 5 slower in B than in A" in g["reason"]
    grew = price(b["severity"], 100.0) - price(a["severity"], 100.0)
    assert g["price_pct"] == pytest.approx(grew, abs=0.1) and grew > 5


def test_on_a_cpu_device_a_slower_wall_time_with_the_same_work_is_the_hosts():
    rng = np.random.default_rng(7)
    a = 100 + rng.normal(0, 1, 30)
    work = 60 + rng.normal(0, 1, 30)  # the ranks' CPU time a step
    slower = a[::-1] * 1.2  # 20% slower in wall time, beyond any noise
    assert decide([a], slower, 5, []).failed  # a GPU run: no CPU time counted
    g = decide([a], slower, 5, [], work=([work], work[::-1] * 1.003))
    assert not g.failed and g.host_minute and g.low_ns > g.limit_ns
    assert "CPU time a step (+0.3%) did not grow beyond its noise: the host ran them less" in (
        line(g)
    )
    assert as_json(g)["work_change_pct"] == pytest.approx(0.3, abs=0.1)
    # the ranks worked longer: a regression of the code
    g = decide([a], slower, 5, [], work=([work], work[::-1] * 1.12))
    assert g.failed and not g.host_minute and as_json(g)["work_low_pct"] > 0
    # a culprit named in B fails on its own evidence, whatever the work
    assert decide([a], slower, 5, [3], severity=0.1, work=([work], work[::-1])).failed


def test_a_priced_culprit_fails_where_the_machine_made_b_read_faster():
    rng = np.random.default_rng(5)
    a = 100 + rng.normal(0, 1, 30)
    faster = a[::-1] * 0.9  # the run-to-run drift hid the slowdown: B's median reads 10% less
    g = decide([a], faster, 5, [3], severity=0.15)  # rank 3 named in B alone, priced 17.6%
    assert g.failed and g.judged_ns == g.price_ns and g.change_ns < 0
    assert "its price +17.6%" in line(g) and as_json(g)["price_pct"] == pytest.approx(17.6, abs=0.1)
    assert not decide([a], faster, 5, [3], severity=0.04).failed  # a culprit worth 4.2%
    assert not decide([a], faster, 5, [], severity=0.15).failed  # no evidence: no price
    assert np.isnan(decide([a], faster, 5, [], severity=0.15).price_ns)


def test_drift_from_the_prior_the_halves_and_the_baselines():
    flat = np.full(20, 100.0)
    step = np.r_[np.full(10, 100.0), np.full(10, 110.0)]
    assert halves(step) == 10.0 and halves(np.ones(3)) != halves(np.ones(3))  # NaN under 4
    # one run: the prior (3% of its median, each of A and B with its own level: sqrt 2)
    assert drift([flat]) == (pytest.approx(3 * np.sqrt(2)), "the prior")
    assert drift([flat], prior_pct=1) == (pytest.approx(np.sqrt(2)), "the prior")
    # ...unless the run drifts within itself by more: a floor
    assert drift([step]) == (10.0, "A's halves")
    assert drift([flat, step], prior_pct=0) == (pytest.approx(np.sqrt(50)), "the baselines' halves")
    # baselines: their medians' spread pooled with the prior (4 runs' worth against k - 1)
    d, where = drift([flat, flat + 20, flat + 40], prior_pct=0)  # medians 100, 120, 140
    assert where == "the baselines' medians" and d == pytest.approx(20 * np.sqrt(4 / 3))
    d, _ = drift([flat, flat + 20, flat + 40])  # the prior: 3% of the pooled median, 120
    assert d == pytest.approx(np.sqrt((4 * 3.6**2 + 2 * 20**2) / 6 * (4 / 3)))
    many = [flat + x for x in (0, 1, -1, 0.5, -0.5, 0, 1, -1, 0.5, -0.5, 0, 0.2)]
    assert drift(many)[0] < drift(many[:2])[0] < 3 * np.sqrt(2)  # quiet baselines outweigh it


def test_decide_on_constructed_series():
    rng = np.random.default_rng(3)
    a = 100 + rng.normal(0, 1, 30)
    # 12% slower, A steady: fails; 8% passes within the prior's 3% a run (+/-8.3% for two),
    # and fails where the runs are known to agree (--drift 0.5)
    assert decide([a], a[::-1] * 1.12, 5, []).failed
    g = decide([a], a[::-1] * 1.08, 5, [])
    assert not g.failed and g.change_ns > g.limit_ns and g.drift_from == "the prior"
    assert decide([a], a[::-1] * 1.08, 5, [], prior_pct=0.5).failed
    # 12% slower against an A whose halves differ by 20: passes
    drifting = a + np.r_[np.zeros(15), np.full(15, 20.0)]
    g = decide([drifting], drifting * 1.12, 5, [])
    assert not g.failed and g.change_ns > g.limit_ns and g.low_ns < 0
    assert g.drift_from == "A's halves"
    # B slow by 40% in its last 10 of 30 steps: the median moves by nothing, the mean by 13%
    part = a.copy()
    part[-10:] *= 1.4
    assert not decide([a], part, 5, []).failed
    g = decide([a], part, 5, [3])
    assert (
        g.failed and g.judged_ns == g.mean_change_ns and "rank 3 slower in B than in A" in line(g)
    )
    assert not decide([a], part, 20, [3]).failed  # evidence still asks the size


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Two-stage pipelines of one rank a stage: stage 1 computing 1.3x in B on a machine a
    quarter faster (B's median reads no slower), and in both of two twins (a last stage that
    always computes longer)."""
    root = tmp_path_factory.mktemp("stages")
    mesh = {"dp": 1, "pp": 2, "tp": 1, "cp": 1}
    heavy = Extras(imbalance=((1, 1.3),))
    faster = (HwClassRange("x", 0, 1, 0.75),)
    specs = {
        "a": {"seed": 1},
        "b": {"seed": 2, "extras": heavy, "hw_classes": faster},
        "heavy_a": {"seed": 1, "extras": heavy},
        "heavy_b": {"seed": 2, "extras": heavy},
    }
    out = {}
    for name, kw in specs.items():
        db = open_run(synth_run(str(root / name), mesh=mesh, steps=STEPS, **kw))
        try:
            out[name] = read_side(db, whatif=False)
        finally:
            db.close()
    return out


def test_a_stage_grown_against_the_others_is_evidence_whatever_the_machine(stages):
    # one rank a stage: no straggler can name stage 1's rank (no peer does its work); its
    # share of the step, read within each run, grew 1.3x while the machine hid the median
    g = compare_sides(stages["a"], stages["b"], fail_above=5)["fail_above"]
    assert g["evidence"] == [1] and g["failed"], g["reason"]
    assert g["change_pct"] < 5 < g["price_pct"]
    assert stages["b"].stages.ratio[1] / stages["a"].stages.ratio[1] == pytest.approx(1.3, rel=0.05)
    assert stages["b"].stages.cpu_ratio.isna().all()  # a GPU run: its threads' CPU time is not work
    # a stage that computes longer in both runs did not change: named, but no evidence
    g = compare_sides(stages["heavy_a"], stages["heavy_b"], fail_above=5)["fail_above"]
    assert [f["kind"] for f in stages["heavy_b"].report["findings"]] == ["stage_imbalance"]
    assert g["evidence"] == [] and not g["failed"], g["reason"]


def test_a_stage_is_read_in_cpu_time_where_both_runs_counted_it(stages):
    # the runs as if on a CPU device that counted its threads' CPU time: there the stage's
    # ratio in CPU time decides, at its own margin, unless its wall time grew more (it waited)
    def with_cpu(side, cpu):
        return replace(side, stages=side.stages.assign(cpu_ratio=cpu))

    def saved(g):  # the share of B's step: price_pct is s / (1 - s) of A's median
        return g["price_pct"] / (100 + g["price_pct"])

    # stage 1 computes longer in both twins, at one ratio in wall time
    ha, hb = stages["heavy_a"], stages["heavy_b"]
    assert hb.stages.ratio[1] / ha.stages.ratio[1] == pytest.approx(1.0, abs=0.03)
    even = compare_sides(with_cpu(ha, 1.2), with_cpu(hb, 1.2 * 1.02), fail_above=5)["fail_above"]
    assert even["evidence"] == [], even["reason"]
    grown = 1 + CPU_STAGE_GROWTH + 0.01  # within the wall margin, past the CPU one
    report = compare_sides(with_cpu(ha, 1.2), with_cpu(hb, 1.2 * grown), fail_above=5)
    got = report["fail_above"]
    assert got["evidence"] == [1], got["reason"]
    # priced at what undoing a 6% growth of its compute saves of B's step
    (f,) = hb.report["findings"]
    share = f["evidence"]["compute_ms_per_step"] * (1 - 1 / grown) / report["step"]["b_ms"]
    assert saved(got) == pytest.approx(share, rel=0.01)
    # stage 1 of B computing 1.3x in wall time with its CPU time even: it waited (slept, or a
    # slower device or disk), read in wall time as on a GPU
    a, b = stages["a"], stages["b"]
    walled = compare_sides(a, b, fail_above=5)["fail_above"]
    waited = compare_sides(with_cpu(a, 1.2), with_cpu(b, 1.2 * 1.02), fail_above=5)["fail_above"]
    assert waited["evidence"] == [1], waited["reason"]
    assert saved(waited) == pytest.approx(saved(walled))
    # one run without CPU time: both read in wall time
    half = compare_sides(a, with_cpu(b, 1.2), fail_above=5)["fail_above"]
    assert half["evidence"] == [1], half["reason"]


def test_the_drift_flag_says_the_default_the_gate_assumes():
    # the command's help names the prior in text (compare_gate would load numpy at every start)
    from analyzer.commands.compare import build_parser

    assert f"default: {DRIFT_PRIOR:g}," in " ".join(build_parser().format_help().split())
