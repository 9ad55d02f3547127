"""Each injected fault really changes the named rank's timing, and nothing elsewhere.

In one process, what a fault determines: the time it adds to a span, the ranks and steps it acts
on. On real gloo groups and in a traced run (live): that the faulted rank, link or step is the
slowest, and the lower bound a sleep sets; how much slower it reads is the benches' to measure.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from tracer.faults import parse_fault, parse_faults
from trainer.faults import CommClock, LinkFaults, RankFaults


def _work() -> None:
    """A fixed amount of "work". A sleep rather than arithmetic: the two cores of a CI
    machine are shared, and what is checked is the fault's stretching, not the work."""
    time.sleep(0.02)


def _spans(faults: RankFaults, n: int = 5) -> list[float]:
    """Seconds of each of ``n`` compute spans of one ``_work`` each."""
    out = []
    for step in range(n):
        faults.begin_step(step)
        t0 = time.perf_counter()
        with faults.compute():
            _work()
        out.append(time.perf_counter() - t0)
    return out


def test_slow_rank_stretches_compute_of_the_named_rank_only():
    specs = parse_faults(["slow_rank:rank=1,factor=3"], 4)
    slow, fast = RankFaults(specs, rank=1), RankFaults(specs, rank=0)
    took = _spans(slow)
    # the fault adds (factor - 1) x the span's own time, and sleeps for it: a span lasts at
    # least its own time and what was added, whatever else the machine runs
    assert slow.compute_s >= 5 * 0.02 and slow.added_s == pytest.approx(2 * slow.compute_s)
    assert sum(took) >= slow.compute_s + slow.added_s
    _spans(fast)
    assert not fast.active and fast.added_s == 0.0 and fast.compute_s == 0.0


def test_pause_and_slow_data_act_on_their_rank_and_steps(monkeypatch):
    pause = parse_fault("pause:rank=2,every=3,ms=60", 4)
    data = parse_fault("slow_data:rank=2,ms=40", 4)
    mine, other = RankFaults([pause, data], rank=2), RankFaults([pause, data], rank=3)
    slept: list[tuple[int, float]] = []
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append((step, s)), sleep(s)))
    for step in range(7):
        mine.begin_step(step)
        other.begin_step(step)
    assert slept == [(3, 0.060), (6, 0.060)]  # rank 2 pauses at steps 3 and 6 only
    slept.clear()
    step = 7
    with mine.data():
        pass
    with other.data():
        pass
    assert slept == [(7, 0.040)]  # rank 2's data is 40 ms slower; rank 3's is not


_LOOP = """
import sys, logging
from tracer.faults import parse_fault
from trainer.faults import RankFaults
f = RankFaults([parse_fault(sys.argv[1], 4)], rank=int(sys.argv[2]))
for step in range(6):
    f.begin_step(step)
    with f.compute():
        pass
    print(step, flush=True)
"""


def _run_loop(spec: str, rank: int, timeout: float) -> tuple[int | None, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LOOP), spec, str(rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.split()
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out.split()


def test_crash_exits_abruptly_at_its_step_on_its_rank_only():
    code, steps = _run_loop("crash:rank=1,step=3", 1, timeout=60)
    assert code == 1 and steps == ["0", "1", "2"]
    code, steps = _run_loop("crash:rank=1,step=3", 0, timeout=60)
    assert code == 0 and steps == [str(s) for s in range(6)]


def test_hang_blocks_for_good_at_its_step():
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LOOP), "hang:rank=2,step=2", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        seen = [proc.stdout.readline().strip() for _ in range(2)]
        assert seen == ["0", "1"]
        time.sleep(2.0)  # far longer than a step of this loop
        assert proc.poll() is None  # still blocked
    finally:
        proc.kill()
    rest, _ = proc.communicate()
    assert rest.split() == []


