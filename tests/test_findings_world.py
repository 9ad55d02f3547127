"""The detectors on hand-made run directories (tests/helpers/world.py, a small cluster
model) and on an imported Flight Recorder set with known culprits."""

from __future__ import annotations

import json
import os

import pytest
from helpers.world import World, write_world

from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.render.findings import render_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON = os.path.join(REPO, "tests", "data", "flight_recorder", "gpu_error_2nd")


def report_of(tmp_path, world: World) -> dict:
    write_world(world, str(tmp_path))
    return analyze(open_run(tmp_path))


def kinds(report: dict) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for f in report["findings"]:
        out.setdefault(f["kind"], []).append(f["ranks"])
    return out


def test_report_has_the_spec_shape(tmp_path):
    report = report_of(tmp_path, World(slow_rank={3: 1.3}, seed=1))
    assert report["schema"] == "megascope.findings/1"
    assert set(report) == {"schema", "run", "findings", "dismissed", "notes"}
    assert set(report["run"]) == {
        "world_size", "mesh", "steps", "median_step_ms", "mfu", "severity"
    }  # fmt: skip
    assert report["run"]["severity"]["method"] == "whatif"
    assert report["run"]["mesh"] == {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
    assert report["run"]["steps"] == [2, 11]
    (f,) = report["findings"]
    assert set(f) == {
        "kind",
        "ranks",
        "coords",
        "hosts",
        "severity",
        "steps",
        "evidence",
        "message",
    }
    assert f["kind"] == "straggler" and f["ranks"] == [3] and f["hosts"] == ["node0"]
    assert f["message"].startswith("rank 3 (dp1 pp0 tp1, node0) computes 1.")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_healthy_world_raises_nothing(tmp_path, seed):
    report = report_of(tmp_path, World(seed=seed, noise=0.1, steps=16))
    assert report["findings"] == []


def test_hang_blames_the_root_not_the_ranks_stuck_behind_it(tmp_path):
    # rank 6 stops at step 5: its tp peer, its dp peer and the stage feeding it all wait;
    # the other replica's stage 1 then waits in dp for ranks that are themselves waiting
    report = report_of(tmp_path, World(hang=(6, 5), seed=2))
    assert kinds(report) == {"hang": [[6]]}
    ev = report["findings"][0]["evidence"]
    assert set(ev["waiting_ranks"]) >= {2, 4, 7}
    assert ev["stacks"]["6"].startswith("train_step")


def test_crash_in_a_failed_run(tmp_path):
    report = report_of(tmp_path, World(crash=(3, 6), seed=3))
    assert kinds(report) == {"crash": [[3]]}
    assert report["findings"][0]["evidence"]["status"] == "failed"


def test_each_kind_on_the_world(tmp_path_factory):
    cases = [
        (World(slow_link=(1, 5, 6.0), seed=4), {"slow_link": [[1, 5]]}),  # 3x saves <1%
        (World(pause=(2, 3, 40.0), seed=5), {"transient_stall": [[2]]}),
        (World(slow_data=(4, 30.0), seed=6), {"data_stall": [[4]]}),
        (World(stage_factor={0: 1.3}, seed=7), {"stage_imbalance": [[0, 1, 2, 3]]}),
        (World(drift=0.03, steps=20, seed=8), {"regression": [[]]}),
        (World(throttle={7: 1400}, seed=9), {"throttle": [[7]]}),
    ]
    for world, expected in cases:
        report = report_of(tmp_path_factory.mktemp("w"), world)
        assert kinds(report) == expected, [f["message"] for f in report["findings"]]


def test_throttle_decodes_its_reasons_and_a_capped_job_is_one_note(tmp_path_factory):
    """A hot GPU: a finding naming the rank, its reason (thermal) and the clock it lost. Every
    GPU power-capped in most samples (one H100 at its 700 W cap did so in 204 of 332): no rank
    is slower than its peers, so no finding, and one note for the run with the cap decoded."""
    report = report_of(tmp_path_factory.mktemp("w"), World(throttle={7: 1400}, seed=9))
    (f,) = [f for f in report["findings"] if f["kind"] == "throttle"]
    assert f["ranks"] == [7] and f["evidence"]["reasons"] == {"thermal": 1.0}
    assert f["evidence"]["clock_lost_mhz"] == 580 and "thermal 100%" in f["message"]
    assert report["notes"] == []
    report = report_of(tmp_path_factory.mktemp("w"), World(capped=0.6, seed=12))
    assert not [f for f in report["findings"] if f["kind"] == "throttle"], report["findings"]
    (n,) = report["notes"]
    assert n["kind"] == "throttle" and n["evidence"]["reasons"] == {"power cap": 0.6}
    assert n["evidence"]["ranks_throttled"] == n["evidence"]["ranks"] == 8
    assert "power cap 60%" in n["message"] and "1980 MHz at best" in n["message"]
    text = render_text(report)
    assert "note: every GPU throttles" in text


def test_flight_recorder_hang_names_exactly_the_two_missing_ranks(tmp_path):
    from analyzer.importers.flight_recorder import import_flight_recorder

    out = str(tmp_path / "fr")
    import_flight_recorder(MEGATRON, out)
    report = analyze(open_run(out))
    assert kinds(report) == {"hang": [[9, 14]]}
    ev = report["findings"][0]["evidence"]
    assert not {9, 14} & set(ev["waiting_ranks"]) and ev["op"] and ev["group"]


def test_steps_window_restricts_the_statistics(tmp_path):
    write_world(World(slow_rank={5: 1.5}, steps=12, seed=10), str(tmp_path))
    run = open_run(tmp_path)
    full = analyze(run)
    part = analyze(run, steps=(3, 6))
    assert part["run"]["steps"] == [3, 6]
    assert part["findings"][0]["evidence"]["steps_compared"] == 4
    assert full["findings"][0]["evidence"]["steps_compared"] == 10


def test_transient_stalls_of_a_straggler_are_explained_away(tmp_path):
    # a rank's pauses alone are transient stalls; the same pauses of a straggler are part of
    # its lateness, which the straggler finding already explains
    kinds = []
    for i, world in enumerate(
        (World(pause=(1, 4, 80.0)), World(slow_rank={1: 1.5}, pause=(1, 4, 80.0)))
    ):
        write_world(world, str(tmp_path / str(i)))
        report = analyze(open_run(tmp_path / str(i)))
        kinds.append([(f["kind"], f["ranks"]) for f in report["findings"]])
    assert ("transient_stall", [1]) in kinds[0]
    assert ("straggler", [1]) in kinds[1] and ("transient_stall", [1]) not in kinds[1]


# cores shared by ranks: step times carry the scheduling's noise (a rank's time outside its
# waits cannot tell a 1.3x rank from its peers), the CPU time of each span the work alone
SHARED = {"dp": 4, "pp": 1, "tp": 2, "steps": 16, "noise": 0.8, "cpu_noise": 0.05}


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_cpu_time_names_a_slow_rank_that_step_times_blur(tmp_path, seed):
    assert kinds(report_of(tmp_path / "wall", World(**{**SHARED, "cpu_noise": None},
                                                    slow_rank={5: 1.3}, seed=seed))) == {}  # fmt: skip
    report = report_of(tmp_path / "cpu", World(**SHARED, slow_rank={5: 1.3}, seed=seed))
    (f,) = report["findings"]
    assert f["kind"] == "straggler" and f["ranks"] == [5], f
    ev = f["evidence"]
    assert ev["signal"] == "cpu_time" and ev["cpu_steps"] == 14
    assert ev["work_ratio"] == ev["cpu_ratio"] == pytest.approx(1.3, abs=0.05)
    assert f"CPU time in a step is {ev['cpu_ratio']:.2f}x theirs" in f["message"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_cpu_time_raises_nothing_on_a_healthy_run_of_shared_cores(tmp_path, seed):
    assert report_of(tmp_path, World(**SHARED, seed=seed))["findings"] == []


def test_a_slow_rank_that_sleeps_is_named_by_its_step_time_not_its_cpu(tmp_path):
    world = World(**{**SHARED, "noise": 0.05}, slow_rank={5: 1.5}, slow_sleeps=True)
    (f,) = report_of(tmp_path, world)["findings"]
    assert f["kind"] == "straggler" and f["ranks"] == [5]
    assert "signal" not in f["evidence"] and "cpu_ratio" not in f["evidence"]
    assert f["evidence"]["work_ratio"] == pytest.approx(1.5, abs=0.08)


def test_a_sleeping_rank_whose_cpu_time_also_passes_reads_its_step_times_factor(tmp_path):
    """Both signals pass; each reads the slowdown short in its own way (CPU time leaves the
    sleep out), and the factor is the larger: the trainer's sleeping 1.5x ranks read 1.06-1.10x
    by CPU time alone, 1.4-1.6x by their time outside waits."""
    world = World(**{**SHARED, "noise": 0.05}, slow_rank={5: 1.5}, slow_sleeps=True,
                  slow_cpu={5: 1.12})  # fmt: skip
    (f,) = report_of(tmp_path, world)["findings"]
    assert f["kind"] == "straggler" and f["ranks"] == [5]
    ev = f["evidence"]
    assert ev["cpu_ratio"] == pytest.approx(1.12, abs=0.04) and "signal" not in ev
    assert ev["work_ratio"] == ev["own_time_ratio"] == pytest.approx(1.5, abs=0.08)
    assert f["message"].startswith(f"rank 5 (dp2 pp0 tp1, node1) computes {ev['work_ratio']:.2f}x")


def test_cpu_time_of_a_gpu_run_is_not_its_work(tmp_path):
    """On a GPU the host thread's CPU time is launches and spins, not the rank's work."""
    world = World(**SHARED, slow_rank={5: 1.3})
    write_world(world, str(tmp_path))
    meta = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**meta, "device": "cuda"}))
    assert analyze(open_run(tmp_path))["findings"] == []


