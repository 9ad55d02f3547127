"""Straggler: a rank whose own compute is persistently slower than its peers'."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.findings import late_arrival, own_time, work_imbalance
from analyzer.findings import straggler_words as words
from analyzer.findings.common import (
    Context,
    finding,
    peer_reference_or,
    robust_sigma,
)
from analyzer.findings.detector import DetectorSpec, Kind, Replay
from analyzer.findings.record import Finding

# ranks of one pipeline stage and context shard do the same work (``shard``: the context
# shard, or -1 for a stage whose shards have no other replica, see :func:`_shards`), and are
# compared within their hardware class (``hw``: '' where the run names no mix of classes; a
# slower class is hardware_imbalance, not a crowd of stragglers)
PEER_KEYS = ["pp", "shard", "hw"]
# a rank whose wait for a core is this much of its extra own time was run less, not slower
RUNQ_SHARE = 0.75
# a straggler whose operations hold less than this share of its own excess is priced from its
# step time and arrivals, not by the replay (:func:`fix`)
HELD_SHARE = 0.5
METRIC = "work_ns"  # step time minus time blocked in collectives, minus data loading (SPEC §3)


def arrival_blame(ctx: Context, ranks: set[int]) -> pd.DataFrame:
    """Per (rank, step) of ``ranks``: how long the other members of its collectives waited
    for it alone.

    For every complete collective instance the last member to arrive is charged the gap between
    its arrival and the second-to-last arrival (``blame_ns``). Returns rank, step, blame_ns and
    last_count (instances it arrived last at); computed in SQL (findings/arrival_blame.sql),
    over the groups of ``ranks`` only when the run is large (``Context.matching``).
    """
    where = ctx.matching(ctx.neighbours(ranks))
    blame = where.query("findings/arrival_blame", lo=ctx.lo, hi=ctx.hi)
    return blame[blame["rank"].isin(ranks)]


# peers of a straggler whose arrival blame is read beside its own, at most (the nearest ranks)
BLAME_PEERS = 16


def _blame_peers(per_rank: pd.DataFrame, flagged: pd.DataFrame) -> dict[int, set[int]]:
    """Each flagged rank's peers (same pipeline stage and context shard), the nearest
    :data:`BLAME_PEERS` by rank number."""
    out = {}
    for rank, row in flagged.iterrows():
        same = per_rank.index[(per_rank.pp == row.pp) & (per_rank.shard == row.shard)]
        near = sorted((int(r) for r in same if r != rank), key=lambda r: abs(r - int(rank)))
        out[int(rank)] = set(near[:BLAME_PEERS])
    return out


def _beyond_peers(blame: pd.DataFrame, rank: int, peers: set[int], n: int) -> float:
    """``rank``'s arrival blame per step beyond its peers' median blame in the same steps (ns,
    at least 0): where ranks share cores, every rank arrives last now and then by the
    scheduler's chance, and its peers wait for it; that share is in every rank's blame, as it
    is in none of its excess over its peers (:func:`replay_holds`)."""
    mine = blame[blame["rank"] == rank].groupby("step").blame_ns.sum().astype(float)
    if not peers:
        return float(mine.sum()) / max(n, 1)
    theirs = blame[blame["rank"].isin(peers)].pivot_table(
        index="step", columns="rank", values="blame_ns", aggfunc="sum"
    )
    steps = mine.index.union(theirs.index)
    theirs = theirs.reindex(index=steps, columns=sorted(peers)).fillna(0.0)
    gap = mine.reindex(steps).fillna(0.0) - theirs.median(axis=1)
    return max(0.0, float(gap.sum()) / max(n, 1))


def _ratios(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (rank, step): ``metric`` over the median of the rank's peers in the step (``ref``),
    as ``ratio``; ``shard`` its peer class within the stage (:func:`_shards`)."""
    rows = rows[rows[metric] > 0]
    if rows.empty:
        return rows
    rows = rows.assign(shard=_shards(rows))
    # a rank alone in its class on its stage is compared with its stage (its class's speed in
    # it; hardware_imbalance compares the classes)
    ref = peer_reference_or(rows, ["step", *PEER_KEYS], ["step", *PEER_KEYS[:-1]], metric)
    rows = rows.assign(ref=ref)
    rows = rows[rows.ref > 0]
    return rows.assign(ratio=rows[metric] / rows.ref)


