"""The cluster simulator: its run directory follows the SPEC, its collectives are consistent,
and every fault shows up on the rank or link it names."""

from __future__ import annotations

import json
import os
import subprocess

import duckdb
import pyarrow.parquet as pq
import pytest
from helpers.cli import megascope

from analyzer.synth import Extras, SynthConfig, parse_injections, synthesize
from tracer.schema import TABLES

MESH = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_run(path, *specs, mesh=MESH, steps=6, seed=0, extras=None, **kw) -> str:
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    cfg = SynthConfig(
        mesh=dict(mesh),
        steps=steps,
        microbatches=kw.pop("microbatches", 4),
        faults=parse_injections(specs, world),
        seed=seed,
        extras=extras or Extras(),
        **kw,
    )
    synthesize(cfg, str(path), specs)
    return str(path)


def read_meta(run) -> dict:
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        return json.load(f)


def db(run: str) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    for t in TABLES:
        if os.path.isdir(os.path.join(run, t)):
            con.execute(
                f"create view {t} as select * from read_parquet('{run}/{t}/*/*.parquet', hive_partitioning=false)"
            )
    return con


def group_index(run: str) -> dict[tuple[str, int], int]:
    """(group name, rank) -> index of that rank's group of that name in run.json."""
    meta = read_meta(run)
    out = {}
    for i, g in enumerate(meta["groups"]):
        for r in g["ranks"]:
            out[(g["name"], r)] = i
    return out


def with_groups(run: str) -> duckdb.DuckDBPyConnection:
    con = db(run)
    idx = group_index(run)
    rows = [(name, r, i) for (name, r), i in idx.items()]
    con.execute("create table gidx (gname varchar, rank integer, gid integer)")
    con.executemany("insert into gidx values (?, ?, ?)", rows)
    return con


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> str:
    return make_run(tmp_path_factory.mktemp("healthy"), mesh={"dp": 2, "pp": 2, "tp": 2, "cp": 2})


def test_every_table_has_the_spec_schema_and_one_folder_per_rank(healthy):
    meta = read_meta(healthy)
    assert meta["status"] == "finished" and meta["world_size"] == 16 and meta["device"] == "cuda"
    assert meta["mesh"] == {"dp": 2, "pp": 2, "tp": 2, "cp": 2}
    assert {g["name"] for g in meta["groups"]} == {"dp", "pp", "tp", "cp"}
    assert meta["summary"]["steps"] == 6 and meta["summary"]["median_step_ms"] > 0
    for table in ("topology", "spans", "collectives", "heartbeats", "gpu"):
        folders = sorted(os.listdir(os.path.join(healthy, table)))
        assert folders == [f"rank={r:05d}" for r in range(16)], table
        for folder in folders:
            for name in os.listdir(os.path.join(healthy, table, folder)):
                schema = pq.read_schema(os.path.join(healthy, table, folder, name))
                assert schema.remove_metadata().equals(TABLES[table]), (table, folder)
    con = db(healthy)
    assert con.execute(
        "select count(distinct rank), typeof(any_value(rank)) from spans"
    ).fetchone() == (16, "INTEGER")
    hosts = con.execute("select rank, host from topology order by rank").fetchall()
    assert hosts[7] == (7, "node0") and hosts[8] == (8, "node1")
    assert con.execute("select count(*) from collectives where end_ns is null").fetchone() == (0,)
    names = {r[0] for r in con.execute("select distinct name from spans").fetchall()}
    assert names == {"data", "step", "forward", "backward", "optimizer"}


def test_seq_numbers_match_across_the_members_of_each_group(healthy):
    con = with_groups(healthy)
    bad = con.execute(
        """
        with g as (select c.*, x.gid from collectives c join gidx x on x.gname = c."group" and x.rank = c.rank
                   where c.op not in ('send', 'recv'))
        select gid, seq, count(*) n, count(distinct op) ops, count(distinct nbytes) sizes, any_value(group_size) gs
        from g group by gid, seq having n != gs or ops != 1 or sizes != 1
        """
    ).fetchall()
    assert bad == []
    kinds = {r[0] for r in con.execute('select distinct "group" from collectives').fetchall()}
    assert kinds == {"dp", "pp", "tp", "cp"}


