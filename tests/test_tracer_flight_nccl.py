"""The tracer's Flight Recorder reader on NCCL's own ring, fed the real buffers of a
ProcessGroupNCCL (tests/data/flight_recorder/nccl_world1, taken on an H200) in a real
one-rank process group: DDP's reducer collectives become rows with the device's durations, an
entry in flight is written once it completes, a ring read under two names (one recorder, as on
PyTorch's main branch) counts each collective once, and a ring that wrapped counts only what
no wrapper saw."""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

from tracer.flight import FlightReader

DATA = os.path.join(os.path.dirname(__file__), "data", "flight_recorder", "nccl_world1")
N = 18  # entries in every dump


def _dump(name: str) -> bytes:
    with open(os.path.join(DATA, f"{name}.pkl"), "rb") as f:
        return f.read()


EMPTY = pickle.dumps({"version": "2.10", "entries": []})


class Ring:
    """A ring whose buffer the test sets: what ``_dump_nccl_trace`` returned at each read."""

    def __init__(self) -> None:
        self.raw = EMPTY

    def __call__(self) -> bytes:
        return self.raw


def _issue(n: int) -> None:
    """n real collectives on the world group (unwrapped: its counter moves as NCCL's did)."""
    t = torch.ones(1)
    for _ in range(n):
        dist.all_reduce(t)


def _reader(rings: list) -> FlightReader:
    return FlightReader(lambda pg: ("dp", 1, pg), lambda ns: 0, rings=rings)


def _read_in_flight_then_done(rank: int, world: int, timing: str) -> dict:
    ring = Ring()
    reader = _reader([("nccl", ring)])
    _issue(N)
    ring.raw = _dump(f"nccl_{timing}_inflight")
    first = reader.read()
    ring.raw = _dump(f"nccl_{timing}_done")
    later = reader.read()
    again = reader.read(final=True)
    return {"first": first, "later": later, "again": again, "dropped": reader.dropped,
            "timed": reader.timed}  # fmt: skip


def _entries(name: str) -> list[dict]:
    return pickle.loads(_dump(name))["entries"]


def test_nccl_entries_become_rows_with_device_durations(ranks):
    out = ranks(_read_in_flight_then_done, 1, "timing")[0]
    first, later = out["first"], out["later"]
    # the 1 GiB all_reduce was still scheduled: left for a later read, not written half-done
    assert [r[5] for r in first] == list(range(1, N))
    assert [r[5] for r in later] == [N] and out["again"] == []
    assert out["dropped"] == 0 and out["timed"] == N
    entries = {e["collective_seq_id"]: e for e in _entries("nccl_timing_done")}
    for row in first + later:
        step, mb, op, group, size, seq, peer, nbytes, dtype, issue, start, end, source = row
        e = entries[seq]
        assert source == "flight_recorder" and group == "dp" and peer == -1
        # the device's duration, ending when the watchdog found the work complete
        assert abs((end - start) - e["duration_ms"] * 1e6) < 2
        assert end - issue == e["time_discovered_completed_ns"] - e["time_created_ns"]
    ops = [r[2] for r in first + later]
    assert ops.count("all_reduce") == 10 and ops.count("broadcast") == 5
    assert {"all_gather", "reduce_scatter"} <= set(ops)
    big = later[0]
    assert big[2] == "all_reduce" and big[7] == (1 << 28) * 4 and big[8] == "float32"


def test_without_timing_the_start_is_the_issue(ranks):
    out = ranks(_read_in_flight_then_done, 1, "notiming")[0]
    rows = out["first"] + out["later"]
    assert len(rows) == N and out["timed"] == 0
    assert all(r[10] == r[9] and r[11] > r[9] and r[12] == "flight_recorder" for r in rows)


def _final_while_in_flight(rank: int, world: int) -> dict:
    ring = Ring()
    reader = _reader([("nccl", ring)])
    _issue(N)
    ring.raw = _dump("nccl_timing_inflight")
    return {"rows": reader.read(final=True)}


def test_a_final_read_writes_what_is_in_flight_with_no_end(ranks):
    rows = ranks(_final_while_in_flight, 1)[0]["rows"]
    assert len(rows) == N
    last = rows[-1]
    assert last[5] == N and last[11] is None and last[12] == "untimed"


def _one_recorder_two_names(rank: int, world: int) -> dict:
    generic, nccl = Ring(), Ring()
    reader = _reader([("generic", generic), ("nccl", nccl)])
    _issue(N)
    generic.raw = nccl.raw = _dump("nccl_timing_done")
    return {"rows": reader.read() + reader.read(final=True)}


def test_one_recorder_read_under_two_names_counts_each_collective_once(ranks):
    rows = ranks(_one_recorder_two_names, 1)[0]["rows"]
    assert sorted(r[5] for r in rows) == list(range(1, N + 1))


def _wrapped(rank: int, world: int, noted: bool) -> dict:
    ring = Ring()
    reader = _reader([("nccl", ring)])
    _issue(N)
    pg = dist.group.WORLD
    if noted:  # every collective went through the wrappers: the ring's losses lose nothing
        reader.note(pg, 1, N)
    done = pickle.loads(_dump("nccl_timing_done"))
    done["entries"] = done["entries"][10:]  # the ring kept the last 8 of 18
    ring.raw = pickle.dumps(done)
    rows = reader.read(final=True)
    return {"rows": len(rows), "dropped": reader.dropped}


def test_a_wrapped_ring_counts_only_what_no_wrapper_recorded(ranks):
    assert ranks(_wrapped, 1, False)[0] == {"rows": 8, "dropped": 10}
    assert ranks(_wrapped, 1, True)[0] == {"rows": 0, "dropped": 0}
