"""Turn one reduced Kineto trace (:class:`RawTrace`) into SPEC rows.

Times: Kineto writes microseconds (floats); with ``baseTimeNanoseconds`` they are relative to
it, otherwise absolute. Both become int64 nanoseconds.

Spans (``source`` cuda): every kernel, memcpy and memset. ``kind`` is ``comm`` for NCCL
kernels (``ncclKernel_*`` and ``ncclDevKernel_*``), ``memory`` for memcpy/memset (a kind this
importer adds to the SPEC's four: Holistic Trace Analysis counts memory ops as non-compute),
``compute`` otherwise. A span's ``step`` is the ``ProfilerStep#N`` in which its launch (found
through the correlation id) began: the latest step that started at or before the launch, -1
before the first. Each ``ProfilerStep#N`` also becomes a host span named ``step``.

Collectives: one row per NCCL kernel, with the arguments recent PyTorch records on it
(``Collective name``, ``In msg nelems``, ``dtype``, ``Group size``, ``Process Group Name`` /
``Description`` / ``Ranks``, ``Seq``); what a kernel lacks comes from the host annotation
(``nccl:all_to_all``) that encloses its launch, then from the kernel's name. A trace without
NCCL kernels (CPU, gloo) gives one row per ``gloo:*`` / ``nccl:*`` annotation instead, its
``issue_ns`` taken from the matching ``c10d::*`` call. ``seq`` is the recorded ``Seq`` or,
failing that, the collective's ordinal within its group on this rank (1, 2, ...).
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

from analyzer.importers.common import dtype_bytes, empty_columns, normalize_op, numel
from analyzer.importers.groups import Group, parse_ranks
from analyzer.importers.kineto_parse import RawTrace

UNKNOWN_GROUP = "unknown"


class Clock:
    """Kineto microseconds -> int64 nanoseconds on the trace's own clock."""

    def __init__(self, base_ns: Any) -> None:
        self.base = int(base_ns) if isinstance(base_ns, (int, float)) else 0

    def ns(self, ts_us: Any) -> int:
        if isinstance(ts_us, int):
            return self.base + ts_us * 1000
        return self.base + int(round(float(ts_us) * 1000.0))


def _dur_ns(dur_us: Any) -> int:
    return dur_us * 1000 if isinstance(dur_us, int) else int(round(float(dur_us) * 1000.0))


def device_kind(name: str, cat: str) -> str:
    """compute | comm | memory, as the module docstring defines them."""
    if "nccl" in name.lower():
        return "comm"
    if (
        cat in ("gpu_memcpy", "gpu_memset", "Memcpy", "Memset")
        or "Memcpy" in name
        or "Memset" in name
    ):
        return "memory"
    return "compute"


class StepIndex:
    """``ProfilerStep#N`` intervals: which step a host time falls in."""

    def __init__(self, steps: list[tuple[int, float, float]]) -> None:
        self.steps = sorted(steps, key=lambda s: s[1])
        self.starts = [s[1] for s in self.steps]

    def at(self, ts_us: float) -> int:
        i = bisect.bisect_right(self.starts, ts_us) - 1
        return self.steps[i][0] if i >= 0 else -1


class Enclosing:
    """Per host thread, the collective annotations: the one that encloses a launch."""

    def __init__(self, comm: list[tuple]) -> None:
        self.by_tid: dict[Any, list[tuple]] = defaultdict(list)
        for c in comm:
            self.by_tid[c[3]].append(c)
        self.starts: dict[Any, list[float]] = {}
        for tid, items in self.by_tid.items():
            items.sort(key=lambda c: c[1])
            self.starts[tid] = [c[1] for c in items]

    def find(self, ts_us: float, tid: Any) -> tuple | None:
        items = self.by_tid.get(tid)
        if not items:
            return None
        i = bisect.bisect_right(self.starts[tid], ts_us) - 1
        for j in range(i, max(i - 4, -1), -1):
            name, start, dur, _, _ = items[j]
            if start <= ts_us <= start + dur:
                return items[j]
        return None


def span_rows(raw: RawTrace, rank: int, clock: Clock) -> dict[str, list[Any]]:
    """Device spans and host step spans of one rank (see the module docstring)."""
    cols = empty_columns("spans")
    steps = StepIndex(raw.steps)
    out = (cols["rank"], cols["step"], cols["microbatch"], cols["name"], cols["kind"],
           cols["start_ns"], cols["end_ns"], cols["source"])  # fmt: skip
    for name, cat, ts, dur, _stream, corr, _args in raw.device:
        launch = raw.launches.get(corr)
        start = clock.ns(ts)
        values = (rank, steps.at(launch[0] if launch else ts), -1, name, device_kind(name, cat),
                  start, start + _dur_ns(dur), "cuda")  # fmt: skip
        for col, v in zip(out, values, strict=True):
            col.append(v)
    for step, ts, dur in steps.steps:
        start = clock.ns(ts)
        values = (rank, step, -1, "step", "host", start, start + _dur_ns(dur), "host")
        for col, v in zip(out, values, strict=True):
            col.append(v)
    return cols


def groups_of(raw: RawTrace) -> dict[str, Group]:
    """Process groups the trace knows: ``distributedInfo.pg_config`` and collective args."""
    out: dict[str, Group] = {}
    info = raw.meta.get("distributedInfo") or {}
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and pg.get("pg_name") is not None:
            name = str(pg["pg_name"])
            out[name] = Group(name, str(pg.get("pg_desc", "")), parse_ranks(pg.get("ranks")))
    arg_sets = [d[6] for d in raw.device if d[6]] + [p[2] for p in raw.params]
    for args in arg_sets:
        name = args.get("Process Group Name")
        if name is None or str(name) in out:
            continue
        ranks = parse_ranks(args.get("Process Group Ranks"))
        out[str(name)] = Group(str(name), str(args.get("Process Group Description", "")), ranks)
    return out