# the 8 ranks of one host, sharing its cores
ONE_HOST = {**SHARED, "noise": 0.05, "ranks_per_host": 8}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_the_scheduler_ran_less_is_no_straggler(tmp_path, seed):
    """A rank that waited for a core 1.4x its work's time longer than its peers on their shared
    host, its CPU time theirs: named by its step time where the run did not record the wait,
    not where it did."""
    world = World(**ONE_HOST, descheduled={5: 1.4}, seed=seed)
    assert kinds(report_of(tmp_path / "blind", world)).get("straggler") == [[5]]
    recorded = World(**ONE_HOST, descheduled={5: 1.4}, seed=seed, record_runq=True)
    assert report_of(tmp_path / "seen", recorded)["findings"] == []


def test_a_rank_another_host_runs_less_is_a_straggler(tmp_path):
    """The same wait where the rank's peers run on another host too: its host is slower for
    the job (overloaded), which is a straggler's cause."""
    world = World(**{**ONE_HOST, "ranks_per_host": 4}, descheduled={5: 1.4}, record_runq=True)
    assert kinds(report_of(tmp_path, world)).get("straggler") == [[5]]


def test_a_sleeping_rank_waits_for_no_core_and_is_still_named(tmp_path):
    world = World(**{**SHARED, "noise": 0.05}, slow_rank={5: 1.5}, slow_sleeps=True,
                  record_runq=True)  # fmt: skip
    (f,) = report_of(tmp_path, world)["findings"]
    assert f["kind"] == "straggler" and f["ranks"] == [5]
    assert f["evidence"]["work_ratio"] == pytest.approx(1.5, abs=0.08)


def test_a_burning_rank_that_also_waits_longer_for_a_core_is_named(tmp_path):
    """A rank computing 1.3x waits for a core in proportion, its CPU time 1.3x: the scheduler
    does not explain it."""
    world = World(**SHARED, slow_rank={5: 1.3}, record_runq=True)
    (f,) = report_of(tmp_path, world)["findings"]
    assert f["kind"] == "straggler" and f["ranks"] == [5]
    assert f["evidence"]["cpu_ratio"] == pytest.approx(1.3, abs=0.05)
