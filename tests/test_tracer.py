"""The tracer on real gloo process groups: collectives, spans, seq matching, failures.

Every rank function here runs in its own process (tests/helpers/ranks.py, the ranks fixture) with a real
gloo group; the rows are read back from the Parquet files with DuckDB, as the analyzer does.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers.tables import QUIET, assert_seq_matches, read

import tracer
from tracer.config import TracerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNQ_READABLE = os.path.exists("/proc/thread-self/schedstat")


def _variants(rank: int, world: int, run: str) -> dict:
    """Every wrapped function once, on the world and on a named subgroup."""
    sub = dist.new_group([0, 1])
    tracer.attach(run, groups={"tp": sub}, config=QUIET)
    peer = 1 - rank
    t = torch.full((4,), float(rank + 1))
    waits = {}
    with tracer.span("outer", microbatch=3), tracer.span("inner", kind="comm"):
        dist.all_reduce(t)  # microbatch 3, inherited from the outer span
    w = dist.all_reduce(t, async_op=True)
    issued = time.perf_counter_ns()  # after the row's issue stamp
    time.sleep(0.05)
    waits["all_reduce"] = time.perf_counter_ns() - issued  # from its issue to its wait()
    w.wait()
    dist.all_gather_single(torch.empty(8), torch.ones(4), group=sub)
    dist.reduce_scatter_single(torch.empty(2), torch.ones(4))
    dist.all_to_all_single(torch.empty(4), torch.ones(4))
    dist.all_gather([torch.empty(3) for _ in range(world)], torch.ones(3))
    dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(world)])
    dist.all_to_all([torch.empty(1) for _ in range(world)], [torch.ones(1) for _ in range(world)])
    dist.broadcast(t, src=0)
    dist.reduce(t, dst=0)
    dist.gather(torch.ones(2), [torch.empty(2) for _ in range(world)] if rank == 0 else None, dst=0)
    dist.scatter(
        torch.empty(2), [torch.ones(2) for _ in range(world)] if rank == 0 else None, src=0
    )
    dist.barrier()
    dist.monitored_barrier()
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank})  # two all_gather rows: sizes, then payload
    if rank == 0:
        dist.send(torch.ones(5), dst=1)
        dist.recv(torch.empty(6), src=1)
    else:
        dist.recv(torch.empty(5), src=0)
        dist.send(torch.ones(6), dst=0)
    w = dist.isend(torch.ones(7), peer) if rank == 0 else dist.irecv(torch.empty(7), peer)
    assert isinstance(w, dist.Work)
    w.wait()
    ops = [
        dist.P2POp(dist.isend, torch.ones(2), peer),
        dist.P2POp(dist.irecv, torch.empty(2), peer),
    ]
    waited = time.perf_counter_ns()
    time.sleep(0.05)
    waits["batch"] = time.perf_counter_ns() - waited  # from the isend/irecv's wait to the batch
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    tracer.close()
    return waits


def test_every_collective_variant_gives_one_correct_row(tmp_path, ranks):
    run = str(tmp_path / "run")
    waits = ranks(_variants, 2, run)
    rows = read(run, "collectives")
    assert_seq_matches(rows)
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        ops = [r["op"] for r in sorted(mine, key=lambda r: r["issue_ns"])]
        assert ops == ["all_reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                       "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
                       "gather", "scatter", "barrier", "barrier", "all_gather", "all_gather",
                       "send" if rank == 0 else "recv", "recv" if rank == 0 else "send",
                       "send" if rank == 0 else "recv", "send", "recv"]  # fmt: skip
        nbytes = [r["nbytes"] for r in sorted(mine, key=lambda r: r["issue_ns"])]
        # all_gather_object: a size all_gather (int64 per rank), then the payload all_gather
        assert nbytes[:14] == [16, 16, 32, 16, 16, 24, 24, 8, 16, 16, 16, 16, 0, 0]
        assert {r["group"] for r in mine} == {"dp", "tp"}
        assert all(r["end_ns"] >= r["start_ns"] >= r["issue_ns"] for r in mine)
        first = min(mine, key=lambda r: r["issue_ns"])
        assert first["microbatch"] == 3
        # the async all-reduce ends at its wait(), 50 ms after its issue: both stamps on this
        # rank's clock (the test's own clock reads differ from the rows' by the estimated offset)
        async_ar = sorted(mine, key=lambda r: r["issue_ns"])[1]
        assert async_ar["end_ns"] - async_ar["issue_ns"] >= waits[rank]["all_reduce"] - 1_000_000
        p2p = sorted((r for r in mine if r["peer"] >= 0), key=lambda r: r["issue_ns"])
        assert {r["peer"] for r in p2p} == {1 - rank}
        before, batch = p2p[-3], p2p[-2:]  # the isend/irecv, then the batch 50 ms later
        assert all(r["issue_ns"] - before["end_ns"] >= waits[rank]["batch"] - 1_000_000
                   for r in batch)  # fmt: skip
    # send/recv: seq per direction and pair, equal on both ends
    sends = {(r["rank"], r["peer"], r["seq"], r["nbytes"]) for r in rows if r["op"] == "send"}
    recvs = {(r["peer"], r["rank"], r["seq"], r["nbytes"]) for r in rows if r["op"] == "recv"}
    assert sends == recvs and len(sends) == 5


def _spans(rank: int, world: int, run: str) -> int:
    tr = tracer.attach(run, config=QUIET)

    @tracer.spanned("decorated", kind="host")
    def work() -> None:
        time.sleep(0.001)

    pid = os.fork()  # a forked child (a DataLoader worker) is detached and records nothing
    if pid == 0:
        with tracer.span("in_child", microbatch=0):
            os._exit(0 if tracer.current() is None else 1)
    assert os.waitpid(pid, 0)[1] == 0
    for step in range(3):
        tracer.step(step)
        with tracer.span("forward", microbatch=0):
            with tracer.span("attention"):
                work()
            burn = time.thread_time() + (0.02 if rank == 1 else 0.005)  # its own CPU work
            while time.thread_time() < burn:
                pass
        with tracer.span("data", kind="data"):
            pass
    tracer.close()
    assert tracer.current() is None
    return tr.steps_seen


@pytest.mark.solo
def test_spans_nest_and_end_after_start(tmp_path, ranks):
    run = str(tmp_path / "run")
    assert ranks(_spans, 2, run) == [3, 3]
    spans = read(run, "spans")
    assert all(s["end_ns"] >= s["start_ns"] for s in spans)
    for rank in (0, 1):
        for step in range(3):
            mine = {s["name"]: s for s in spans if s["rank"] == rank and s["step"] == step}
            assert set(mine) == {"forward", "attention", "decorated", "data", "step"}
            f, a, d = mine["forward"], mine["attention"], mine["decorated"]
            assert f["start_ns"] <= a["start_ns"] <= d["start_ns"] <= d["end_ns"] <= a["end_ns"]
            assert a["end_ns"] <= f["end_ns"] <= mine["step"]["end_ns"]
            assert a["microbatch"] == 0 and mine["data"]["microbatch"] == -1
            # CPU time of the thread inside each span: no more than its length, none in a sleep
            # (1 ms), the burn of the rank's forward in it and in its step
            for s in mine.values():
                assert 0 <= s["cpu_ns"] <= s["end_ns"] - s["start_ns"] + 1_000_000, s
            assert d["cpu_ns"] < (d["end_ns"] - d["start_ns"]) / 2
            burnt = 20e6 if rank == 1 else 5e6
            assert burnt <= f["cpu_ns"] <= mine["step"]["cpu_ns"]
            # and its wait for a core, where the system says (Linux): within the span
            if RUNQ_READABLE:
                for s in mine.values():
                    assert 0 <= s["runq_ns"] <= s["end_ns"] - s["start_ns"] + 1_000_000, s
                assert f["runq_ns"] <= mine["step"]["runq_ns"]
    beats = read(run, "heartbeats")
    assert [b["state"] for b in beats if b["rank"] == 0] == ["step", "step", "step", "end"]
    topo = read(run, "topology")
    assert [(t["rank"], t["pid"] > 0, t["clock_offset_ns"]) for t in topo] == [
        (0, True, 0),
        (1, True, 0),
    ]
    # each rank's own CPU time, by part, in run.json (tracer/budget.py)
    cost = json.loads((tmp_path / "run" / "run.json").read_text())["tracer_cpu"]
    assert set(cost) == {"0", "1"}
    for c in cost.values():
        parts = c["by_part"]
        assert parts["capture"] > 0 and parts["start"] > 0 and parts["close"] > 0, c
        assert abs(sum(parts.values()) - c["cpu_s"]) < 1e-3, c
        assert 0 < c["share"] < 1 and c["steady_share"] <= c["share"], c
        assert c["cpu_s"] < c["process_cpu_s"] and c["ms_per_step"] > 0, c
        assert c["flush_every_steps"] >= QUIET.flush_every_steps and c["budget"] == 0.01, c


def _unwritable(rank: int, world: int, run: str) -> tuple[int, bool, float]:
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("tracer").addHandler(Catch())
    tr = tracer.attach(run, config=QUIET)
    t = torch.ones(2)
    for step in range(5):
        tracer.step(step)
        with tracer.span("forward"):
            dist.all_reduce(t)
    tracer.close()
    return len(warnings), tr.enabled, float(t[0])


def test_unwritable_run_dir_turns_tracing_off_and_training_goes_on(tmp_path, ranks):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    results = ranks(_unwritable, 2, str(blocker / "run"))
    assert results == [(1, False, 32.0), (1, False, 32.0)]


def _one_attaches(rank: int, world: int, run: str) -> tuple[list[float], int]:
    """Rank 1 attaches, rank 0 never does (as if its attach had failed inside ``new_group``)."""
    rows = 0
    if rank == 1:
        cfg = TracerConfig(hang_timeout_s=0, attach_timeout_s=3, flush_every_s=600)
        tr = tracer.attach(run, config=cfg)
    t = torch.ones(2)
    for step in range(3):
        if rank == 1:
            tracer.step(step)
        dist.all_reduce(t)  # training goes on, on both
    if rank == 1:
        rows = len(tr.buffers["collectives"].rows)
        tracer.close()
    return t.tolist(), rows


def test_a_rank_that_never_attaches_holds_the_others_for_the_attach_timeout_only(tmp_path, ranks):
    # without the bound, rank 1 would wait in the clock group's new_group for gloo's 30 minutes
    run = str(tmp_path / "run")
    assert ranks(_one_attaches, 2, run) == [([8.0, 8.0], 0), ([8.0, 8.0], 3)]
    rows = read(run, "collectives")
    assert [(r["rank"], r["op"], r["seq"]) for r in rows] == [
        (1, "all_reduce", s) for s in (1, 2, 3)
    ]


def _clock(rank: int, world: int, run: str) -> list[int]:
    cfg = TracerConfig(hang_timeout_s=0, clock_same_host=True, clock_every_steps=2, clock_rounds=4)
    tr = tracer.attach(run, config=cfg)
    offsets = [tr.offset_ns]
    for step in range(5):
        tracer.step(step)
        dist.all_reduce(torch.ones(1))
        tr.join_clock(60.0)
    offsets.append(tr.offset_ns)
    tracer.close()
    return offsets


@pytest.mark.solo
def test_clock_offsets_are_estimated_and_re_estimated(tmp_path, ranks):
    run = str(tmp_path / "run")
    offsets = ranks(_clock, 2, run)
    assert offsets[0] == [0, 0]
    topo = read(run, "topology", "rank = 1")
    assert len(topo) == 3  # at attach, then at steps 2 and 4
    # one host, one kernel clock: the estimate is within its round trip of 0 (loose bound)
    assert all(abs(t["clock_offset_ns"]) < 50_000_000 for t in topo)
    # no row of the clock exchange leaks into the collectives table
    assert {r["op"] for r in read(run, "collectives")} == {"all_reduce"}


def _stacks_on_signal(rank: int, world: int, run: str) -> int:
    """Rank 0 blocks in a gloo recv; rank 1 asks it for stacks by signal, then releases it."""
    tr = tracer.attach(run, config=QUIET)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("pid0", str(os.getpid()))
        dist.recv(torch.empty(1), src=1)
        tracer.close()
        return len(read(run, "stacks", "rank = 0"))
    pid = int(store.get("pid0"))
    time.sleep(0.5)  # let rank 0 enter recv
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.isdir(f"{run}/stacks/rank=00000"):
        time.sleep(0.1)
    dist.send(torch.ones(1), dst=0)
    tracer.close()
    return tr.rank


def test_stacks_on_signal_while_main_thread_is_in_a_collective(tmp_path, ranks):
    run = str(tmp_path / "run")
    n_threads, _ = ranks(_stacks_on_signal, 2, run)
    assert n_threads >= 2
    stacks = read(run, "stacks", "rank = 0")
    assert {s["reason"] for s in stacks} == {"request"}
    main = [s for s in stacks if "MainThread" in s["thread"]]
    assert main and "recv" in main[0]["stack"]
    inflight = read(run, "collectives", "rank = 0 and op = 'recv'")
    assert len(inflight) == 1 and inflight[0]["end_ns"] is not None


def test_api_is_a_noop_without_a_tracer():
    assert tracer.current() is None
    with tracer.span("x") as s:
        assert s is None
    tracer.step(1)
    tracer.close()

    @tracer.spanned
    def f(x: int) -> int:
        return x + 1

    assert f(1) == 2


def _stacks_on_file(rank: int, world: int, run: str) -> int:
    """Rank 0 blocks in a gloo recv; rank 1 asks every rank for stacks with the trigger file
    (``python -m tracer.stacks RUN``), waits for both dumps, then releases rank 0."""
    from tracer import stacks

    tracer.attach(run, config=QUIET)
    if rank == 0:
        dist.recv(torch.empty(1), src=1)
        tracer.close()
        return 0
    time.sleep(0.5)  # let rank 0 enter recv
    code = stacks.main([run, "--wait", "60"])
    done = all(os.path.isdir(f"{run}/stacks/rank={r:05d}") for r in range(world))
    dist.send(torch.ones(1), dst=0)
    tracer.close()
    return code if done else -1


def test_stacks_on_request_through_the_trigger_file(tmp_path, ranks):
    run = str(tmp_path / "run")
    assert ranks(_stacks_on_file, 2, run) == [0, 0]
    stacks = read(run, "stacks")
    assert {(s["rank"], s["reason"]) for s in stacks} == {(0, "request"), (1, "request")}
    main0 = [s["stack"] for s in stacks if s["rank"] == 0 and "MainThread" in s["thread"]]
    main1 = [s["stack"] for s in stacks if s["rank"] == 1 and "MainThread" in s["thread"]]
    assert "recv" in main0[0] and "tracer/stacks.py" in main1[0]


# two processes pinned to one core: the scheduler shares it between them
_SHARED_CORE = """
import os, subprocess, sys, threading, time
from tracer.clock import cpu_mark, thread_since
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
burner = subprocess.Popen([sys.executable, "-c", f"import os\\nos.sched_setaffinity(0, {{{core}}})\\nwhile True: pass"])
try:
    time.sleep(0.5)
    mark = cpu_mark()
    while thread_since(mark)[0] < 200_000_000:
        pass
    other = []
    t = threading.Thread(target=lambda: other.append(thread_since(mark)[1]))
    t.start(); t.join()
    print(*thread_since(mark), other[0])
finally:
    burner.kill()
"""


@pytest.mark.skipif(not RUNQ_READABLE, reason="the system gives no per-thread run-queue delay")
def test_a_thread_sharing_its_core_counts_its_wait_for_it():
    """200 ms of CPU time on a core that another busy process shares: the thread waited for
    the core about as long as it ran (the scheduler shares it evenly), and a mark of another
    thread gives nothing."""
    out = subprocess.run(
        [sys.executable, "-c", _SHARED_CORE], capture_output=True, text=True, timeout=60,
        cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cpu, runq, other = out.stdout.split()
    assert int(cpu) >= 200_000_000 and int(runq) >= int(cpu) // 4, out.stdout
    assert other == "None"