def _op_from_kernel(name: str) -> str | None:
    """``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` -> ``all_reduce``."""
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if name.startswith(prefix):
            token = name[len(prefix) :].split("_")[0].split("(")[0]
            return normalize_op(token)
    return None


def _nbytes(args: Mapping[str, Any], annotation: tuple | None) -> tuple[int, str]:
    """Bytes moved and dtype: ``In msg nelems`` x dtype, else the annotation's input."""
    dtype = str(args.get("dtype", ""))
    nelems = args.get("In msg nelems")
    if isinstance(nelems, int) and dtype:
        return nelems * dtype_bytes(dtype), dtype.lower()
    if annotation:
        a = annotation[4]
        dims, types = a.get("Input Dims") or [], a.get("Input type") or []
        if dims and types:
            return numel(dims[0]) * dtype_bytes(types[0]), str(types[0]).lower()
    return 0, dtype.lower()


def _append(cols: dict[str, list[Any]], row: Mapping[str, Any]) -> None:
    for k, v in row.items():
        cols[k].append(v)


def _kernel_rows(raw: RawTrace, rank: int, clock: Clock, labels: Mapping[str, str],
                 groups: Mapping[str, Group]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per NCCL kernel, in launch order, ``seq`` still unset where not recorded."""
    enclosing = Enclosing(raw.comm)
    steps = StepIndex(raw.steps)
    rows = []
    for name, _cat, ts, dur, _stream, corr, args in raw.device:
        if "nccl" not in name.lower():
            continue
        args = args or {}
        launch = raw.launches.get(corr)
        ann = enclosing.find(*launch) if launch else None
        op = (normalize_op(str(args.get("Collective name", ""))) or
              (normalize_op(ann[0]) if ann else None) or _op_from_kernel(name) or "unknown")  # fmt: skip
        pg = args.get("Process Group Name")
        group = groups.get(str(pg)) if pg is not None else None
        label = labels.get(str(pg)) if pg is not None else None
        label = label or str(args.get("Process Group Description") or UNKNOWN_GROUP)
        size = args.get("Group size")
        nbytes, dtype = _nbytes(args, ann)
        start = clock.ns(ts)
        host_ts = ann[1] if ann else (launch[0] if launch else ts)
        seq = args.get("Seq")
        rows.append({
            "rank": rank, "step": steps.at(launch[0] if launch else ts), "microbatch": -1,
            "op": op, "group": label,
            "group_size": size if isinstance(size, int) else len(group.ranks) if group else 0,
            "seq": int(seq) if isinstance(seq, (int, str)) and str(seq).isdigit() else None,
            "peer": -1, "nbytes": nbytes, "dtype": dtype, "issue_ns": clock.ns(host_ts),
            "start_ns": start, "end_ns": start + _dur_ns(dur), "source": "kineto",
        })  # fmt: skip
    return rows


def _annotation_rows(raw: RawTrace, rank: int, clock: Clock) -> list[dict[str, Any]]:
    """One row per ``gloo:*`` / ``nccl:*`` host annotation (traces without NCCL kernels)."""
    steps = StepIndex(raw.steps)
    calls: dict[str, deque] = defaultdict(deque)
    for name, ts, _dur, _tid in sorted(raw.c10d, key=lambda c: c[1]):
        op = normalize_op(name)
        if op:
            calls[op].append(ts)
    info = raw.meta.get("distributedInfo") or {}
    pgs = info.get("pg_config") or []
    size = len(parse_ranks(pgs[0].get("ranks"))) if len(pgs) == 1 else 0
    rows = []
    for ann in sorted(raw.comm, key=lambda c: c[1]):
        name, ts, dur, _tid, _args = ann
        op = normalize_op(name)
        if op is None:
            continue
        queue = calls[op]
        issue = queue.popleft() if queue and queue[0] <= ts else ts
        nbytes, dtype = _nbytes({}, ann)
        start = clock.ns(ts)
        rows.append({
            "rank": rank, "step": steps.at(issue), "microbatch": -1, "op": op,
            "group": UNKNOWN_GROUP, "group_size": size, "seq": None, "peer": -1,
            "nbytes": nbytes, "dtype": dtype, "issue_ns": clock.ns(issue), "start_ns": start,
            "end_ns": start + _dur_ns(dur), "source": "kineto",
        })  # fmt: skip
    return rows


def collective_rows(raw: RawTrace, rank: int, clock: Clock, labels: Mapping[str, str],
                    groups: Mapping[str, Group]) -> dict[str, list[Any]]:  # fmt: skip
    """The collectives of one rank, in issue order (see the module docstring)."""
    has_nccl = any("nccl" in d[0].lower() for d in raw.device)
    if has_nccl:
        rows = _kernel_rows(raw, rank, clock, labels, groups)
    else:
        rows = _annotation_rows(raw, rank, clock)
    rows.sort(key=lambda r: (r["issue_ns"], r["start_ns"]))
    counters: dict[str, int] = defaultdict(int)
    cols = empty_columns("collectives")
    for row in rows:
        counters[row["group"]] += 1
        if row["seq"] is None:
            row["seq"] = counters[row["group"]]
        _append(cols, row)
    return cols


def heartbeat_rows(raw: RawTrace, rank: int, clock: Clock) -> dict[str, list[Any]]:
    """A heartbeat at the start of every profiler step (as the tracer beats per step)."""
    cols = empty_columns("heartbeats")
    for step, ts, _dur in sorted(raw.steps, key=lambda s: s[1]):
        _append(cols, {"rank": rank, "ts_ns": clock.ns(ts), "step": step, "state": "step"})
    return cols
