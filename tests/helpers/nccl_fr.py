"""NCCL-shaped Flight Recorder sets with known culprits, made by editing copies of real entries.

The project's machines have no GPU, so NCCL dumps cannot be made here by real processes. This
module builds them the way NCCL's Flight Recorder would record a job, from the entries, the
``pg_config`` and the ``pg_status`` of the real Megatron set in
``tests/data/flight_recorder/gpu_error_2nd`` (every entry is a copy of a real one with its
group, sequence numbers, name, sizes, state and times edited):

* a job: a dp x pp x tp mesh in the SPEC's rank order, plus an expert-parallel group per
  pipeline stage (``all_to_all``); groups described as Megatron describes them, or left
  ``undefined`` (named by number only);
* a program per rank: per iteration, microbatches forward (receive from the previous stage,
  tensor-parallel all-gather, two expert all-to-alls, reduce-scatter, send to the next) and
  backward (gradients received and sent back in ``batch_isend_irecv`` batches, recorded as
  their send/recv entries plus one ``coalesced`` entry), a data-parallel all-reduce, a loss
  all-reduce over the pipeline, and a host sync (the CPU waits for its GPU);
* NCCL's semantics: the CPU enqueues without waiting (until a host sync); each rank's GPU runs
  its queue in order, and an operation runs when every member has it at the head of its queue
  (a send when the receiver is at the matching receive);
* faults: ``dead_gpu`` (the rank's GPU stops at an operation; its CPU enqueues a couple more
  and then hangs in a CUDA call: ``GPU_ERROR`` in the NVIDIA sets), ``cpu_stop`` (the rank stops enqueueing:
  a hang, or a held GIL), ``killed`` (both, and the rank leaves no dump);
* dumps as NCCL writes them: ``only_active`` (the entries not yet retired, as on a watchdog
  timeout) or the whole ring buffer of ``buffer`` entries with ``completed`` states and, with
  ``timing``, start and completion times; pickle or JSON; send/recv on the pipeline groups
  (local ranks) or on the default group (global ranks: a middle stage then talks to two peers
  in one group, so NCCL's per-group p2p numbers differ across pairs).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field

from helpers.paths import DATA

TEMPLATE = os.path.join(DATA, "flight_recorder", "gpu_error_2nd", "_dump_9")

DESCS = {
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
    "ep": "EXPERT_MODEL_PARALLEL_GROUP",
}


GPU_ERROR_CPU_LAG = 2  # operations a rank still enqueues after its GPU died


@dataclass(frozen=True)
class Fault:
    kind: str  # dead_gpu | cpu_stop | killed
    rank: int
    iteration: int
    op: str  # the first op of this kind ("tp", "ep", "send", "recv", "batch", "dp") ...
    nth: int = 0  # ... the nth of them in that iteration


@dataclass(frozen=True)
class Job:
    name: str
    dp: int = 2
    pp: int = 2
    tp: int = 2
    ep: bool = True
    microbatches: int = 2
    iterations: int = 3
    named: bool = True  # Megatron descriptions, else "undefined"
    p2p_on_default: bool = False
    faults: tuple[Fault, ...] = ()
    only_active: bool = True
    timing: bool = False
    buffer: int = 200
    fmt: str = "pickle"
    what: str = ""

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def culprits(self) -> list[int]:
        return sorted({f.rank for f in self.faults})


@dataclass
class _Op:
    kind: str  # coll | send | recv | batch
    axis: str  # tp | ep | dp | pp | default
    name: str  # nccl op name
    peers: tuple[tuple[str, int], ...] = ()  # for p2p / batch: (("send"|"recv", peer), ...)
    size: tuple[int, ...] = (1024,)
    it: int = 0
    tag: str = ""
    sync: bool = False


@dataclass
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass
class _Rank:
    rank: int
    program: list[_Op]
    pc: int = 0
    queue: list[int] = field(default_factory=list)  # entry indices of works not yet run
    works: list[dict] = field(default_factory=list)  # one per enqueued work
    entries: list[dict] = field(default_factory=list)
    seq_coll: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seq_p2p: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    op_id: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    enq: dict[str, int] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)


def _coords(rank: int, job: Job) -> tuple[int, int, int]:
    pp, rest = divmod(rank, job.dp * job.tp)
    dp, tp = divmod(rest, job.tp)
    return pp, dp, tp


def _rank_of(pp: int, dp: int, tp: int, job: Job) -> int:
    return (pp * job.dp + dp) * job.tp + tp


def _groups(job: Job) -> dict[str, list[_Group]]:
    """Groups in creation order, as Megatron creates them (names are numbers)."""
    out: dict[str, list[_Group]] = defaultdict(list)
    counter = 1
    out["default"].append(_Group("0", "default_pg", tuple(range(job.world))))

    def add(axis: str, ranks: list[int]) -> None:
        nonlocal counter
        desc = DESCS[axis] if job.named else "undefined"
        out[axis].append(_Group(str(counter), desc, tuple(sorted(ranks))))
        counter += 1

    for p in range(job.pp):
        for d in range(job.dp):
            add("tp", [_rank_of(p, d, t, job) for t in range(job.tp)])
    for p in range(job.pp):
        for t in range(job.tp):
            add("dp", [_rank_of(p, d, t, job) for d in range(job.dp)])
    for d in range(job.dp):
        for t in range(job.tp):
            add("pp", [_rank_of(p, d, t, job) for p in range(job.pp)])
    if job.ep:
        for p in range(job.pp):
            add("ep", [_rank_of(p, d, t, job) for d in range(job.dp) for t in range(job.tp)])
    return out


def _program(rank: int, job: Job) -> list[_Op]:
    s, _, _ = _coords(rank, job)
    groups = _groups(job)
    pp_group = next(g for g in groups["pp"] if rank in g.ranks)
    prev = pp_group.ranks[s - 1] if s > 0 else None
    nxt = pp_group.ranks[s + 1] if s < job.pp - 1 else None
    p2p_axis = "default" if job.p2p_on_default else "pp"
    act = (2048, 1, 512)
    prog: list[_Op] = []
    for it in range(job.iterations):
        for _mb in range(job.microbatches):
            if prev is not None:
                prog.append(_Op("recv", p2p_axis, "recv", (("recv", prev),), act, it, "recv"))
            prog.append(_Op("coll", "tp", "_all_gather_base", size=act, it=it, tag="tp"))
            if job.ep:
                prog.append(_Op("coll", "ep", "all_to_all", size=(2048, 512), it=it, tag="ep"))
                prog.append(_Op("coll", "ep", "all_to_all", size=(2048, 512), it=it, tag="ep"))
            prog.append(_Op("coll", "tp", "_reduce_scatter_base", size=act, it=it, tag="tp"))
            if nxt is not None:
                prog.append(_Op("send", p2p_axis, "send", (("send", nxt),), act, it, "send"))
        for _mb in range(job.microbatches):
            if nxt is not None:
                prog.append(_Op("batch", p2p_axis, "coalesced", (("recv", nxt),), act, it, "batch"))
            prog.append(_Op("coll", "tp", "_all_gather_base", size=act, it=it, tag="tp"))
            prog.append(_Op("coll", "tp", "_reduce_scatter_base", size=act, it=it, tag="tp"))
            if prev is not None:
                prog.append(
                    _Op("batch", p2p_axis, "coalesced", (("send", prev),), act, it, "batch")
                )
        prog.append(_Op("coll", "dp", "all_reduce", size=(4096,), it=it, tag="dp"))
        prog.append(_Op("coll", "pp", "all_reduce", size=(1,), it=it, tag="pp", sync=True))
    return prog


def _fault_index(job: Job, rank: int, fault: Fault) -> int:
    seen = 0
    for i, op in enumerate(_program(rank, job)):
        if op.it == fault.iteration and op.tag == fault.op:
            if seen == fault.nth:
                return i
            seen += 1
    raise ValueError(f"no {fault.op} #{fault.nth} in iteration {fault.iteration} on {rank}")


def _template() -> dict:
    with open(TEMPLATE, "rb") as f:
        dump = pickle.load(f)  # the project's own fixture (plain data)
    return dump


def simulate(  # noqa: C901 -- one event loop of the NCCL model, step by step as the spec reads; split, it hides the order
    job: Job, effective: set[int] | None = None, state: dict | None = None
) -> dict[int, dict]:
    """Run ``job`` to a standstill; return each rank's dump (killed ranks have none).
    ``effective`` (filled in): the faulty ranks that reached their fault. ``state`` (filled
    in): ``ranks`` (rank -> its works, the ones never run still queued), ``groups`` and
    ``stop_gpu`` (rank -> the program index its GPU dies at), for :mod:`fr_truth`."""
    effective = set() if effective is None else effective
    real = _template()
    proto = dict(real["entries"][0])
    groups = _groups(job)
    member_of: dict[int, dict[str, _Group]] = defaultdict(dict)
    order: dict[int, list[_Group]] = defaultdict(list)  # each rank's groups, creation order
    for axis in ("default", "tp", "dp", "pp", "ep"):
        for g in groups.get(axis, []):
            for r in g.ranks:
                member_of[r][axis] = g
                order[r].append(g)
    pg_id = {r: {g.name: i for i, g in enumerate(gs)} for r, gs in order.items()}
    ranks = {r: _Rank(r, _program(r, job)) for r in range(job.world)}
    stop_cpu = {  # a dead GPU's CPU gets stuck in one of its next CUDA calls
        f.rank: _fault_index(job, f.rank, f) + (GPU_ERROR_CPU_LAG if f.kind == "dead_gpu" else 0)
        for f in job.faults
    }
    stop_gpu = {f.rank: _fault_index(job, f.rank, f) for f in job.faults if f.kind != "cpu_stop"}
    clock = [1_758_580_000_000_000_000]

    def tick(ns: int = 37_000) -> int:
        clock[0] += ns
        return clock[0]

    def entry(r: _Rank, g: _Group, op: _Op, name: str, p2p: bool, in_size) -> dict:
        e = copy.deepcopy(proto)
        key = g.name
        r.op_id[key] += 1
        e.update(
            record_id=len(r.entries) + 1000 * r.rank,
            pg_id=pg_id[r.rank][g.name],
            process_group=(g.name, g.desc),
            thread_name="python3" if op.kind != "coll" else "pt_autograd_1",
            collective_seq_id=r.seq_coll[key],
            p2p_seq_id=r.seq_p2p[key] if p2p else 0,
            op_id=r.op_id[key],
            profiling_name=f"nccl:{name}",
            time_created_ns=tick(),
            input_sizes=[list(in_size)],
            input_dtypes=["BFloat16"],
            output_sizes=[list(in_size)],
            output_dtypes=["BFloat16"],
            state="scheduled",
            time_discovered_started_ns=None,
            time_discovered_completed_ns=None,
            retired=False,
            is_p2p=p2p,
        )
        r.entries.append(e)
        return e

    def local(g: _Group, rank: int) -> int:
        return rank if g.desc == "default_pg" else g.ranks.index(rank)

    def issue(r: _Rank) -> bool:
        if r.pc >= len(r.program) or stop_cpu.get(r.rank, 1 << 60) <= r.pc:
            return False
        op = r.program[r.pc]
        if r.pc > 0 and r.program[r.pc - 1].sync and r.queue:
            return False  # the host sync after the previous op: wait for the GPU
        g = member_of[r.rank][op.axis]
        key = g.name
        me = local(g, r.rank)
        work = {"rank": r.rank, "group": g.name, "entries": [], "op": op, "index": r.pc}
        if op.kind == "coll":
            r.seq_coll[key] += 1
            work["seq"] = ("coll", r.seq_coll[key])
            work["entries"].append(entry(r, g, op, op.name, False, op.size))
        else:
            r.seq_p2p[key] += 1
            work["seq"] = ("p2p", r.seq_p2p[key])
            for direction, peer in op.peers:
                other = local(g, peer)
                name = f"send {me}->{other}" if direction == "send" else f"recv {me}<-{other}"
                work["entries"].append(entry(r, g, op, name, True, op.size))
            if op.kind == "batch":
                work["entries"].append(entry(r, g, op, "coalesced", True, op.size))
        r.enq[key] = work["seq"][1]
        r.works.append(work)
        r.queue.append(len(r.works) - 1)
        r.pc += 1
        return True

    defaultdict(int)  # (src, dst) -> sends run

    def head(r: _Rank) -> dict | None:
        if not r.queue:
            return None
        w = r.works[r.queue[0]]
        if stop_gpu.get(r.rank, 1 << 60) <= w["index"]:
            return None
        return w

    def runnable(w: dict) -> list[dict] | None:
        op: _Op = w["op"]
        if op.kind == "coll":
            g = next(gg for gg in groups[op.axis] if gg.name == w["group"])
            ws = []
            for m in g.ranks:
                hw = head(ranks[m])
                if hw is None or hw["group"] != w["group"] or hw["seq"] != w["seq"]:
                    return None
                ws.append(hw)
            return ws
        ws = [w]
        for direction, peer in op.peers:
            hw = head(ranks[peer])
            if hw is None or hw["op"].kind == "coll":
                return None
            want = "recv" if direction == "send" else "send"
            if (want, w["rank"]) not in hw["op"].peers:
                return None
            ws.append(hw)
        return ws

    def run(ws: list[dict]) -> None:
        t0 = tick(5_000)
        t1 = tick(200_000)
        for w in ws:
            r = ranks[w["rank"]]
            r.queue.remove(r.works.index(w))
            r.done[w["group"]] = w["seq"][1]
            for e in w["entries"]:
                e.update(state="completed", retired=True)
                if job.timing:
                    e.update(time_discovered_started_ns=t0, time_discovered_completed_ns=t1)

    progress = True
    while progress:
        progress = False
        for r in ranks.values():
            while issue(r):
                progress = True
        for r in ranks.values():
            w = head(r)
            if w is None:
                continue
            ws = runnable(w)
            if ws:
                run(ws)
                progress = True

    if job.timing:  # a kernel that a live GPU has at the head of its queue has started
        for r in ranks.values():
            w = head(r)
            for e in w["entries"] if w else ():
                e.update(state="started", time_discovered_started_ns=tick(1_000))
    if state is not None:
        state.update(ranks=ranks, groups=groups, stop_gpu=stop_gpu)
    effective.clear()
    for f in job.faults:  # a fault downstream of another one may never be reached
        r = ranks[f.rank]
        at = _fault_index(job, f.rank, f)
        if f.kind == "dead_gpu":  # its GPU got to the operation it died in, or its CPU
            reached = bool(r.queue) and r.works[r.queue[0]]["index"] == at  # to where it hung
            reached |= r.pc == at + GPU_ERROR_CPU_LAG
        else:  # its CPU got as far as the operation it never issued
            reached = r.pc == at
        if reached:
            effective.add(f.rank)
    dumps = {}
    killed = {f.rank for f in job.faults if f.kind == "killed"}
    for r in ranks.values():
        if r.rank in killed:
            continue
        entries = r.entries
        if job.only_active:
            entries = [e for e in entries if not e["retired"]]
        entries = entries[-job.buffer :]
        config = {
            g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
            for g in order[r.rank]
        }
        status = {}
        for g in order[r.rank]:
            started = -1
            w = head(r) if job.timing else None
            if w is not None and w["group"] == g.name:
                started = w["seq"][1]
            status[str(pg_id[r.rank][g.name])] = {
                "last_enqueued_collective": r.enq.get(g.name, -1),
                "last_started_collective": started,
                "last_completed_collective": r.done.get(g.name, -1),
            }
        dumps[r.rank] = {
            "version": real["version"],
            "pg_config": config,
            "nccl_version": real["nccl_version"],
            "pg_status": status,
            "entries": entries,
        }
    return dumps


def write(job: Job, out: str, compress: bool = True) -> list[int]:
    """Simulate ``job`` and write its dumps and ``fault_injection.log`` to ``out``; return the
    culprits (the faulty ranks that reached their fault)."""
    os.makedirs(out, exist_ok=True)
    effective: set[int] = set()
    for rank, dump in simulate(job, effective).items():
        if job.fmt == "json":
            data, name = json.dumps(dump).encode(), f"rank_{rank}.json"
        else:
            data, name = pickle.dumps(dump, protocol=4), f"_dump_{rank}"
        if compress:
            data, name = gzip.compress(data, mtime=0), name + ".gz"
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    with open(os.path.join(out, "fault_injection.log"), "w") as f:
        f.write(f"Fault ranks: {sorted(effective)}\n")
        for flt in job.faults:
            f.write(
                f"Rank {flt.rank}, fault_type: {flt.kind} at {flt.op} #{flt.nth} of iteration "
                f"{flt.iteration}\n"
            )
        f.write(f"Simulated NCCL job ({job.dp}x{job.pp}x{job.tp}): {job.what}\n")
    return sorted(effective)


JOBS = {
    j.name: j
    for j in [
        Job("nccl_dead_gpu_in_tp", faults=(Fault("dead_gpu", 5, 1, "tp", 1),),
            what="rank 5's GPU dies inside a tp collective; pipeline neighbours wait in send/recv"),
        Job("nccl_two_dead_gpus_ep", dp=2, pp=2, tp=4, named=False, only_active=False,
            timing=True, fmt="json",
            faults=(Fault("dead_gpu", 2, 1, "ep", 0), Fault("dead_gpu", 5, 1, "ep", 0)),
            what="two GPUs fail in one expert all_to_all; groups named by number; whole buffers, times"),
        Job("nccl_cpu_stop_before_batch", faults=(Fault("cpu_stop", 6, 1, "batch", 0),),
            what="rank 6 stops enqueueing (held GIL) before a batched send"),
        Job("nccl_killed_no_dump", only_active=False, faults=(Fault("killed", 3, 1, "ep", 1),),
            fmt="json", what="rank 3 is killed (no dump) before an expert all_to_all"),
        Job("nccl_pp4_default_pg_p2p", dp=1, pp=4, tp=2, ep=False, p2p_on_default=True,
            faults=(Fault("dead_gpu", 4, 1, "tp", 2),),
            what="pp=4 with send/recv on the default group (middle stages talk to two peers)"),
    ]
}  # fmt: skip


if __name__ == "__main__":
    import sys

    root = sys.argv[1]
    for name in sys.argv[2:] or list(JOBS):
        write(JOBS[name], os.path.join(root, name))
        print(name)