def _per_rank(ctx: Context, rs: pd.DataFrame, metric: str = METRIC) -> pd.DataFrame:
    """Each rank's step-wise ratios of ``metric`` to its peers, summarized over the steps."""
    th = ctx.thresholds
    late = rs.ratio >= 1.0 + th.min_excess / 2
    agg = (
        rs.assign(late=late, excess_ns=rs[metric] - rs.ref)
        .groupby("rank")
        .agg(
            n=("ratio", "size"),
            ratio=("ratio", "median"),
            late_frac=("late", "mean"),
            excess_ns=("excess_ns", "median"),
            comm_ns=("comm_ns", "median"),
            pp=("pp", "first"),
            shard=("shard", "first"),
            hw=("hw", "first"),
        )
    )
    agg["low_third"] = _low_third(rs)
    sigma = rs.groupby(PEER_KEYS).ratio.apply(robust_sigma).rename("sigma")
    agg = agg.join(sigma, on=PEER_KEYS)
    # two peers are each other's reference: their ratios mirror each other, and the spread of
    # the pair is the difference under test, not noise; there a rank's noise is the other's
    pair = agg.groupby(PEER_KEYS).n.transform("size") == 2
    for rank in agg.index[pair]:
        row = agg.loc[rank]
        same = (rs.pp == row.pp) & (rs.shard == row.shard) & (rs.hw == row.hw)
        other = rs.ratio[(rs["rank"] != rank) & same]
        agg.loc[rank, "sigma"] = robust_sigma(other)
    agg["peer_comm_ns"] = agg.groupby(PEER_KEYS).comm_ns.transform("median")
    return agg


