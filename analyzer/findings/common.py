"""What every detector shares: the step window, cached per-step frames, robust statistics and
the finding record of docs/spec.md §3.

Detectors read the run through a :class:`Context`, which runs each heavy SQL query at most once
(``rank_steps``, ``instances``) and hands out pandas frames of one row per (rank, step) or per
collective instance; those are small (ranks x steps) even when the raw tables are huge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from analyzer.db import Run
from analyzer.duck import EXACT_MAX_RANKS
from analyzer.findings.record import Finding
from analyzer.membership import hosts

# NVML clock-event reasons that slow a busy GPU: SW power cap (0x4), HW slowdown (0x8),
# SW thermal (0x20), HW thermal (0x40), HW power brake (0x80). Idle (0x1) and application
# clock settings (0x2) are not faults.
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma is 1.4826 x its median absolute deviation


@dataclass(frozen=True)
class Thresholds:
    """The margins that keep a healthy run free of false alarms (see each detector)."""

    min_excess: float = 0.04  # straggler: compute at least 4% above its peers' median
    persistence: float = 0.75  # ...in at least 75% of the steps
    z: float = 4.0  # and the excess at least 4 standard errors above the noise
    link_excess: float = 0.06  # slow_link: transfer at least 6% slower than comparable groups
    stall_share: float = 0.05  # stalls: at least 5% of the median step
    spike_z: float = 5.0  # transient: a spike is 5 robust sigmas above the rank-step noise
    transient_max_share: float = 0.6  # transient: late in at most 60% of the steps
    stage_excess: float = 0.10  # stage_imbalance: a stage 10% above the others
    clock_drop: float = 0.10  # throttle: SM clock 10% below peers'
    drift: float = 0.10  # regression: the last third 10% slower than the first third


@dataclass
class Context:
    """A run, the step window [lo, hi] under analysis and the frames the detectors share."""

    run: Run
    lo: int
    hi: int
    thresholds: Thresholds = field(default_factory=Thresholds)
    exact_max_ranks: int = EXACT_MAX_RANKS
    _hosts: dict[int, str | None] = field(default_factory=dict, repr=False)

    @property
    def at_scale(self) -> bool:
        """Whether collectives are matched in suspect groups only (see :meth:`matching`)."""
        return self.run.ranks is None and self.run.world_size > self.exact_max_ranks

    def matching(self, ranks: set[int]) -> Run:
        """Where to match collectives across ranks to learn about ``ranks``' instances.

        The whole run up to ``exact_max_ranks`` ranks; past that, the run restricted to
        ``ranks`` (collective instances whose members are all in ``ranks`` read exactly as in
        the whole run, and cost a scan of those ranks' folders only; the other instances are
        left out: ``Run.restricted(complete=True)``).
        """
        return self.run.restricted(ranks, complete=True) if self.at_scale else self.run

    def since(self, step: int) -> Context:
        """The same run and thresholds over [step, hi]: its frames computed afresh for that
        window, the run's hosts (one per rank, whatever the window) read once for both."""
        return Context(run=self.run, lo=step, hi=self.hi, thresholds=self.thresholds,
                       exact_max_ranks=self.exact_max_ranks, _hosts=self._hosts)  # fmt: skip

    def neighbours(self, ranks: set[int]) -> set[int]:
        """``ranks`` and every rank they share a group or a send/recv with."""
        if not ranks:
            return set()
        got = self.run.execute(
            """
            select m2.rank from group_members as m1
            join group_members as m2 on m2."group" = m1."group" and m2.gid = m1.gid
            where list_contains($ranks, m1.rank)
            union
            select peer from digest_collectives where peer >= 0 and list_contains($ranks, rank)
            """,
            {"ranks": sorted(int(r) for r in ranks)},
        )
        return set(ranks) | {int(r) for r in got.iloc[:, 0]}

    @cached_property
    def all_rank_steps(self) -> pd.DataFrame:
        """One row per (rank, step) of the window (findings/rank_steps.sql)."""
        # a send blocks its caller where it is host-timed (findings/rank_steps.sql)
        host_timed = str(self.run.meta.get("device", "")).startswith("cpu")
        self.run.con.execute(f"set variable megascope_sends_block = {str(host_timed).lower()}")
        rs = self.run.query("findings/rank_steps", lo=self.lo, hi=self.hi)
        rs = less_offload_waits(rs, self.offload)
        # its hardware class: peers are compared within it ('' where the run names none)
        classes = self.hw_classes
        return rs.assign(hw=rs["rank"].map(classes).fillna("").astype(str) if len(classes) else "")

    @cached_property
    def hw_classes(self) -> pd.Series:
        """rank -> its hardware class (topology's ``hw_class``), for the ranks that have one.
        One label for every rank, or none, is no mix: then it is empty, and peers are the
        ranks of a stage whatever they run on."""
        got = self.run.query("findings/hw_classes")
        classes = got.set_index("rank").hw_class if not got.empty else pd.Series(dtype=object)
        return classes if classes.nunique() >= 2 else pd.Series(dtype=object)

    @cached_property
    def offload(self) -> pd.DataFrame:
        """Per (rank, step) of the window, the optimizer offload's waits and transfers
        (findings/offload_steps.sql). That query reads the raw spans, so it runs only for a
        trainer run with ``train.optimizer_offload`` and for other runs up to
        :data:`EXACT_MAX_RANKS` ranks."""
        train = self.run.meta.get("train")
        if isinstance(train, dict):
            wanted = bool(train.get("optimizer_offload"))
        else:
            wanted = self.run.world_size <= EXACT_MAX_RANKS
        if not wanted or self.hi < self.lo:
            return pd.DataFrame(columns=["rank", "step", "wait_ns"])
        return self.run.query("findings/offload_steps", lo=self.lo, hi=self.hi)

    @cached_property
    def rank_steps(self) -> pd.DataFrame:
        """:attr:`all_rank_steps` but the steps in which ranks saved a checkpoint: its copy and
        write lengthen each rank's own time by what its own disk took, which says nothing
        about its compute and, compared across ranks, would read as stalls. The
        checkpoint_stall detector reads those steps."""
        rs = self.all_rank_steps
        if self.checkpoints.empty:
            return rs
        return rs[~rs.step.isin(self.checkpoints.step.unique())].reset_index(drop=True)

    @cached_property
    def checkpoints(self) -> pd.DataFrame:
        """The checkpoint spans of the window per (rank, step): findings/checkpoint_steps.sql.
        That query reads the raw spans, so it runs only for a trainer run that saved
        checkpoints (run.json's ``train.checkpoint_every``) and for other runs up to
        :data:`EXACT_MAX_RANKS` ranks (a traced script may name its own checkpoint spans)."""
        train = self.run.meta.get("train")
        if isinstance(train, dict):
            wanted = bool(train.get("checkpoint_every"))
        else:
            wanted = self.run.world_size <= EXACT_MAX_RANKS
        if not wanted or self.hi < self.lo:
            return pd.DataFrame(columns=["rank", "step", "snapshot_ns", "persist_ns",
                                         "wait_ns", "background_ns"])  # fmt: skip
        return self.run.query("findings/checkpoint_steps", lo=self.lo, hi=self.hi)

    @cached_property
    def rank_cpu(self) -> pd.DataFrame:
        """Per (rank, step) of :attr:`rank_steps`, the CPU time of the rank's training thread in
        the step and its wait for a core (findings/rank_cpu.sql: ``cpu_ns``, ``runq_ns``), with
        the rank's peer coordinates and its own time (``work_ns``). Only on a run of a
        CPU device (run.json) whose spans counted it, and matched across every rank (up to
        :data:`EXACT_MAX_RANKS`); else empty. On a GPU the host thread's CPU time is not the
        rank's work (it launches kernels, and spins in device synchronizations)."""
        empty = pd.DataFrame(columns=["rank", "step", "cpu_ns", "runq_ns"])
        cpu_run = str(self.run.meta.get("device", "")).startswith("cpu")
        if not cpu_run or self.at_scale or self.hi < self.lo or self.rank_steps.empty:
            return empty
        got = self.run.query("findings/rank_cpu", lo=self.lo, hi=self.hi)
        keep = self.rank_steps[["rank", "step", "dp", "pp", "tp", "cp", "hw", "comm_ns", "work_ns"]]
        return got.merge(keep, on=["rank", "step"])

    @cached_property
    def gpu_ranks(self) -> pd.DataFrame:
        """Each rank's GPU samples summarized (findings/gpu_ranks.sql; empty on CPU runs)."""
        return self.run.query("findings/gpu_ranks", mask=THROTTLE_MASK)

    @cached_property
    def instances(self) -> pd.DataFrame:
        """The collective instances of the window (findings/collective_instances.sql)."""
        return self.run.query("findings/collective_instances", lo=self.lo, hi=self.hi)

    @cached_property
    def unfinished(self) -> int:
        """Collective rows recorded without an end, over the whole run."""
        got = self.run.execute("select coalesce(sum(n_rows - n_done), 0) from digest_collectives")
        return int(got.iloc[0, 0])

    @cached_property
    def group_members(self) -> pd.DataFrame:
        """Every process group's ranks (``group``, ``gid``, ``rank``), in rank order."""
        return self.run.sql('select "group", gid, rank from group_members order by rank')

    @cached_property
    def coords(self) -> pd.DataFrame:
        """``rank_coords`` indexed by rank: each rank's dp, pp, tp, cp and host."""
        return self.run.sql("select * from rank_coords order by rank").set_index("rank")

    @cached_property
    def median_step_ns(self) -> float:
        """The median over the window's steps of each step's median ``step_ns`` across ranks (NaN
        without steps)."""
        rs = self.rank_steps
        if rs.empty:
            return float("nan")
        per_step = rs.groupby("step").step_ns.median()
        return float(per_step.median())

    @property
    def n_steps(self) -> int:
        """How many distinct steps :attr:`rank_steps` holds."""
        return int(self.rank_steps.step.nunique()) if not self.rank_steps.empty else 0

    def coord(self, rank: int) -> dict[str, int]:
        """The rank's ``{dp, pp, tp, cp}`` (all 0 for a rank without coordinates)."""
        if rank in self.coords.index:
            row = self.coords.loc[rank]
            return {k: int(row[k]) for k in ("dp", "pp", "tp", "cp")}
        return {"dp": 0, "pp": 0, "tp": 0, "cp": 0}

    def host(self, rank: int) -> str | None:
        """The rank's host: from ``rank_coords``, else from its topology folder, remembered (None
        when neither knows)."""
        if rank in self.coords.index:
            host = self.coords.loc[rank, "host"]
            if isinstance(host, str) and host:
                return host
        if rank not in self._hosts:  # a large run's hosts are read for the ranks named only
            self._hosts.update(hosts(self.run, [rank]))
        return self._hosts.get(rank)

    def prefetch_hosts(self, ranks: list[int]) -> None:
        """Read the hosts of many ranks at once (a finding that names a stage or a class),
        where ``rank_coords`` leaves them out (a large run)."""
        missing = [r for r in ranks if r not in self._hosts]
        if missing and self.coords.host.isna().any():
            self._hosts.update(hosts(self.run, missing))

    def label(self, rank: int) -> str:
        """``rank 5 (dp1 pp0 tp1, node3)``: how messages name a rank."""
        c = self.coord(rank)
        cp = f" cp{c['cp']}" if self.run.mesh.get("cp", 1) > 1 else ""
        where = f"dp{c['dp']} pp{c['pp']} tp{c['tp']}{cp}"
        host = self.host(rank)
        return f"rank {rank} ({where}{', ' + host if host else ''})"