def test_a_collective_ends_after_its_last_member_arrives_and_together(healthy):
    con = with_groups(healthy)
    total, early, apart, skewed = con.execute(
        """
        with g as (select c.*, x.gid from collectives c join gidx x on x.gname = c."group" and x.rank = c.rank
                   where c.op not in ('send', 'recv')),
             inst as (select gid, seq, min(end_ns) first_end, max(end_ns) last_end, min(start_ns) first_in,
                             max(start_ns) last_in from g group by gid, seq)
        select count(*), count(*) filter (where first_end < last_in), count(*) filter (where first_end != last_end),
               count(*) filter (where last_in > first_in)
        from inst
        """
    ).fetchone()
    assert total > 100
    assert early == 0 and apart == 0
    assert skewed > 0.5 * total  # members arrive at different times (after compute)


def test_send_recv_pairs_are_consistent(healthy):
    con = db(healthy)
    sends, unmatched, bad = con.execute(
        """
        with s as (select * from collectives where op = 'send'),
             r as (select * from collectives where op = 'recv')
        select count(*), count(*) filter (where r.rank is null),
               count(*) filter (where r.rank is not null and (r.start_ns != s.start_ns or r.end_ns != s.end_ns
                    or r.nbytes != s.nbytes or s.end_ns < greatest(s.issue_ns, r.issue_ns)))
        from s left join r on r.rank = s.peer and r.peer = s.rank and r.seq = s.seq
        """
    ).fetchone()
    assert sends == 2 * 2 * 2 * 2 * 4 * 6  # dp*cp*tp positions x 2 directions x 4 mb x 6 steps
    assert unmatched == 0 and bad == 0
    assert con.execute("select count(*) from collectives where op = 'recv'").fetchone() == (sends,)


def own_compute_ms(run: str) -> dict[int, float]:
    """Per rank: time in forward/backward spans minus the collectives inside them."""
    con = db(run)
    rows = con.execute(
        """
        with s as (select rank, sum(end_ns - start_ns) t from spans where name in ('forward', 'backward') group by rank),
             c as (select rank, sum(end_ns - start_ns) t from collectives where microbatch >= 0 and "group" in ('tp', 'cp')
                   group by rank)
        select s.rank, (s.t - coalesce(c.t, 0)) / 1e6 from s left join c using (rank)
        """
    ).fetchall()
    return dict(rows)


def test_slow_rank_computes_factor_times_slower_than_its_peers(tmp_path):
    run = make_run(tmp_path, "slow_rank:rank=5,factor=1.5")
    own = own_compute_ms(run)
    peers = [own[r] for r in (4, 6, 7)]  # same pipeline stage
    assert own[5] / (sum(peers) / 3) == pytest.approx(1.5, rel=0.03)
    assert max(peers) / min(peers) < 1.05
    # ... and its TP peer waits for it: rank 5 arrives last in nearly every tp collective
    con = db(run)
    last = con.execute(
        """select rank, count(*) from (select step, seq, arg_max(rank, start_ns) rank from collectives
           where "group" = 'tp' and rank in (4, 5) group by step, seq having max(start_ns) > min(start_ns))
           group by rank order by rank"""
    ).fetchall()
    assert dict(last).get(5, 0) > 0.9 * sum(n for _, n in last)


def transfer_ms(run: str, where: str) -> float:
    con = with_groups(run)
    return con.execute(
        f"""
        with g as (select c.*, x.gid from collectives c join gidx x on x.gname = c."group" and x.rank = c.rank),
             inst as (select gid, seq, min(rank) lo, max(rank) hi, max(end_ns) - max(start_ns) xfer from g
                      where {where} group by gid, seq)
        select avg(xfer) / 1e6 from inst
        """
    ).fetchone()[0]