def detect(ctx: Context) -> list[Finding]:
    """Name ranks whose own work is slower than their peers' in most steps.

    Algorithm:

    1. For each (rank, step), the rank's own work is its step time minus the time it was
       blocked in collectives (arrival to end) and minus data loading: its compute, wherever
       the spans are drawn (a forward span that encloses tensor-parallel collectives also
       encloses the waits in them, so compute spans alone would make the culprit's peers look
       just as slow). It is divided by the median of its peers in that step: the other ranks
       of the same pipeline stage (and context shard), which run the same layers on the same
       amount of data. Comparing only like with like means a slow pipeline stage is not a
       straggler (that is stage_imbalance), and taking the waiting out means the ranks that
       wait for the culprit are not blamed: the culprit has long work and short collectives,
       its waiters the reverse.
    2. A rank is a straggler when its median ratio over the steps exceeds 1 + ``min_excess``,
       it is above 1 + ``min_excess``/2 in at least ``persistence`` of the steps, or in over
       ``transient_max_share`` of them and in the median of each third of 30 steps or more (a
       one-off pause is a transient stall, a rank slow from part way a change point, not a
       straggler: :func:`_persistent`), and the excess stands ``z`` standard errors above
       the noise of its peer class (robust sigma of all ratios, / sqrt(steps)). Robust medians
       keep the 2x jitter of single events on shared CPUs from raising alarms.
    3. Arrival times confirm it: the culprit arrives last at its collectives (MegaScale's
       lesson: arrival skew, not durations); the blame is what its peers waited for it alone.
    4. Work: where the run recorded the work each rank was given, a candidate (median ratio
       and persistence as in 2, before the noise test: when half of a stage is given more
       work, the stage's spread is that work, not noise; or a rank steadily given a quarter
       more work than its peers and slower than them at all, whatever its excess:
       :func:`analyzer.findings.work_imbalance.screen`) whose extra work explains its extra
       time is reported as ``load_imbalance`` instead, one finding per cause
       (:mod:`analyzer.findings.work_imbalance`); a straggler's evidence says how its work
       compared (``work``: ~1, the same work, slower).

    5. Late arrival, the second signal (:mod:`analyzer.findings.late_arrival`): where peers
       wait for a rank inside their own backward (DDP's bucketed all_reduces, read from
       Flight Recorder), a rank that arrives late at those collectives steadily, beyond the
       noise, and whose own work is longer too, is named by it whether 2 passes or not; its
       factor is its first forward of the step over its peers'.

    6. Descheduled: on a run that recorded each span's wait for a core (``runq_ns``, where ranks
       share a host's cores), a rank named by its own time or its late arrival alone, whose CPU
       time is even with its peers' (:func:`descheduled`) and most of whose excess is that wait,
       was run less by the host's scheduler, not slower: it is not a straggler. Before step 1,
       where every rank of a stage runs on one host, a rank's own time already leaves out its
       wait for a core beyond its stage peers' (:mod:`analyzer.findings.own_time`).

    Severity (what-if): the culprit's median excess of work per step, capped by the time its
    peers actually waited for it (its arrival blame per step; an excess that no one waits for
    costs nothing), over the median step time; for a rank named by its late arrival, its
    median lateness at the step's last overlapped collective (capped the same way), which the
    what-if pricing keeps (no replay places those waits inside the backward).
    """
    if ctx.n_steps < 3:
        return []
    # own time: less the wait for a core beyond the stage's, where recorded (own_time.py)
    rs = _ratios(own_time.less_core_waits(ctx, ctx.rank_steps, beyond=["step", "pp"]), METRIC)
    if rs.empty:
        return []
    sig = signals(ctx, rs)
    imbalance, flagged = verdict(ctx, sig)
    if flagged.empty:
        return imbalance
    peers_of = _blame_peers(sig.per_rank, flagged)
    blame = arrival_blame(ctx, {int(r) for r in flagged.index}.union(*peers_of.values()))
    entered = _entered(ctx)
    out = [
        _finding(
            ctx, sig, int(rank), row, cost(sig, int(rank), row, blame, entered, peers_of[int(rank)])
        )
        for rank, row in flagged.iterrows()
    ]
    return imbalance + out


@dataclass
class Signals:
    """What names a straggler, rank by rank (:func:`detect`'s steps 2 to 5)."""

    per_rank: pd.DataFrame  # each rank's own time against its peers' (:func:`_per_rank`)
    candidate: pd.Series  # slow in most steps (:func:`_persistent`)
    beyond_noise: pd.Series  # ...and beyond its peer class's noise (:func:`_beyond_noise`)
    late: pd.DataFrame  # the ranks late at the backward's collectives (late_arrival.named)
    cpu_all: pd.DataFrame  # every rank's CPU time against its peers' (:func:`cpu_ratios`)
    cpu: pd.DataFrame  # the ranks their CPU time names (:func:`cpu_named`)
    heavy: list[int]  # the ranks steadily given more work (work_imbalance.screen)
    given: work_imbalance.Given | None  # the work table, where the run recorded one

    def signal(self, rank: int) -> str:
        """What names ``rank``: ``late_arrival``, ``cpu_time`` (its CPU time alone) or
        ``own_time`` (its step time outside waits, its CPU time perhaps too)."""
        if rank in self.late.index:
            return "late_arrival"
        if rank in self.cpu.index and not (self.candidate[rank] and self.beyond_noise[rank]):
            return "cpu_time"
        return "own_time"