def less_offload_waits(rs: pd.DataFrame, offload: pd.DataFrame) -> pd.DataFrame:
    """``rs`` with each rank-step's ``work_ns`` less its waits for optimizer-offload traffic
    (they lie inside its forward spans, but are no work of the rank: offload_stall reads
    them), so that a rank slowed by its offload is not taken for a slow rank."""
    if offload.empty or "wait_ns" not in offload.columns or rs.empty:
        return rs
    wait = rs.merge(offload[["rank", "step", "wait_ns"]], on=["rank", "step"], how="left")
    waits = wait["wait_ns"].fillna(0).astype("int64").to_numpy()
    return rs.assign(work_ns=(rs["work_ns"].to_numpy() - waits).clip(min=0))


def finding(
    ctx: Context,
    kind: str,
    ranks: list[int],
    severity: float,
    message: str,
    evidence: dict[str, Any],
    steps: list[int] | None = None,
) -> Finding:
    """One finding of SPEC §3, with coords and hosts filled in from the run."""
    ranks = sorted(int(r) for r in ranks)
    if len(ranks) > 1:
        ctx.prefetch_hosts(ranks)  # one read, not one per rank (a stage, a class)
    sev = 0.0 if not math.isfinite(severity) else min(max(float(severity), 0.0), 1.0)
    return {
        "kind": kind,
        "ranks": ranks,
        "coords": [ctx.coord(r) for r in ranks],
        "hosts": [ctx.host(r) for r in ranks],
        "severity": round(sev, 4),
        "steps": steps if steps is not None else [ctx.lo, ctx.hi],
        "evidence": jsonable(evidence),
        "message": message,
    }