def test_slow_link_slows_the_transfers_of_groups_holding_both_ends(tmp_path):
    run = make_run(tmp_path, "slow_link:ranks=1-3,factor=4")  # ranks 1 and 3: one dp group
    slow = transfer_ms(
        run, "\"group\" = 'dp' and gid = (select gid from gidx where gname = 'dp' and rank = 1)"
    )
    other = transfer_ms(
        run, "\"group\" = 'dp' and gid != (select gid from gidx where gname = 'dp' and rank = 1)"
    )
    assert slow / other == pytest.approx(4.0, rel=0.1)
    tp_a = transfer_ms(run, "\"group\" = 'tp' and rank in (0, 1)")
    tp_b = transfer_ms(run, "\"group\" = 'tp' and rank in (2, 3)")
    assert tp_a / tp_b == pytest.approx(1.0, rel=0.1)  # the link is not in a tp group


def test_slow_link_between_stages_slows_that_pipeline_pair_only(tmp_path):
    run = make_run(tmp_path, "slow_link:ranks=1-5,factor=3")
    con = db(run)
    rows = dict(
        con.execute(
            "select rank, avg(end_ns - start_ns) from collectives where op = 'send' group by rank"
        ).fetchall()
    )
    others = [rows[r] for r in rows if r not in (1, 5)]
    assert rows[1] / (sum(others) / len(others)) == pytest.approx(3.0, rel=0.1)
    assert rows[5] / (sum(others) / len(others)) == pytest.approx(3.0, rel=0.1)
    own = own_compute_ms(run)
    assert max(own[r] for r in (4, 5, 6, 7)) / min(own[r] for r in (4, 5, 6, 7)) < 1.05


def test_hang_leaves_peers_waiting_in_the_collective_the_hung_rank_never_entered(tmp_path):
    run = make_run(tmp_path, "hang:rank=5,step=3", steps=8)
    meta = read_meta(run)
    assert meta["status"] == "hung" and meta["injections"] == ["hang:rank=5,step=3"]
    con = db(run)
    waits = con.execute(
        "select rank, op, \"group\", seq from collectives where end_ns is null and op != 'send' order by rank"
    ).fetchall()
    assert 5 not in [w[0] for w in waits]
    tp_wait = [w for w in waits if w[0] == 4]
    assert tp_wait and tp_wait[0][2] == "tp"
    seq = tp_wait[0][3]
    assert con.execute(
        f"select count(*) from collectives where rank = 5 and \"group\" = 'tp' and seq >= {seq}"
    ).fetchone() == (0,)
    beats = dict(
        con.execute(
            "select rank, max(step) from heartbeats where state = 'step' group by rank"
        ).fetchall()
    )
    assert set(beats.values()) == {3}
    stacks = dict(con.execute("select rank, stack from stacks").fetchall())
    assert "trainer/faults/rank.py" in stacks[5] and "all_gather" in stacks[4]
    assert con.execute("select count(*) from heartbeats where state = 'hang'").fetchone() == (8,)


def test_crash_stops_the_rank_and_the_others_wait(tmp_path):
    run = make_run(tmp_path, "crash:rank=2,step=14", steps=20)
    meta = read_meta(run)
    assert meta["status"] == "failed"
    con = db(run)
    beats = dict(con.execute("select rank, max(step) from heartbeats group by rank").fetchall())
    assert beats[2] == 9  # unflushed steps 10..14 are lost with the process
    assert all(beats[r] == 14 for r in beats if r != 2)
    waiting = {
        r[0]
        for r in con.execute(
            "select distinct rank from collectives where end_ns is null"
        ).fetchall()
    }
    assert 3 in waiting and 2 not in waiting
    assert not os.path.isdir(os.path.join(run, "stacks"))


def test_pause_stalls_the_rank_every_n_steps(tmp_path):
    run = make_run(tmp_path, "pause:rank=3,every=2,ms=40", steps=7)
    con = db(run)
    gaps = con.execute(
        """select d.rank, d.step, (d.start_ns - s.start_ns) / 1e6 from spans d join spans s
           on s.rank = d.rank and s.step = d.step and s.name = 'step' where d.name = 'data' and d.rank in (2, 3)
           order by d.rank, d.step"""
    ).fetchall()
    for rank, step, gap in gaps:
        expected = 40.0 if rank == 3 and step > 0 and step % 2 == 0 else 0.0
        assert gap == pytest.approx(expected, abs=0.01), (rank, step)