def signals(ctx: Context, rs: pd.DataFrame) -> Signals:
    """The four signals over the ratios ``rs`` (:func:`_ratios`): own time, late arrival,
    CPU time, work given."""
    per_rank = _per_rank(ctx, rs)
    cpu_all = cpu_ratios(ctx, per_rank)
    heavy, given = work_imbalance.screen(ctx, per_rank, cpu_all.ratio)
    return Signals(
        per_rank=per_rank,
        candidate=_persistent(ctx, per_rank),
        beyond_noise=_beyond_noise(ctx, per_rank),
        late=late_arrival.named(ctx, per_rank, PEER_KEYS),
        cpu_all=cpu_all,
        cpu=cpu_named(ctx, per_rank, cpu_all),
        heavy=heavy,
        given=given,
    )


def verdict(ctx: Context, sig: Signals) -> tuple[list[Finding], pd.DataFrame]:
    """The load imbalances (candidates whose extra work explains them) and the per-rank rows
    of the stragglers; ``sig.given`` becomes the work table as :func:`work_imbalance.split`
    leaves it."""
    per_rank = sig.per_rank
    arrives_late = per_rank.index.isin(sig.late.index)
    by_cpu = per_rank.index.isin(sig.cpu.index)
    by_work = per_rank.index.isin(sig.heavy)
    # a candidate's extra work explains it (load_imbalance): its time is its CPU time where
    # that passed its test, else its step time outside waits
    cands = per_rank[sig.candidate | arrives_late | by_cpu | by_work].copy()
    shown = sig.cpu.index.intersection(cands.index)
    cands.loc[shown, "ratio"] = sig.cpu.loc[shown, "ratio"]
    imbalance, explained, sig.given = work_imbalance.split(ctx, cands, sig.given)
    # the host's scheduler, not its work, lengthened a rank it ran less (descheduled)
    on_core = ~per_rank.index.isin(descheduled(ctx, sig.cpu_all))
    flagged = per_rank[
        (((sig.candidate & sig.beyond_noise) | arrives_late) & on_core | by_cpu)
        & ~per_rank.index.isin(explained)
    ]
    return imbalance, flagged


def cost(
    sig: Signals,
    rank: int,
    row: pd.Series,
    blame: pd.DataFrame,
    entered: pd.Series,
    peers: set[int],
) -> words.Cost:
    """What a straggler costs per step: the excess its signal reads (its lateness, its CPU
    time's excess, or its own time's), capped by what its peers waited for it where it took
    part in collectives (its arrival blame); and that blame beyond its ``peers``' own."""
    mine = blame[blame["rank"] == rank]
    blame_per_step = float(mine.blame_ns.sum()) / max(int(row.n), 1)
    n_in = int(entered.get(rank, 0))
    last_share = float(mine.last_count.sum()) / n_in if n_in else float("nan")
    signal = sig.signal(rank)
    if signal == "late_arrival":
        excess = float(sig.late.loc[rank].late_ns)
    elif signal == "cpu_time":
        excess = float(sig.cpu.loc[rank].excess_ns)
    else:
        excess = float(row.excess_ns)
    per_step = min(excess, blame_per_step) if n_in else excess
    beyond = _beyond_peers(blame, rank, peers, int(row.n))
    return words.Cost(per_step, blame_per_step, n_in, last_share, beyond)