def _link_worker(rank: int, world: int, spec: str | None) -> dict:
    """Time all-reduces in two pair groups and one cross group, and a p2p exchange."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    links = LinkFaults(parse_faults([spec] if spec else [], world), rank).install()
    mine_pair, mine_cross = pairs[rank // 2], cross[rank % 2]
    x = torch.ones(256 * 1024)  # 1 MiB
    out: dict = {"pair": [], "cross": [], "p2p": [], "pair_exit": []}
    try:
        for _ in range(12):
            dist.barrier()
            t0 = time.time_ns()
            dist.all_reduce(x, group=mine_pair)
            t1 = time.time_ns()
            out["pair"].append(t1 - t0)
            out["pair_exit"].append(t1)
            dist.barrier()
            t1 = time.time_ns()
            dist.all_reduce(x, group=mine_cross)
            out["cross"].append(time.time_ns() - t1)
            dist.barrier()
            peer = rank ^ 1
            buf = torch.empty_like(x)
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, buf, peer)]
            t2 = time.time_ns()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            out["p2p"].append(time.time_ns() - t2)
        out["delayed_ops"] = links.delayed_ops
        out["phases"] = {k: statistics.median(v) for k, v in links.transfer_phases().items() if v}
        out["compare"] = sorted(links.compare.items())
    finally:
        links.uninstall()
    return out


@pytest.mark.solo
def test_slow_link_slows_only_ops_crossing_the_link_and_keeps_members_together(ranks):
    res = ranks(_link_worker, 4, "slow_link:ranks=0-1,factor=21")
    med = {k: [statistics.median(r[k]) for r in res] for k in ("pair", "cross", "p2p")}
    # the pair group {0,1} holds the link, {2,3} does not; neither cross group holds it
    assert min(med["pair"][:2]) > max(med["pair"][2:]), med
    assert min(med["p2p"][:2]) > max(med["p2p"][2:]), med
    assert max(med["cross"]) < min(med["pair"][:2]), med
    # {2,3} is the comparable group of {0,1}, and 2-3 the comparable pair of 0-1, both ways
    want = [(("g", (2, 3)), ("g", (0, 1))), (("p", 2, 3), ("p", 0, 1)), (("p", 3, 2), ("p", 1, 0))]
    assert all(r["compare"] == want for r in res), res[0]["compare"]
    # both pairs' transfer phases were measured, on both sides
    assert set(res[0]["phases"]) >= {(0, 1), (1, 0)} and set(res[2]["phases"]) >= {(2, 3)}
    # world barriers hold the link too (3 per round); 0 and 1 add the pair all-reduce and
    # their receive (a sender is not held); the comparable pair {2,3} is not slowed
    assert [r["delayed_ops"] for r in res] == [5 * 12, 5 * 12, 3 * 12, 3 * 12]


def _blocked_worker(rank: int, world: int) -> dict:
    """Rank 1, slowed 3x, computes 20 ms in a span that also waits 150 ms in an all-reduce
    for rank 0: only the 20 ms are stretched."""
    clock = CommClock()
    faults = parse_faults(["slow_rank:rank=1,factor=3"], world)
    links = LinkFaults(faults, rank, clock=clock).install()
    mine = RankFaults(faults, rank, clock=clock)
    x = torch.ones(16)
    try:
        for step in range(4):
            mine.begin_step(step)
            dist.barrier()
            with mine.compute():
                _work()
                if rank == 0:
                    time.sleep(0.15)
                dist.all_reduce(x)
    finally:
        links.uninstall()
    return {"compute": mine.compute_s, "added": mine.added_s, "blocked": clock.blocked_s}


@pytest.mark.solo
def test_slow_rank_stretches_its_own_compute_not_its_waits_in_collectives(ranks):
    res = ranks(_blocked_worker, 2)
    slow = res[1]
    assert slow["added"] == pytest.approx(2 * slow["compute"])  # factor 3
    assert slow["compute"] < slow["blocked"], slow  # the waits are not compute
    assert res[0]["added"] == 0.0


# ---------------------------------------------------------------- in a real traced run

TRACED_FAULTS = [
    "slow_rank:rank=3,factor=4",
    "slow_data:rank=1,ms=80",
    "pause:rank=2,every=3,ms=200",
    "slow_link:ranks=0-2,factor=60",
]


def _query(run: str, sql: str) -> list[tuple]:
    import duckdb

    con = duckdb.connect()
    for table in ("spans", "collectives"):
        con.execute(
            f"create view {table} as select * from "
            f"read_parquet('{run}/{table}/*/*.parquet', hive_partitioning=false)"
        )
    return con.execute(sql).fetchall()


@pytest.mark.solo
def test_each_fault_in_a_traced_run_changes_only_its_rank(tmp_path, train):
    """One 4-rank run (dp2 x pp2: pipelines 0-2 and 1-3) with four faults on four different
    ranks; the tracer's own tables show each fault on its rank and not on the others."""
    run = str(tmp_path / "run")
    inject = [a for spec in TRACED_FAULTS for a in ("--inject", spec)]
    res = train("--dp", "2", "--pp", "2", "--steps", "10", "--out", run, *inject)
    assert res.returncode == 0, res.stderr[-4000:]

    # slow_rank: forward/backward spans of rank 3 (factor 4) are the longest. What each fault
    # determines is asserted: a sleep's lower bound, which rank and steps it acts on; how much
    # longer a span reads on shared cores is the benches' to measure.
    compute = dict(
        _query(
            run,
            """select rank, median(end_ns - start_ns) from spans
        where name in ('forward', 'backward') and step >= 1 group by rank""",
        )
    )
    assert compute[3] > max(compute[r] for r in (0, 1, 2)), compute

    # slow_data: rank 1's data span is 80 ms longer; the others' are not
    data = dict(_query(run, "select rank, median(end_ns - start_ns) from spans "
                            "where name = 'data' group by rank"))  # fmt: skip
    assert data[1] >= 80e6 and data[1] > max(data[r] for r in (0, 2, 3)), data

    # pause: on rank 2, steps 3, 6, 9 start with a 200 ms stall before the data span
    gaps = _query(
        run,
        """select d.rank, d.step, d.start_ns - s.start_ns from spans d
        join spans s on s.rank = d.rank and s.step = d.step and s.name = 'step'
        where d.name = 'data' and d.step >= 1""",
    )
    paused = [g for r, s, g in gaps if r == 2 and s % 3 == 0]
    plain = [g for r, s, g in gaps if not (r == 2 and s % 3 == 0)]
    assert len(paused) == 3 and min(paused) >= 200e6, paused
    assert statistics.median(plain) < min(paused), plain

    # slow_link: once both ends are there, a transfer between 0 and 2 takes far longer than
    # one between 1 and 3 (the other pipeline), until its receiver has it
    transfer = dict(
        _query(
            run,
            """with pairs as (
            select least(rank, peer) as a, greatest(rank, peer) as b, seq,
                   case when op = 'send' then rank else peer end as src,
                   max(case when op = 'recv' then end_ns end) - max(issue_ns) as t
            from collectives where op in ('send', 'recv') and end_ns is not null and step >= 1
            group by all having count(*) = 2)
        select a || '-' || b, median(t) from pairs group by all""",
        )
    )
    assert transfer["0-2"] > transfer["1-3"], transfer
