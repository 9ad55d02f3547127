"""Causal hang and crash attribution: the culprits at the roots of the wait-for graph, victims
only in the evidence; on every Flight Recorder shape, and without peers.

Sets: every folder of ``tests/data/flight_recorder`` (real dumps: the NVIDIA Megatron set, and
sets made here by megascope's trainer and an expert-parallel job on gloo, see
``tests/helpers/fr_cases.py``), NCCL-shaped sets built from copies of real entries
(``tests/helpers/nccl_fr.py``), ten more fault kinds built so (``tests/helpers/fr_own_sets.py``: two GPUs lost
in different groups, lost dumps, wrapped buffers...), and live runs of the trainer.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from helpers import fr_cases, fr_own_sets, nccl_fr
from helpers.cli import megascope
from helpers.paths import DATA

from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.importers.flight_recorder import import_flight_recorder

FR_DATA = os.path.join(DATA, "flight_recorder")
SETS = sorted(
    d
    for d in os.listdir(FR_DATA)
    if os.path.isfile(os.path.join(FR_DATA, d, "fault_injection.log"))
)
CULPRIT_KINDS = ("hang", "crash")


def named(report: dict) -> list[int]:
    return sorted({r for f in report["findings"] if f["kind"] in CULPRIT_KINDS for r in f["ranks"]})


def report_of_dumps(src: str, out: str) -> dict:
    import_flight_recorder(src, out)
    run = open_run(out)
    try:
        return analyze(run)
    finally:
        run.close()


def check_victims_only_in_evidence(report: dict, culprits: list[int]) -> None:
    for f in report["findings"]:
        if f["kind"] not in CULPRIT_KINDS:
            continue
        assert set(f["ranks"]) <= set(culprits)
        for group in f["evidence"].get("victims", []):
            assert not set(group["ranks"]) & set(culprits), group
        assert not set(f["evidence"].get("waiting_ranks", [])) & set(culprits)


def test_the_committed_sets_are_the_expected_ones():
    assert "gpu_error_2nd" in SETS
    assert {"trainer_hang", "trainer_crash", "trainer_gil", "trainer_kill_in_tp"} <= set(SETS)
    assert {"ep_hang", "ep_kill", "ep_gil"} <= set(SETS)


@pytest.mark.parametrize("name", SETS)
def test_each_set_names_exactly_its_culprits(tmp_path, name):
    src = os.path.join(FR_DATA, name)
    truth = fr_cases.truth(src)
    report = report_of_dumps(src, str(tmp_path / "run"))
    assert named(report) == truth, [f["message"] for f in report["findings"]]
    check_victims_only_in_evidence(report, truth)


def test_one_finding_per_kind_and_victims_grouped_by_what_they_wait_in(tmp_path):
    report = report_of_dumps(os.path.join(FR_DATA, "gpu_error_2nd"), str(tmp_path / "run"))
    (f,) = [f for f in report["findings"] if f["kind"] in CULPRIT_KINDS]
    assert f["ranks"] == [9, 14]
    ev = f["evidence"]
    assert (ev["group"], ev["op"]) == ("EXPERT_MODEL_PARALLEL_GROUP", "all_to_all")
    victims = {r for g in ev["victims"] for r in g["ranks"]}
    assert victims == set(range(16)) - {9, 14}  # every other rank is stuck behind them
    by_op = {(g["group"], g["op"]): g for g in ev["victims"]}
    assert by_op[("EXPERT_MODEL_PARALLEL_GROUP", "all_to_all")]["waiting_for"] == [9, 14]
    assert set(by_op[("pp", "send")]["ranks"]) == set(range(8))  # the first stage waits to send


@pytest.mark.parametrize("name", sorted(nccl_fr.JOBS))
def test_nccl_shaped_sets(tmp_path, name):
    job = nccl_fr.JOBS[name]
    truth = nccl_fr.write(job, str(tmp_path / "dumps"))
    assert truth == job.culprits  # every injected fault took effect
    report = report_of_dumps(str(tmp_path / "dumps"), str(tmp_path / "run"))
    assert named(report) == truth, [f["message"] for f in report["findings"]]
    check_victims_only_in_evidence(report, truth)


def test_nccl_shapes_pickle_json_gzip_and_plain_agree(tmp_path):
    job = nccl_fr.JOBS["nccl_cpu_stop_before_batch"]
    answers = []
    for fmt in ("pickle", "json"):
        for compress in (True, False):
            src = tmp_path / f"{fmt}{compress}"
            nccl_fr.write(nccl_fr.Job(**{**job.__dict__, "fmt": fmt}), str(src), compress=compress)
            answers.append(named(report_of_dumps(str(src), str(tmp_path / f"run-{fmt}{compress}"))))
    assert answers == [[6]] * 4


def test_coalesced_batches_take_the_completion_of_their_coalesced_entry(tmp_path):
    job = nccl_fr.Job("t", only_active=False, faults=())  # a healthy job: everything completed
    dumps = nccl_fr.simulate(job)
    for dump in dumps.values():  # as NCCL records them: the ops of a batch never retire alone
        for e in dump["entries"]:
            if (
                e["is_p2p"]
                and not e["profiling_name"].endswith("coalesced")
                and any(
                    o["profiling_name"].endswith("coalesced")
                    and o["p2p_seq_id"] == e["p2p_seq_id"]
                    and o["process_group"] == e["process_group"]
                    for o in dump["entries"]
                )
            ):
                e.update(state="scheduled", retired=False)
    src = tmp_path / "dumps"
    src.mkdir()
    for rank, dump in dumps.items():
        (src / f"_dump_{rank}").write_bytes(pickle.dumps(dump))
    result = import_flight_recorder(str(src), str(tmp_path / "run"))
    assert result.status == "finished"
    run = open_run(str(tmp_path / "run"))
    assert run.sql("select count(*) from collectives where end_ns is null").iloc[0, 0] == 0
    assert run.sql("select count(*) from collectives where op = 'coalesced'").iloc[0, 0] == 0
    assert named(analyze(run)) == []


def test_groups_named_by_number_still_name_the_culprit(tmp_path):
    job = nccl_fr.Job(
        "n", named=False, faults=(nccl_fr.Fault("cpu_stop", 3, 1, "ep", 1),), fmt="json"
    )
    nccl_fr.write(job, str(tmp_path / "dumps"))
    report = report_of_dumps(str(tmp_path / "dumps"), str(tmp_path / "run"))
    assert named(report) == [3]
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["mesh"] == {"dp": 8, "pp": 1, "tp": 1, "cp": 1}  # no descriptions: no mesh


def test_a_healthy_set_reports_no_culprit(tmp_path):
    nccl_fr.write(nccl_fr.Job("ok", only_active=False), str(tmp_path / "dumps"))
    assert named(report_of_dumps(str(tmp_path / "dumps"), str(tmp_path / "run"))) == []


# -- live runs --------------------------------------------------------------------------------


def test_one_rank_hang_is_a_hang_with_its_rank_step_and_stack(tmp_path, train):
    out = str(tmp_path / "run")
    proc = train("--device", "cpu", "--out", out, "--dp", "1", "--pp", "1", "--tp", "1", "--steps", "10",
                  "--inject", "hang:rank=0,step=5", "--hang-timeout", "5")  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]
    run = open_run(out)
    report = analyze(run)
    run.close()
    (f,) = report["findings"]
    assert (f["kind"], f["ranks"]) == ("hang", [0])
    assert f["evidence"]["last_step"] == {"0": 5}
    assert "_first_compute_of_step" in f["evidence"]["stacks"]["0"]
    assert "step 5" in f["message"]
    cli = megascope("analyze", out)
    assert cli.returncode == 0 and "hang" in cli.stdout and "no findings" not in cli.stdout


def test_one_rank_crash_and_a_healthy_one_rank_run(tmp_path, train):
    out = str(tmp_path / "crash")
    proc = train("--device", "cpu", "--out", out, "--dp", "1", "--pp", "1", "--tp", "1", "--steps", "6",
                  "--inject", "crash:rank=0,step=3")  # fmt: skip
    assert proc.returncode != 0
    run = open_run(out)
    assert [(f["kind"], f["ranks"]) for f in analyze(run)["findings"]] == [("crash", [0])]
    run.close()
    out = str(tmp_path / "ok")
    proc = train("--device", "cpu", "--out", out, "--dp", "1", "--pp", "1", "--tp", "1", "--steps", "4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = open_run(out)
    assert named(analyze(run)) == []
    run.close()


# solo: which ranks a dump finds inside a collective depends on how far each got before the
# fault's timeout, which a neighbour's ranks on the same cores change (ep_kill read ranks
# [1, 3] once beside another test, [1] alone)
@pytest.mark.parametrize("name", ["trainer_hang", "trainer_gil", "ep_kill"])
@pytest.mark.solo
def test_live_sets_from_real_processes(tmp_path, fr_case, name):
    """Made now by real processes: the dumps and (for the trainer) its own traced run."""
    case = fr_cases.CASES[name]
    keep = str(tmp_path / "traced") if case.job == "trainer" else None
    src = fr_case(case, str(tmp_path / "dumps"), keep_run=keep)
    report = report_of_dumps(src, str(tmp_path / "run"))
    assert named(report) == list(case.culprits), [f["message"] for f in report["findings"]]
    check_victims_only_in_evidence(report, list(case.culprits))
    if keep:
        run = open_run(keep)
        traced = analyze(run)
        run.close()
        assert named(traced) == list(case.culprits), [f["message"] for f in traced["findings"]]


def test_a_rank_without_a_dump_and_unknown_group_members(tmp_path):
    """gloo records no group members: a rank that left no dump is put back in its groups."""
    src = tmp_path / "dumps"
    shutil.copytree(os.path.join(FR_DATA, "trainer_crash"), src)
    meta_run = tmp_path / "run"
    import_flight_recorder(str(src), str(meta_run))
    meta = json.loads((meta_run / "run.json").read_text())
    assert meta["mesh"] == {"dp": 2, "pp": 2, "tp": 2, "cp": 1} and meta["world_size"] == 8
    assert meta["import"]["missing_ranks"] == [2]
    tp = [g["ranks"] for g in meta["groups"] if g["name"] == "tp"]
    assert [2, 3] in tp


# -- fault kinds beyond tests/data (tests/helpers/fr_own_sets.py) -----------------------------------

OWN_TRUTH = {  # the injected faults, each of which the dumps show
    "own_ep_a2a_death": [5],
    "own_two_gpus_two_groups": [3, 12],
    "own_gil_held": [6],
    "own_missing_dumps": [1],
    "own_wrapped_buffers": [2],
    "own_two_gpus_one_a2a": [4, 7],
    "own_gpu_dies_in_send": [3],
    "own_hang_before_dp": [2],
    "own_killed_in_batch": [6],
    "own_gpu_and_cpu_by_number": [0, 7],
}


def test_own_sets_are_ten_kinds_each_checked_against_its_injection():
    assert set(fr_own_sets.SETS) == set(OWN_TRUTH)
    assert len({s.kind for s in fr_own_sets.SETS.values()}) == 10
    for name, own in fr_own_sets.SETS.items():  # every injected fault is one the dumps show
        assert sorted(f.rank for f in own.job.faults) == OWN_TRUTH[name], name


@pytest.mark.parametrize("name", sorted(OWN_TRUTH))
def test_own_sets_name_exactly_their_culprits(tmp_path, name):
    src = str(tmp_path / "dumps")
    assert fr_own_sets.write(fr_own_sets.SETS[name], src) == OWN_TRUTH[name]
    assert fr_cases.truth(src) == OWN_TRUTH[name]
    report = report_of_dumps(src, str(tmp_path / "run"))
    assert named(report) == OWN_TRUTH[name], [f["message"] for f in report["findings"]]
    check_victims_only_in_evidence(report, OWN_TRUTH[name])


def test_two_gpus_in_different_groups_neither_hides_behind_the_other(tmp_path):
    """Rank 12's GPU fails in the second stage while the first stage is stuck behind rank 3:
    12's own sends wait for the stuck first stage, but its tensor-parallel peers, stuck too,
    went on enqueueing past where it stopped: it stopped on its own, it is no victim."""
    src = str(tmp_path / "dumps")
    fr_own_sets.write(fr_own_sets.SETS["own_two_gpus_two_groups"], src)
    report = report_of_dumps(src, str(tmp_path / "run"))
    (f,) = [f for f in report["findings"] if f["kind"] in CULPRIT_KINDS]
    assert f["ranks"] == [3, 12]
    victims = {r for g in f["evidence"]["victims"] for r in g["ranks"]}
    assert victims == set(range(16)) - {3, 12}


def test_lost_dumps_of_victims_are_not_culprits_but_a_dead_rank_is(tmp_path):
    """A rank without a dump is named only when someone is stuck waiting for it and for no
    rank with records: the lost dumps of two victims are not, a killed rank's absence is."""
    job = fr_own_sets.SETS["own_missing_dumps"].job
    lost = fr_own_sets.OwnSet(job, "lost dumps", drop=(4, 7))
    src = str(tmp_path / "lost")
    fr_own_sets.write(lost, src)
    meta_run = str(tmp_path / "run-lost")
    report = report_of_dumps(src, meta_run)
    assert named(report) == [1]
    with open(os.path.join(meta_run, "run.json")) as f:
        meta = json.load(f)
    assert meta["import"]["missing_ranks"] == [4, 7]
    killed = nccl_fr.Job(**{**job.__dict__, "faults": (nccl_fr.Fault("killed", 5, 1, "ep", 0),)})
    src = str(tmp_path / "killed")
    nccl_fr.write(killed, src)
    assert named(report_of_dumps(src, str(tmp_path / "run-killed"))) == [5]