def jsonable(obj: Any) -> Any:
    """Numpy scalars and arrays, NaN and tuples made plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray, pd.Index)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    return obj


def stage_excess(rs: pd.DataFrame, measure: str) -> pd.Series:
    """Per row of a ``rank_steps`` frame: its ``measure`` less the median of the other ranks
    of its pipeline stage in the step (what they wait for it, where positive); 0 for a rank
    alone in its stage. The others only: with two ranks a median that took the rank in would
    be their mean, and read half of what the other waits."""
    value = rs[measure].astype(float)
    return (value - peer_reference(rs, ["step", "pp"], measure)).fillna(0.0)


def robust_sigma(values: pd.Series | np.ndarray) -> float:
    """1.4826 x median absolute deviation: a standard deviation that outliers do not inflate."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return 0.0
    return float(MAD_TO_SIGMA * np.median(np.abs(arr - np.median(arr))))


def peer_reference(df: pd.DataFrame, keys: list[str], value: str) -> pd.Series:
    """For each row, the median of ``value`` over the OTHER rows with the same ``keys``.

    The row itself is left out, so that a culprit's ratio to its reference compares it with
    its peers only (with three peers, a median that took the culprit in would be the mean of
    the two slower peers, and a factor would read low). Rows alone in their class (or without
    a value) get NaN; NaN values are no one's peers.
    """
    v = df[value].to_numpy(dtype=float)
    out = np.full(v.size, np.nan)
    ok = np.flatnonzero(np.isfinite(v))
    if ok.size:
        codes = df.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()[ok]
        out[ok] = _medians_of_others(codes, v[ok])
    return pd.Series(out, index=df.index)