def test_slow_data_lengthens_the_data_span(tmp_path):
    run = make_run(tmp_path, "slow_data:rank=6,ms=25")
    con = db(run)
    data = dict(
        con.execute(
            "select rank, avg(end_ns - start_ns) / 1e6 from spans where name = 'data' group by rank"
        ).fetchall()
    )
    others = [data[r] for r in data if r != 6]
    assert data[6] - sum(others) / len(others) == pytest.approx(25.0, abs=0.5)


def test_extras_throttle_imbalance_and_regression(tmp_path):
    extras = Extras(imbalance=((1, 1.3),), throttle=((2, 1.25, 3),), regression=1.5)
    run = make_run(tmp_path, extras=extras, steps=8)
    con = db(run)
    clocks = [
        r[0]
        for r in con.execute(
            "select sm_clock_mhz from gpu where rank = 2 order by ts_ns"
        ).fetchall()
    ]
    assert clocks[0] > 1950 and clocks[5] < 1600
    assert con.execute(
        "select count(*) from gpu where throttle_reasons != 0 and rank != 2"
    ).fetchone() == (0,)
    own = own_compute_ms(run)
    assert own[4] / own[0] == pytest.approx(1.3, rel=0.05)  # stage 1 vs stage 0 (both unthrottled)
    per_step = dict(
        con.execute(
            """with s as (select step, sum(end_ns - start_ns) t from spans
                          where rank = 0 and name in ('forward', 'backward') group by step),
                    c as (select step, sum(end_ns - start_ns) t from collectives
                          where rank = 0 and microbatch >= 0 and "group" = 'tp' group by step)
               select step, s.t - c.t from s join c using (step)"""
        ).fetchall()
    )
    first, last = per_step[0], per_step[7]
    assert last / first == pytest.approx(1.5, rel=0.05)


def test_same_seed_same_run_and_another_seed_another(tmp_path):
    a = make_run(tmp_path / "a", "slow_rank:rank=1,factor=1.2", seed=7)
    b = make_run(tmp_path / "b", "slow_rank:rank=1,factor=1.2", seed=7)
    c = make_run(tmp_path / "c", "slow_rank:rank=1,factor=1.2", seed=8)
    q = 'select * from collectives order by rank, issue_ns, op, "group", seq'
    ra, rb, rc = (db(x).execute(q).fetchall() for x in (a, b, c))
    assert ra == rb and ra != rc
    ja, jb = (read_meta(x) for x in (a, b))
    assert ja == jb


def test_coarse_detail_keeps_the_timing_with_fewer_rows(tmp_path):
    fine = make_run(tmp_path / "fine", seed=1)
    coarse = make_run(tmp_path / "coarse", seed=1, detail="coarse")
    n_fine, n_coarse = (
        db(x).execute("select count(*) from collectives where \"group\" = 'tp'").fetchone()[0]
        for x in (fine, coarse)
    )
    assert n_coarse * 4 == n_fine  # four layers per stage folded into one
    sf, sc = (read_meta(x)["summary"]["median_step_ms"] for x in (fine, coarse))
    assert sc == pytest.approx(sf, rel=0.05)


def synth_cli(*args: str) -> subprocess.CompletedProcess:
    return megascope("synth", *args, timeout=120)