def _finding(ctx: Context, sig: Signals, rank: int, row: pd.Series, c: words.Cost) -> Finding:
    """The straggler finding of ``rank`` (its per-rank row ``row``), costing ``c``."""
    per_rank = sig.per_rank
    same_class = (per_rank.pp == row.pp) & (per_rank.shard == row.shard)
    peers = int((same_class & (per_rank.hw == row.hw)).sum() - 1)
    signal = sig.signal(rank)
    late = sig.late.loc[rank] if signal == "late_arrival" else None
    cpu = sig.cpu.loc[rank] if rank in sig.cpu.index else None
    if late is not None:
        factor = float(late.factor)
    elif signal == "cpu_time" and cpu is not None:
        factor = float(cpu.ratio)
    else:
        factor = float(row.ratio)
        if cpu is not None:  # its CPU time passed too: each reads the slowdown short in
            # one way, the larger is the factor. Its own time is blurred where ranks share
            # cores (its peers' waits hand it their cores); its CPU time leaves out what is
            # not computing (a sleep, a stall: a 1.5x sleeping rank's reads 1.10x)
            factor = max(factor, float(cpu.ratio))
    shape = words.Shape(
        label=ctx.label(rank),
        factor=factor,
        peers=peers,
        same=words.same_peers(ctx.run.mesh.get("cp", 1), row),
        signal=signal,
    )
    msg = words.message(shape, row, late, cpu, c)
    evidence = words.evidence(shape, row, late, cpu, c)
    work = sig.given.evidence(rank, float(row.ratio)) if sig.given is not None else None
    if work is not None:
        evidence["work"] = work
        msg += (
            f"; its work was even ({work['kind']} {work['work_ratio']:.2f}x its peers'): "
            "the same work, slower"
        )
    return finding(ctx, "straggler", [rank], c.per_step / ctx.median_step_ns, msg, evidence)


# a rank's steps read in thirds (:func:`_low_third`) where each third holds this many at least
THIRD_STEPS = 10


def _low_third(rs: pd.DataFrame) -> pd.Series:
    """Per rank of the ratios ``rs`` (:func:`_ratios`): the lowest of the medians of its ratios
    over the three thirds of its steps, in step order; NaN under 3 x :data:`THIRD_STEPS`
    steps."""
    rs = rs.sort_values(["rank", "step"])
    by_rank = rs.groupby("rank")
    third = by_rank.cumcount() * 3 // by_rank.ratio.transform("size")
    low = rs.groupby([rs["rank"], third]).ratio.median().groupby(level=0).min()
    return low.where(by_rank.size() >= 3 * THIRD_STEPS)


def _persistent(ctx: Context, per_rank: pd.DataFrame) -> pd.Series:
    """Ranks above their peers by ``min_excess`` in the median, and slow throughout: by half
    of it in at least ``persistence`` of three steps or more; or in more than the transient
    stalls' share of them (``transient_max_share``) and in the median of each third of the
    steps (:func:`_low_third`).

    The thirds read a rank slow throughout where the cores' speed swings for stretches of
    steps: on shared CPUs one core slows for five to ten steps, then the other, and a rank
    1.1x slow all run long read above its peers by 2% in 66-70% of its 90 steps, yet in the
    median of each third (docs/benchmarks.md). A rank slow from part way (a late onset, the
    onset detector's) is not slow in the median of its first third; one slow in at most the
    transient share of its steps, however spread, has transient stalls."""
    th = ctx.thresholds
    excess = per_rank.ratio - 1.0
    steady = (per_rank.late_frac >= th.persistence) | (
        (per_rank.late_frac > th.transient_max_share)
        & (per_rank.low_third >= 1.0 + th.min_excess / 2)
    )
    return (per_rank.n >= 3) & (excess >= th.min_excess) & steady


def _beyond_noise(ctx: Context, per_rank: pd.DataFrame) -> pd.Series:
    """Ranks whose median excess stands ``z`` standard errors above their peer class's noise
    (1.25 robust sigma / sqrt(steps): the standard error of a median)."""
    stderr = 1.25 * per_rank.sigma / np.sqrt(per_rank.n.clip(lower=1))
    return (per_rank.ratio - 1.0) >= ctx.thresholds.z * stderr


