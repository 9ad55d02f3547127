"""Digests at the source (docs/spec.md §2 ``digests``, analyzer/digests.py, tracer/digest.py).

Every finding must be the same whether the analyzer digests the raw rows, reads the run's own
``digests`` table, or reads its cache: on the samples (real CPU runs), on synth runs of every
fault kind, and on a real traced gloo run whose tracer wrote its digests flush by flush.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import SCRIPTS

from analyzer.db import open_run
from analyzer.digests import (
    CACHE,
    KINDS,
    combine,
    connect,
    covers,
    digest_rows,
    digest_tables,
    write_digests,
)
from analyzer.findings import analyze
from analyzer.synth import SynthConfig, parse_injections, synthesize
from tracer.digest import flush_digests
from tracer.rundir import to_table
from tracer.schema import TABLES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SAMPLES = os.path.join(ROOT, "samples")
SAMPLE_NAMES = sorted(
    n for n in os.listdir(SAMPLES) if os.path.isfile(os.path.join(SAMPLES, n, "run.json"))
)


def _report(path: str, monkeypatch, *, raw: bool = False) -> tuple[str, str]:
    """(where the digests came from, every finding as JSON)."""
    if raw:
        monkeypatch.setenv("MEGASCOPE_DIGESTS", "raw")
    else:
        monkeypatch.delenv("MEGASCOPE_DIGESTS", raising=False)
    run = open_run(path)
    try:
        report = analyze(run)
        return run.digests_from, json.dumps(report, sort_keys=True, default=str)
    finally:
        run.close()


def _same_findings_every_way(run: str, monkeypatch) -> None:
    """Raw rows, the run's digests table, and the cache all give the same findings."""
    shutil.rmtree(os.path.join(run, "digests"), ignore_errors=True)
    source, want = _report(run, monkeypatch, raw=True)
    assert source == "raw" and not os.path.exists(os.path.join(run, CACHE))
    assert _report(run, monkeypatch) == ("raw", want)  # made once, then cached
    assert os.path.isfile(os.path.join(run, CACHE))
    assert _report(run, monkeypatch) == ("cache", want)
    os.remove(os.path.join(run, CACHE))
    write_digests(run)
    assert covers(run)
    assert _report(run, monkeypatch) == ("digests", want)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_give_the_same_findings_from_digests(name, tmp_path, monkeypatch):
    run = str(tmp_path / name)
    shutil.copytree(os.path.join(SAMPLES, name), run, ignore=shutil.ignore_patterns(CACHE))
    _same_findings_every_way(run, monkeypatch)


FAULTS = [
    "slow_rank:rank=5,factor=2.5",
    "slow_link:ranks=1-3,factor=4",
    "hang:rank=6,step=3",
    "crash:rank=2,step=3",
    "pause:rank=3,every=2,ms=150",
    "slow_data:rank=4,ms=120",
    "seq_skew:rank=1,factor=3",
]


@pytest.mark.parametrize("spec", FAULTS, ids=[s.split(":")[0] for s in FAULTS])
def test_synth_runs_of_every_fault_give_the_same_findings(spec, tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    mesh = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
    cfg = SynthConfig(mesh=mesh, steps=6, microbatches=4, faults=parse_injections([spec], 8))
    synthesize(cfg, run, [spec])
    assert covers(run)  # synth wrote them
    _, want = _report(run, monkeypatch, raw=True)
    assert _report(run, monkeypatch) == ("digests", want)


def test_hot_expert_run_gives_the_same_findings(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    spec = "hot_expert:expert=1,share=0.6"
    cfg = SynthConfig(
        mesh={"dp": 4, "pp": 1, "tp": 1, "cp": 1},
        steps=5,
        microbatches=4,
        faults=parse_injections([spec], 4),
        experts=4,
        ep=2,
    )
    synthesize(cfg, run, [spec])
    _, want = _report(run, monkeypatch, raw=True)
    assert _report(run, monkeypatch) == ("digests", want)


def _random_rows(seed: int) -> dict[str, pa.Table]:
    """Collectives and spans with every case the digests distinguish: sends and recvs,
    host, device and untimed rows, unknown starts and ends, a collective written unfinished
    then finished, null groups and sizes, nested and recompute spans."""
    rng = random.Random(seed)
    coll = {f.name: [] for f in TABLES["collectives"]}
    for i in range(600):
        op = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "send", "recv",
                         "broadcast", "all_to_all", "barrier"])  # fmt: skip
        issue = 1_000_000 + i * 1000 + rng.randrange(500)
        start = rng.choice([None, issue + rng.randrange(300)])
        end = rng.choice([None, issue + 400 + rng.randrange(3000)])
        row = {
            "rank": rng.randrange(3), "step": rng.choice([-1, 0, 1, 2]), "microbatch": 0,
            "op": op, "group": rng.choice(["dp", "tp", None]),
            "group_size": rng.choice([1, 2, 4, None]), "seq": i,
            "peer": rng.randrange(3) if op in ("send", "recv") else -1,
            "nbytes": rng.randrange(1 << 20), "dtype": "float32", "issue_ns": issue,
            "start_ns": start, "end_ns": end,
            "source": rng.choice(["host", "device", "untimed", None]),
        }  # fmt: skip
        for k, v in row.items():
            coll[k].append(v)
        if end is None and rng.random() < 0.5:  # flushed unfinished, then again finished
            for k, v in row.items():
                coll[k].append(issue + 5000 if k == "end_ns" else v)
    spans = {f.name: [] for f in TABLES["spans"]}
    for i in range(400):
        start = 2_000_000 + i * 700
        end = rng.choice([None, start + rng.randrange(1, 5000)])
        row = {
            "rank": rng.randrange(3), "step": rng.choice([-1, 0, 1, 2]), "microbatch": 0,
            "name": rng.choice(["forward", "backward", "recompute", "step", "load", None]),
            "kind": rng.choice(["compute", "data", "comm", "host", None]),
            "start_ns": start, "end_ns": end, "source": "api",
            "cpu_ns": rng.choice([None, rng.randrange(5000)]),
        }  # fmt: skip
        for k, v in row.items():
            spans[k].append(v)
    return {
        "collectives": pa.table(coll, schema=TABLES["collectives"]),
        "spans": to_table("spans", spans),  # the transfer columns, unfilled, null
    }