def test_cli_writes_a_run(tmp_path):
    out = tmp_path / "run"
    p = synth_cli(
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "3",
        "--inject",
        "slow_rank:rank=1,factor=2",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    meta = read_meta(out)
    assert meta["world_size"] == 4 and meta["injections"] == ["slow_rank:rank=1,factor=2"]
    again = synth_cli("--mesh", "dp=2,tp=2", "--steps", "3", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mesh", "dp=2,xx=2", "--steps", "3"], "AXIS=N"),
        (["--mesh", "dp=0", "--steps", "3"], "positive integer"),
        (["--mesh", "dp=2", "--steps", "0"], "--steps"),
        (
            ["--mesh", "dp=2,pp=2", "--steps", "3", "--inject", "slow_rank:rank=9,factor=2"],
            "outside the world",
        ),
        (["--mesh", "dp=2", "--steps", "3", "--inject", "slow_rank:rank=1"], "missing factor"),
        (["--mesh", "dp=2", "--steps", "3", "--inject", "melt:rank=1"], "unknown fault kind"),
        (["--mesh", "dp=2", "--steps", "3", "--throttle", "rank=7,factor=2"], "outside the world"),
        (["--mesh", "dp=2", "--steps", "three"], "invalid int"),
        (["--steps", "3"], "--mesh"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    p = synth_cli(*args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "error" in lines[0], p.stderr
    assert not (tmp_path / "x").exists()


def test_interleaved_schedule_order():
    from analyzer.synth.schedule import interleaved_1f1b, one_f_one_b

    for pp, m, v in ((2, 4, 2), (4, 8, 2), (3, 3, 3)):
        for s in range(pp):
            ops = interleaved_1f1b(s, pp, m, v)
            for kind in "FB":
                got = sorted((c, mb) for k, c, mb in ops if k == kind)
                assert got == sorted((c, mb) for c in range(v) for mb in range(m))
            # a microbatch's chunks run in model order forward and in reverse backward
            for mb in range(m):
                assert [c for k, c, b in ops if k == "F" and b == mb] == list(range(v))
                assert [c for k, c, b in ops if k == "B" and b == mb] == list(range(v))[::-1]
            # every backward follows the forward of the same chunk and microbatch
            assert all(ops.index(("F", c, mb)) < i for i, (k, c, mb) in enumerate(ops) if k == "B")
    # warm-up: 2 (p - s - 1) + (v - 1) p forwards (then F, B, ...), all of them when m == p
    assert [k for k, _, _ in interleaved_1f1b(1, 4, 8, 2)[:10]] == ["F"] * 9 + ["B"]
    assert [k for k, _, _ in interleaved_1f1b(0, 3, 3, 2)] == ["F"] * 6 + ["B"] * 6
    assert one_f_one_b(1, 4, 8)[:3] == [("F", 0), ("F", 1), ("F", 2)]  # vpp 1: unchanged


def test_interleaved_pipeline_runs_every_chunk_and_pairs_its_transfers(tmp_path):
    """vpp 2 at dp2 pp3: each rank runs 2 x microbatches forwards and backwards per step,
    the last stage sends on to the first, every send has its receive, and the smaller bubble
    makes the step shorter than without chunks."""
    mesh = {"dp": 2, "pp": 3, "tp": 1, "cp": 1}
    run = make_run(tmp_path / "v2", mesh=mesh, steps=3, microbatches=6, vpp=2, detail="coarse",
                   noise=0.0, rank_spread=0.0)  # fmt: skip
    plain = make_run(tmp_path / "v1", mesh=mesh, steps=3, microbatches=6, detail="coarse",
                     noise=0.0, rank_spread=0.0)  # fmt: skip
    con = db(run)
    counts = con.execute(
        "select rank, step, name, count(*) from spans where name in ('forward', 'backward') "
        "group by all"
    ).fetchall()
    assert len(counts) == 6 * 3 * 2 and {c[3] for c in counts} == {12}
    unmatched = con.execute(
        """select count(*) from collectives s full join collectives r
           on s.op = 'send' and r.op = 'recv' and s.peer = r.rank and r.peer = s.rank
              and s.seq = r.seq
           where (s.op = 'send' or s.op is null) and (r.op = 'recv' or r.op is null)
             and (s.rank is null or r.rank is null)"""
    ).fetchone()[0]
    assert unmatched == 0
    wrap = con.execute(
        "select count(*) from collectives where op = 'send' and rank >= 4 and peer < 2"
    ).fetchone()[0]
    assert wrap == 2 * 6 * 3  # stage 2 -> 0: chunk 0's forwards, 2 ranks, 6 microbatches, 3 steps
    assert read_meta(run)["model"]["config"]["vpp"] == 2
    s2, s1 = (read_meta(x)["summary"]["median_step_ms"] for x in (run, plain))
    assert s2 < s1 * 0.97


def test_work_imbalance_is_per_dp_rank_and_step(tmp_path):
    """``work_imbalance``: the forwards and backwards of every rank of one dp rank share one
    factor in a step (all stages, tp ranks and microbatches); it changes from step to step
    and between dp ranks; the optimizer is untouched; off by default, with the same noise."""
    kw = dict(mesh={"dp": 3, "pp": 2, "tp": 2, "cp": 1}, steps=4, noise=0.0, rank_spread=0.0,
              detail="coarse")  # fmt: skip
    run = make_run(tmp_path / "w", extras=Extras(work_imbalance=0.2), **kw)
    base = make_run(tmp_path / "b", **kw)
    q = """select s.rank, s.step, s.name, s.microbatch, (s.end_ns - s.start_ns) as d
           from spans s where name in ('forward', 'backward', 'optimizer') and rank in (0, 1, 2, 3,
           4, 5) and microbatch <= 0"""
    w = {r[:4]: r[4] for r in db(run).execute(q).fetchall()}
    b = {r[:4]: r[4] for r in db(base).execute(q).fetchall()}
    # coarse detail, no noise: a stage-0 forward of microbatch 0 holds no wait; compare compute
    ratio = {k: w[k] / b[k] for k in w if k[2] == "forward" and k[3] == 0}
    for step in range(4):
        per_dp = [ratio[(r, step, "forward", 0)] for r in (0, 2, 4)]  # tp0 of dp 0, 1, 2
        assert ratio[(1, step, "forward", 0)] == pytest.approx(per_dp[0], rel=1e-3)  # tp peer
        assert max(per_dp) / min(per_dp) > 1.02
    assert len({round(ratio[(0, s, "forward", 0)], 4) for s in range(4)}) == 4
    assert all(abs(w[k] - b[k]) <= 2 for k in w if k[2] == "optimizer")  # ns rounding
    assert read_meta(run)["tracer"]["extras"]["work_imbalance"] == 0.2
    assert "work_imbalance" not in read_meta(base)["tracer"]["extras"]


def test_cli_vpp_and_work_imbalance(tmp_path):
    p = synth_cli("--mesh", "dp=2,pp=2", "--steps", "2", "--vpp", "2", "--work-imbalance",
                  "0.1", "--detail", "coarse", "--out", str(tmp_path / "r"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    meta = read_meta(tmp_path / "r")
    assert meta["model"]["config"]["vpp"] == 2
    assert meta["tracer"]["extras"]["work_imbalance"] == 0.1
    for args, needle in ((["--vpp", "2", "--microbatches", "3"], "multiple of pp"),
                         (["--work-imbalance", "3"], "--work-imbalance")):  # fmt: skip
        p = synth_cli("--mesh", "dp=2,pp=2", "--steps", "2", *args, "--out", str(tmp_path / "x"))
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_replay_engine_starts_ranks_at_their_origin_and_carries_a_hang():
    """The synth times its steps with the what-if's replay: each rank starts at its own
    origin (where its previous step ended), and an infinite duration (a hang) reaches everyone
    who waits on it and no one else."""
    import numpy as np

    from analyzer.whatif.graph import graph_from_arrays
    from analyzer.whatif.replay import Replayer

    # rank 0: compute (slot 0) then a collective (slot 2); rank 1: slots 1 and 3; one group
    graph = graph_from_arrays(
        rank=np.array([0, 1, 0, 1]), pred=np.array([-1, -1, 0, 1]), group=np.array([-1, -1, 0, 0])
    )
    d = np.array([[1.0, np.inf], [2.0, 2.0], [0.5, 0.5], [0.25, 0.25]])
    origin = np.array([[10.0, 10.0], [0.0, 0.0]])  # (rank, step)
    times, start, end = Replayer(graph, dtype=np.float64).run(d, keep=True, origin=origin)
    assert start.dtype == np.float64
    assert list(start[:2, 0]) == [10.0, 0.0] and list(end[:2, 0]) == [11.0, 2.0]
    assert list(end[2:, 0]) == [11.5, 11.5]  # last arrival (rank 0 at 11) + the transfer
    assert end[1, 1] == 2.0 and np.isinf(end[0, 1]) and np.isinf(end[2:, 1]).all()
    assert times[0] == 11.5 and np.isinf(times[1])


def test_a_slow_rank_can_start_at_a_later_step(tmp_path):
    """slow_rank:...,step=S slows the rank from step S on, as the trainer does: the
    straggler is there in the steps after S and not before."""
    from analyzer.db import open_run
    from analyzer.findings import analyze
    from analyzer.synth import SynthConfig, parse_injections, synthesize

    spec = "slow_rank:rank=3,factor=1.5,step=10"
    mesh = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}
    cfg = SynthConfig(mesh=mesh, steps=20, microbatches=4, faults=parse_injections([spec], 8))
    synthesize(cfg, str(tmp_path / "run"), [spec])
    run = open_run(str(tmp_path / "run"))
    before, after = analyze(run, steps=(2, 9)), analyze(run, steps=(10, 19))
    assert before["findings"] == []
    assert [(f["kind"], f["ranks"]) for f in after["findings"]] == [("straggler", [3])]


LAYOUT_CASES = {
    "straggler, throttle, two chunks": (
        ("slow_rank:rank=5,factor=1.3", "pause:rank=9,every=3,ms=40"),
        {"extras": Extras(throttle=((6, 1.3, 2),)), "vpp": 2, "microbatches": 4},
    ),
    "hang": (("hang:rank=3,step=4",), {}),
    "crash": (("crash:rank=12,step=3",), {}),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_the_ranks_layout_holds_the_same_rows_in_a_file_per_stage(tmp_path, monkeypatch, case):
    from analyzer.synth import run as synth_run

    monkeypatch.setattr(synth_run, "CHUNK_ELEMENTS", 20_000)  # several chunks of steps
    specs, kw = LAYOUT_CASES[case]
    mesh = {"dp": 2, "pp": 2, "tp": 2, "cp": 2}
    world = 16
    runs = {}
    for layout in ("rank", "ranks"):
        cfg = SynthConfig(
            mesh=mesh,
            steps=8,
            faults=parse_injections(specs, world),
            seed=3,
            **{"microbatches": 4, **kw},
        )
        rows: dict[str, int] = {}
        meta = synthesize(cfg, str(tmp_path / layout), specs, layout=layout, rows=rows)
        runs[layout] = (str(tmp_path / layout), meta, rows)
    (a, meta_a, rows_a), (b, meta_b, rows_b) = runs["rank"], runs["ranks"]
    assert meta_a == meta_b and rows_a == rows_b
    if "chunks" in case:
        assert len(os.listdir(os.path.join(a, "spans", "rank=00000"))) > 1
    for table in TABLES:
        if not os.path.isdir(os.path.join(a, table)):
            assert not os.path.isdir(os.path.join(b, table)), table
            continue
        folders = sorted(  # (the digests folder also holds the marker of digests written whole)
            f
            for f in os.listdir(os.path.join(b, table))
            if os.path.isdir(os.path.join(b, table, f))
        )
        assert folders == ["ranks=00000-00007", "ranks=00008-00015"], table
        for folder in folders:
            assert os.listdir(os.path.join(b, table, folder)) == ["part-000000.parquet"]
            schema = pq.read_schema(os.path.join(b, table, folder, "part-000000.parquet"))
            assert schema.remove_metadata().equals(TABLES[table]), (table, folder)
        if table == "digests":  # sums of the rows compared below, in their layout too
            continue
        q = f"select * from {table} order by all"
        got_a, got_b = db(a).execute(q).fetchall(), db(b).execute(q).fetchall()
        assert got_a == got_b and len(got_a) == rows_a[table], table