def cpu_named(ctx: Context, per_rank: pd.DataFrame, cpu: pd.DataFrame) -> pd.DataFrame:
    """The ranks whose own CPU time names them, of ``cpu`` (:func:`cpu_ratios`: the per-rank
    frame of :func:`_per_rank` over ``cpu_ns``, on a run of a CPU device that counted it).

    Where ranks share a host's cores, a rank that computes more takes cores from its peers:
    their step times lengthen with its, and a rank's time outside its waits reads its
    slowdown only in part, under the noise of the cores' scheduling. The CPU time of its
    training thread does not: waiting for a peer (gloo blocks, it does not spin) or for a core
    adds none. A rank is named by it under the same tests as by its step time (a median ratio
    to its peers ``min_excess`` above 1, ``persistence``, ``z`` standard errors), and where its
    step time outside waits is not shorter than its peers' (``per_rank``: work on another
    thread, or done while the others wait, would not hold them up). It reads a slowness of
    compute, not one of waiting: a rank that sleeps or waits for its own I/O shows in its step
    time alone."""
    wall = per_rank.ratio.reindex(cpu.index)
    named = _persistent(ctx, cpu) & _beyond_noise(ctx, cpu) & (wall >= 1.0)
    return cpu[named]


def descheduled(ctx: Context, cpu: pd.DataFrame) -> pd.Index:
    """The ranks whose extra own time the host's scheduler explains: per step, the rank's wait
    for a core (``Context.rank_cpu``'s ``runq_ns``) above its peers' median, against its own
    time outside waits (``work_ns``) above theirs; a rank whose median excess of the one is at
    least :data:`RUNQ_SHARE` of the other's, the other positive, and whose CPU time (``cpu``,
    :func:`cpu_ratios`) is within half of ``min_excess`` of its peers'. Empty where the run
    recorded no such wait.

    A rank that shares cores waits for one as long as the scheduler makes it: a healthy rank
    it runs less reads a longer forward and arrives late, its CPU time even. A slow rank that
    sleeps or stalls waits for no core in its extra time, and one that computes more shows it
    in its CPU time (where it is named by that, whatever its wait). Only a rank whose peers all
    run on its host is so cleared: they share its cores."""
    rows = ctx.rank_cpu
    if rows.empty or "runq_ns" not in rows or cpu.empty:
        return pd.Index([])
    rows = rows[rows.runq_ns.notna()].astype({"work_ns": float, "runq_ns": float})
    if rows.empty:
        return pd.Index([])
    rows = rows.assign(shard=_shards(rows))
    keys = ["step", *PEER_KEYS]
    excess = (
        pd.DataFrame(
            {
                "rank": rows["rank"],
                "work": rows.work_ns - peer_reference_or(rows, keys, keys[:-1], "work_ns"),
                "runq": rows.runq_ns - peer_reference_or(rows, keys, keys[:-1], "runq_ns"),
            }
        )
        .groupby("rank")
        .median()
    )
    even = cpu.ratio.reindex(excess.index) < 1.0 + ctx.thresholds.min_excess / 2
    waited = (excess.work > 0) & (excess.runq >= RUNQ_SHARE * excess.work)
    suspects = [int(r) for r in excess.index[waited & even]]
    if not suspects:
        return pd.Index([])
    # only among ranks that share the cores: a rank that another host runs less, its peers
    # elsewhere, is on a slower machine (an overloaded one), and is a straggler
    classes = rows.groupby("rank")[PEER_KEYS].first()
    ctx.prefetch_hosts([int(r) for r in classes.index])
    host = pd.Series({int(r): ctx.host(int(r)) for r in classes.index})
    shared = []
    for rank in suspects:
        peers = (classes == classes.loc[rank]).all(axis=1)
        if host[peers.index[peers]].nunique(dropna=False) == 1:
            shared.append(rank)
    return pd.Index(shared)


def cpu_ratios(ctx: Context, per_rank: pd.DataFrame) -> pd.DataFrame:
    """The per-rank frame of :func:`_per_rank` over the training thread's CPU time in a step
    (``Context.rank_cpu``), every rank's, untested; empty where the run counted none."""
    rows = ctx.rank_cpu
    if rows.empty:
        return per_rank.iloc[0:0]
    rows = _ratios(rows.astype({"cpu_ns": float}), "cpu_ns")
    return per_rank.iloc[0:0] if rows.empty else _per_rank(ctx, rows, "cpu_ns")