def _sorted(table: pa.Table) -> list[tuple]:
    rows = [tuple(r.values()) for r in table.to_pylist()]
    return sorted(rows, key=lambda r: tuple((v is None, v if v is not None else 0) for v in r))


def _close(a: list[tuple], b: list[tuple]) -> bool:
    """Equal rows, floats (bus bytes: sums added in another order) to 1e-12."""
    if len(a) != len(b):
        return False
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                if abs(x - y) > 1e-12 * max(abs(x), abs(y), 1.0):
                    return False
            elif x != y:
                return False
    return True


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_tracers_flush_digests_add_up_to_the_analyzers(seed):
    rows = _random_rows(seed)
    want = digest_tables(rows["collectives"], rows["spans"])
    # the tracer's digests of three flushes, stored as parts, added up by the analyzer
    n = rows["collectives"].num_rows
    cuts = sorted(random.Random(seed).sample(range(1, n), 2))
    parts = []
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        m = rows["spans"].num_rows
        spans = rows["spans"].slice(lo * m // n, hi * m // n - lo * m // n)
        parts.append(flush_digests(rows["collectives"].slice(lo, hi - lo), spans))
    con = connect()
    con.register("stored", pa.concat_tables(parts))
    assert combine(con, "stored") == {k: want[k].num_rows and int(pa.compute.sum(
        want[k]["n_rows"]).as_py()) for k in KINDS}  # fmt: skip
    for kind in KINDS:
        got = con.sql(f"select * from digest_{kind}").to_arrow_table()
        assert got.schema == want[kind].schema
        assert _close(_sorted(got), _sorted(want[kind])), kind
    # and the analyzer's own stored rows add up to the same
    con.register("again", digest_rows(want))
    combine(con, "again")
    for kind in KINDS:
        got = con.sql(f"select * from digest_{kind}").to_arrow_table()
        assert _sorted(got) == _sorted(want[kind])


def test_digests_short_of_rows_are_made_again(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(SAMPLES, "slow_rank"), run, ignore=shutil.ignore_patterns(CACHE))
    _, want = _report(run, monkeypatch, raw=True)
    write_digests(run)
    extra = os.path.join(run, "collectives", "rank=00001", "part-009999.parquet")
    first = sorted(os.listdir(os.path.join(run, "collectives", "rank=00001")))[0]
    table = pq.read_table(os.path.join(run, "collectives", "rank=00001", first))
    pq.write_table(table.slice(0, 3), extra)  # rows the digests never saw
    assert not covers(run)
    source, got = _report(run, monkeypatch)
    assert source == "raw"
    os.remove(extra)
    assert _report(run, monkeypatch) == ("digests", want)


def test_a_run_that_cannot_be_written_to_is_analyzed_without_a_cache(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(SAMPLES, "slow_link"), run, ignore=shutil.ignore_patterns(CACHE))
    _, want = _report(run, monkeypatch, raw=True)
    os.mkdir(os.path.join(run, CACHE))  # the cache's name taken: writing it fails, even as root
    os.chmod(run, 0o555)
    try:
        assert _report(run, monkeypatch) == ("raw", want)
        assert _report(run, monkeypatch) == ("raw", want)
        assert [n for n in os.listdir(run) if n.startswith(".")] == []  # no temporary left
    finally:
        os.chmod(run, 0o755)


def test_a_traced_gloo_run_writes_digests_that_give_the_same_findings(
    tmp_path, monkeypatch, attach
):
    run = str(tmp_path / "run")
    script = os.path.join(SCRIPTS, "tracer_ddp_script.py")
    out = attach(run, script, "--api", "--steps", "5", nproc=2, steps=None, size=(),
                 env={"MEGASCOPE_FLUSH_STEPS": "1"}, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert covers(run)  # the tracer's digests, flush by flush, account for every row
    con = connect()
    con.read_parquet(os.path.join(run, "digests", "*", "*.parquet")).create_view("stored")
    combine(con, "stored")
    raw = digest_tables(
        [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run, "collectives")) for f in fs],
        [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run, "spans")) for f in fs],
    )
    for kind in KINDS:
        got = con.sql(f"select * from digest_{kind}").to_arrow_table()
        assert _close(_sorted(got), _sorted(raw[kind])), kind
    source, want = _report(run, monkeypatch, raw=True)
    assert _report(run, monkeypatch) == ("digests", want)


def test_watchs_per_rank_compute_from_the_digests_matches_the_exact_one(monkeypatch):
    # what watch reads past 1,024 ranks instead of the exact steps view: sums of compute spans,
    # the same as their union where (as in this sample) no compute span holds another
    monkeypatch.setenv("MEGASCOPE_DIGESTS", "raw")  # the committed sample stays as it is
    run = open_run(os.path.join(SAMPLES, "slow_rank"))
    try:
        got = run.query("findings/rank_compute_digest", lo=2, hi=9).set_index("rank")["s"]
        exact = run.query("findings/rank_compute", lo=2, hi=9).set_index("rank")["s"]
    finally:
        run.close()
    assert sorted(got.index) == sorted(exact.index) == list(range(8))
    assert (got.sort_index() - exact.sort_index()).abs().max() < 1e-9
    assert got.min() > 0