def peer_reference_or(df: pd.DataFrame, keys: list[str], wider: list[str], value: str) -> pd.Series:
    """:func:`peer_reference` over ``keys``; where a row has no peers there (alone in its
    class), over the ``wider`` class (computed only then)."""
    ref = peer_reference(df, keys, value)
    if ref.isna().any():
        ref = ref.fillna(peer_reference(df, wider, value))
    return ref


def _medians_of_others(codes: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Per element, the median of the other elements with its code: all classes at once,
    from the values sorted by class then value (tied values have the same others, so their
    order does not matter)."""
    order = np.lexsort((v, codes))
    c, s = codes[order], v[order]
    first = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    size = np.diff(np.r_[first, c.size])
    start, n = np.repeat(first, size), np.repeat(size, size)
    k = np.arange(c.size) - start + 1  # each element's 1-based place in its class

    def nth_other(j: np.ndarray) -> np.ndarray:
        return s[np.clip(np.where(j < k, start + j - 1, start + j), 0, c.size - 1)]

    m = n - 1  # how many others
    odd = nth_other((m + 1) // 2)
    even = (nth_other(m // 2) + nth_other(m // 2 + 1)) / 2
    med = np.where(m % 2 == 1, odd, even)
    med[n < 2] = np.nan
    out = np.empty(c.size)
    out[order] = med
    return out


def ms(ns: float) -> float:
    """Nanoseconds as milliseconds, rounded to the microsecond."""
    return round(float(ns) / 1e6, 3)


def bandwidth(gb_per_s: float) -> str:
    """A bandwidth in GB/s, MB/s or KB/s, three significant digits: CPU links run at MB/s."""
    for unit, scale in (("GB/s", 1.0), ("MB/s", 1e-3), ("KB/s", 1e-6)):
        if abs(gb_per_s) >= scale:
            return f"{gb_per_s / scale:.3g} {unit}"
    return f"{gb_per_s / 1e-6:.3g} KB/s"