def _shards(rs: pd.DataFrame) -> pd.Series:
    """Each row's peer class within its stage: its context shard, where another rank of the
    stage holds the same shard (another data-parallel replica); -1 where none does.

    Context parallelism splits a sequence evenly (all_to_all over heads, or ring attention
    with its load balancing), but its shards need not cost the same (ring attention without
    it), so the ranks holding one shard are compared with each other. A stage whose shards
    have no second replica (dp = 1) has nothing of the kind: there its shards are each
    other's peers, and a slow rank is still named.
    """
    held = rs.groupby(["pp", "cp"])["rank"].transform("nunique")
    return rs["cp"].where(held >= 2, -1)


def _entered(ctx: Context) -> pd.Series:
    """How many complete collective instances of two or more members each rank took part in."""
    rows = ctx.run.query("findings/rank_collective_counts", lo=ctx.lo, hi=ctx.hi)
    if rows.empty:
        return pd.Series(dtype=np.int64)
    return rows.set_index("rank").instances


def fix(replay: Replay, f: Finding) -> np.ndarray | None:
    """Fixed in the what-if replay: the compute of the straggler's rank, where the replay
    holds its excess (:func:`replay_holds`). A rank named by its late arrival (its peers wait
    inside their backward, which no replay places) or by its CPU time alone (it takes its
    peers' cores, which no replay of their times shows) keeps its estimate."""
    if f["evidence"].get("signal") in ("late_arrival", "cpu_time"):
        return None
    mask = replay.ranks_compute(f["ranks"])
    return mask if replay_holds(replay, f, mask) else None


def replay_holds(replay: Replay, f: Finding, mask: np.ndarray) -> bool:
    """Whether the replay holds most of a straggler's own excess (its evidence's
    ``excess_ms_per_step``: its step time over its peers', less its waits for them and its data
    loading), so that the replay can price it.

    The replay is the spans and collectives; the time between them is in no operation. Where
    the spans cover a small part of the step (torchtitan's backward spans hold under a tenth
    of its backward) and the rank's excess lies outside them (a rank that sleeps, or waits on a
    slow device, between its spans), fixing its operations saves nothing there while a run
    without it is that much faster. Where its peers waited for it about as long as its own
    excess (its arrival blame within a factor 1 / :data:`HELD_SHARE` of it either way: its
    arrivals and its own time agree) and the replay holds under
    :data:`HELD_SHARE` of it, the straggler keeps
    the detector's pricing: its own excess per step, capped by what its peers waited for it
    (its arrival blame), over the median step; its evidence says so (``priced_by``,
    ``replay_excess_ms_per_step``)."""
    ev = f["evidence"]
    excess_ms = float(ev.get("excess_ms_per_step") or 0.0)
    if not excess_ms > 0:
        return True
    blame_ms = float(ev.get("arrival_blame_ms_per_step") or 0.0)
    # beyond its peers' chance share of being last (ranks sharing cores), where known
    blame_ms = float(ev.get("arrival_blame_beyond_peers_ms_per_step", blame_ms) or 0.0)
    if not HELD_SHARE * excess_ms <= blame_ms <= excess_ms / HELD_SHARE:
        # its peers did not wait for most of it, or waited far longer than its own excess (a
        # rank downstream of a straggler arrives late by the straggler's time, not its own):
        # the replay says what it costs
        return True
    seen_ms = replay.seen_excess(mask) * 1e3
    if seen_ms >= HELD_SHARE * excess_ms:
        return True
    ev["priced_by"] = "own_time"
    ev["replay_excess_ms_per_step"] = round(seen_ms, 3)
    return False


STRAGGLER = Kind("straggler", persistent=True, measure=METRIC, culprit=True, explains=True, fix=fix)
# a candidate whose extra work explains its extra time is a load imbalance (step 4)
DETECTOR = DetectorSpec("straggler", detect, (STRAGGLER, work_imbalance.LOAD_IMBALANCE))
