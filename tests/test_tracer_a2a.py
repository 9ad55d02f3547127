"""The tracer's ``a2a_sent`` work rows on a real 3-rank gloo run (docs/spec.md §2, ``work``).

Every all-to-all the script issues (``all_to_all_single`` with uneven and with even splits,
blocking and async, the list form ``all_to_all``, and ``torch.distributed.nn.functional``'s
``all_to_all_single`` forward and backward on a subgroup of ranks 0 and 2) must give one row per
group member, keyed by that member's global rank, whose value is the bytes sent to it, under the
group and seq of the call's ``collectives`` row.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.tables import QUIET, read

import tracer

WORLD = 3
ROW = (3,)  # one row of an all_to_all_single's input: 3 float64 = 24 bytes
ROW_BYTES = 24


def _splits(rank: int, n: int) -> list[int]:
    """Uneven split sizes: rank r sends r + j + 1 rows to group rank j (j + 1 for j = r)."""
    return [rank + j + 1 if j != rank else j + 1 for j in range(n)]


def _a2a_script(rank: int, world: int, run: str) -> list[dict[int, int]]:
    """Issue the all-to-alls; return, in call order, the bytes this rank sent to each peer."""
    sub = dist.new_group([0, 2])
    tracer.attach(run, config=QUIET)
    sent: list[dict[int, int]] = []
    dist.all_reduce(torch.ones(4))  # no work rows
    ins = _splits(rank, world)
    outs = [_splits(src, world)[rank] for src in range(world)]
    x = torch.ones(sum(ins), *ROW, dtype=torch.float64)
    y = torch.empty(sum(outs), *ROW, dtype=torch.float64)
    dist.all_to_all_single(y, x, output_split_sizes=outs, input_split_sizes=ins)
    sent.append({peer: n * ROW_BYTES for peer, n in enumerate(ins)})
    even = torch.ones(2 * world, *ROW, dtype=torch.float64)
    dist.all_to_all_single(torch.empty_like(even), even, async_op=True).wait()
    sent.append(dict.fromkeys(range(world), 2 * ROW_BYTES))
    # gloo's list form takes tensors of one size only: 5 int32 = 20 bytes to each peer
    tensors = [torch.ones(5, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all([torch.empty(5, dtype=torch.int32) for _ in range(world)], tensors)
    sent.append(dict.fromkeys(range(world), 20))
    if rank in (0, 2):
        sent += _nn_functional_on_subgroup(rank, sub)
    # DDP on the default group renames it "dp": buffered work rows follow, as collectives do
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    tracer.close()
    return sent


def _nn_functional_on_subgroup(rank: int, sub: dist.ProcessGroup) -> list[dict[int, int]]:
    """The autograd all_to_all_single on ranks {0, 2}: forward with uneven splits, then the
    backward's all_to_all, which sends back what the forward received."""
    from torch.distributed.nn.functional import all_to_all_single

    me = dist.get_rank(sub)
    splits = [[1, 2], [3, 1]]  # group rank i sends splits[i][j] rows to group rank j
    ins = splits[me]
    outs = [splits[src][me] for src in range(2)]
    x = torch.ones(sum(ins), *ROW, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = all_to_all_single(torch.empty(sum(outs), *ROW, dtype=torch.float64), x,
                              outs, ins, group=sub)  # fmt: skip
    y.sum().backward()
    peers = (0, 2)
    return [
        {peers[j]: n * ROW_BYTES for j, n in enumerate(ins)},
        {peers[j]: n * ROW_BYTES for j, n in enumerate(outs)},
    ]


@pytest.fixture(scope="module")
def a2a_run(tmp_path_factory, ranks) -> tuple[str, list]:
    run = str(tmp_path_factory.mktemp("a2a") / "run")
    return run, ranks(_a2a_script, WORLD, run)


def _work_by_call(run: str, rank: int) -> list[tuple[dict, dict[int, int]]]:
    """This rank's all_to_all collectives rows in call order, each with its a2a_sent rows
    (joined on group and seq) as {key: value}."""
    calls = read(run, "collectives", f"rank = {rank} and op = 'all_to_all'")
    work = read(run, "work", f"rank = {rank} and kind = 'a2a_sent'")
    out = []
    for call in sorted(calls, key=lambda r: r["issue_ns"]):
        mine = [w for w in work if (w["group"], w["seq"]) == (call["group"], call["seq"])]
        assert all(w["step"] == call["step"] for w in mine)
        assert all(w["microbatch"] == call["microbatch"] for w in mine)
        assert len({w["key"] for w in mine}) == len(mine), "one row per peer"
        out.append((call, {w["key"]: w["value"] for w in mine}))
    return out


def test_a2a_sent_rows_give_the_bytes_sent_to_each_peer(a2a_run):
    run, sent = a2a_run
    for rank in range(WORLD):
        calls = _work_by_call(run, rank)
        assert [by_peer for _, by_peer in calls] == sent[rank]
        for call, by_peer in calls:
            assert sum(by_peer.values()) == call["nbytes"]
            assert len(by_peer) == call["group_size"]
    work = read(run, "work")
    assert {w["kind"] for w in work} == {"a2a_sent"}  # the all_reduce gives none
    assert len(work) == 3 * 3 * WORLD + 2 * 2 * 2


def test_a2a_sent_rows_match_what_each_peer_received(a2a_run):
    """Summed over senders, the rows keyed by a rank are what that rank's outputs held."""
    run, _ = a2a_run
    world_calls = {(c["group"], c["seq"]) for c in read(run, "collectives", "group_size = 3")}
    assert {g for g, _ in world_calls} == {"dp"}
    got: dict[tuple[int, int], int] = {}
    for w in read(run, "work", "kind = 'a2a_sent'"):
        if (w["group"], w["seq"]) in world_calls:
            got[w["seq"], w["key"]] = got.get((w["seq"], w["key"]), 0) + w["value"]
    seqs = sorted({s for s, _ in got})
    assert len(seqs) == 3
    first, even, listed = seqs
    for rank in range(WORLD):
        assert (
            got[first, rank] == sum(_splits(src, WORLD)[rank] for src in range(WORLD)) * ROW_BYTES
        )
        assert got[even, rank] == WORLD * 2 * ROW_BYTES
        assert got[listed, rank] == WORLD * 20


def test_a2a_sent_keys_are_global_ranks_on_a_subgroup(a2a_run):
    """nn.functional's all_to_all_single on ranks {0, 2} is captured, forward and backward,
    and its rows name peers by global rank (group rank 1 is global rank 2)."""
    run, sent = a2a_run
    for rank in (0, 2):
        sub_calls = [(c, p) for c, p in _work_by_call(run, rank) if c["group_size"] == 2]
        assert len(sub_calls) == 2
        assert all(set(by_peer) == {0, 2} for _, by_peer in sub_calls)
        assert [p for _, p in sub_calls] == sent[rank][3:]
    assert not [c for c, _ in _work_by_call(run, 1) if c["group_size"] == 2]


def test_split_sizes_are_read_from_host_lists_only():
    """Per-peer bytes come from the arguments: given splits, an even split without them, and
    nothing (not a device read) when the splits are a tensor."""
    from tracer.opspecs import OP_SPECS

    sent = OP_SPECS["all_to_all_single"].sent
    x = torch.ones(4, 2)  # rows of 8 bytes

    def args(splits: object):
        return lambda name, idx: {"input": x, "input_split_sizes": splits}.get(name)

    assert sent(args([1, 3]), 2) == [8, 24]
    assert sent(args(None), 2) == [16, 16]
    assert sent(args([]), 2) == [16, 16]
    assert sent(args(torch.tensor([1, 3])), 2) is None


def _failing_ranks(rank: int, world: int, run: str) -> tuple[bool, bool, list[float]]:
    """The group's ranks cannot be read: tracing turns off, the all_to_all still runs."""
    import tracer.collectives

    def broken(pg: object) -> list[int]:
        raise RuntimeError("no ranks")

    tr = tracer.attach(run, config=QUIET)
    tracer.collectives.dist.get_process_group_ranks = broken
    x = torch.arange(2.0) + 10 * rank
    y = torch.empty(2)
    work = dist.all_to_all_single(y, x, async_op=True)
    traced = type(work).__name__ == "TracedWork"
    work.wait()
    enabled = tr.enabled
    tracer.close()
    return traced, enabled, y.tolist()


def test_a_failure_in_the_a2a_rows_turns_tracing_off_and_the_call_goes_on(tmp_path, ranks):
    got = ranks(_failing_ranks, 2, str(tmp_path / "run"))
    for rank, (traced, enabled, received) in enumerate(got):
        assert traced and not enabled  # its Work still ends the collectives row
        assert received == [float(rank), 10.0 + rank]
