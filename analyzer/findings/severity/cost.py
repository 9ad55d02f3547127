"""Severity as the what-if saving: what a finding's cause costs, replayed on the run's own graph.

The detectors find candidates and say why; what each one costs comes from the what-if engine
(:mod:`analyzer.whatif`): the run's steps are replayed on their dependency graph with the
measured durations (``T``) and again with the candidate's operations set to what their peers
took (``T_fixed``). The severity is ``1 - T_fixed / T``. A stage or the whole run's compute,
set from other stages' or ranks' times that are not the same work, is capped at the saving that
``megascope whatif`` reports for the run (its ideal replay, every operation at its typical
duration); a straggler or a slow link, set from the same operation on its peers as a run
without the fault would be, is not (:data:`UNCAPPED`: over two peers the study's typical is
their mean, and its ideal saves half of what removing a straggler does).

*What their peers took*: in each step, the median duration of the same operation (same span
name and piece, or same collective, group kind and size) on the ranks the candidate does not
touch. An operation with no such peer (a stage's own layers when the whole stage is the
candidate) is scaled instead: a computation by the ratio of its peers' median to its rank's
own time in the same kind of operation (``forward``, ``backward``...) in that step; a transfer
(a stage's gradient sync, whose size no other stage shares) to its bytes at the median time per
byte of the same kind of transfer elsewhere.

What each kind fixes:

* ``straggler``: the compute of its ranks;
* ``hardware_imbalance``: the compute of its class's ranks, at what the other classes took
  (the same operation on their ranks; scaled where the classes hold different stages);
* ``stage_imbalance``: the compute of the stage's ranks;
* ``slow_link``: the transfer of every collective instance and send/recv that runs between the
  link's two ends (every member of those instances: they end together);
* ``load_imbalance`` by work given (evidence ``work``: ranks given more tokens, attention or
  expert tokens than their peers, :mod:`analyzer.findings.work_imbalance`): the compute of its
  ranks, like a straggler's, and not capped (:func:`uncapped`: their peers' work is the run's
  without the cause); but a hot expert's (or its all_to_all bytes') work is spread, not
  removed, without the cause (:meth:`Costs.evened`: its ranks and their peers at their mean);
* the spread ``load_imbalance`` (below): every rank's compute.

A cause that holds another (a stage imbalance on the stage of a straggler) is priced beyond it:
the saving of fixing it once the one it holds is fixed (``beyond`` in its evidence), so the
straggler's share is not counted twice.

Causes hide and inflate each other: a slow link on a data-parallel replica that waits for a
straggler on the other replica anyway saves nothing alone; a link that carries a straggler's late
traffic, or the last stage of a pipeline that waits for it, seems to save time alone and saves
nothing once the straggler is fixed. So the candidates are priced in order
(:mod:`analyzer.findings.severity.ordered`): a finding's severity is its saving with the findings above
it already fixed (``saving_alone``, and ``saving_after_others`` with ``fixed_first`` when others
were, a stall in data loading among them, beside the detector's ``estimate``). A candidate that
saves less than :data:`NOISE` of the step then is dismissed: it goes, as it is (its severity that
saving), to the report's ``dismissed`` list instead of the findings. This is how a victim stops
being named as a culprit: a rank that waits for a straggler, a link that carries a late rank's
traffic, cost nothing once the culprit is fixed.

``load_imbalance``: when the compute of all ranks together costs at least
:data:`IMBALANCE_MIN` of the step beyond what the named findings explain, and no rank nor stage
accounts for it (the top 3% of ranks by their own saving explain less than half, the last stage
less than half: the study's M_W and M_S), and it moves a data-parallel replica's forward and
backward passes together (:func:`_replica_share`: a host's noise does not), the
slowdown is work imbalance spread over replicas and steps (uneven sequence lengths): one
finding names the ranks and steps that lose most, in place of transient stalls. It is not
reported when a load imbalance by work given was found: that one names the cause (a report has
one ``load_imbalance`` at most), and its ranks' compute is fixed first anyway.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from analyzer.db import Run
from analyzer.findings.record import Finding
from analyzer.whatif import WhatIf, WhatIfError, prepare

log = logging.getLogger(__name__)

NOISE = 0.02  # a cause saving less than 2% of the step (its above fixed) is no finding
IMBALANCE_MIN = 0.05  # load_imbalance: all compute together costs at least 5% of the step
SHARE = 0.5  # ...of which no rank group (top 3%) and no stage explains half
WORKER_SHARE = 0.03
MAX_RANKS = 4096  # past this, severities stay the detectors' estimates (the replay costs more)
MAX_CELLS = 20_000_000  # operations x steps replayed (each array of them: 80 MB)
MAX_OPS = 1_000_000  # operations per step past which analyze leaves the replay to `whatif`
MIN_STEPS = 4
STEADY_STEPS = 5  # a steady cause's excess: the rolling median over this many steps
STEADY_MIN = 1.05  # ...in an operation that ran at least this much slower than its peers
# Fixed from the same operation on their peers, as a run without the fault would be: not capped
# at the study's ideal, whose typical over two peers is their mean (half a straggler's saving).
UNCAPPED = ("straggler", "slow_link", "hardware_imbalance")


class Costs:
    """The run's what-if, ready to price candidates."""

    def __init__(self, w: WhatIf, hosts: dict[int, str] | None = None) -> None:
        self.w = w
        s = w.graph.slots
        self.compute = w.graph.group < 0
        self.rank = s.rank
        self.label = np.array(s.ops)[s.op]  # op kind text per slot
        # a collective's peers span as many hosts: over the network, not NVLink (no fault)
        span = _host_span(w, hosts or {})
        self.peer = _peer_keys(s.rank, s.key.astype(np.int64) * (int(span.max()) + 1) + span)
        self.nbytes = np.where(self.compute, 0, w.times.template.nbytes[s.b]).astype(np.float64)
        self.t = float(np.mean(w.replay()))
        self.t_ideal = float(np.mean(w.ideal()))  # prepared with the study's typical

    @property
    def total(self) -> float:
        """The saving of ``megascope whatif``'s ideal (every operation at its typical
        duration, as the study defines it): what all the run's delays together cost."""
        return max(0.0, 1.0 - self.t_ideal / self.t) if self.t > 0 else 0.0

    def saving(
        self,
        mask: np.ndarray,
        base: np.ndarray | None = None,
        cap: bool = True,
        even: bool = False,
        steady: bool = False,
    ) -> float:
        """1 - T(mask fixed) / T, with ``cap`` at most the whole ideal's saving; with
        ``base``, the saving over the replay with ``base`` fixed (what ``mask`` adds to it);
        with ``even``, the mask's work spread evenly over its peers (:meth:`evened`) instead
        of taken away; with ``steady``, the mask's own excess taken away, its noise kept
        (:meth:`_unslowed`)."""
        if self.t <= 0 or not mask.any():
            return 0.0
        t0 = self.t if base is None else float(np.mean(self.w.replayer.run(self.fixed(base))))
        own = mask if base is None else mask & ~base
        d = self.evened(mask) if even else self.fixed(mask, steady=own if steady else None)
        t_fix = float(np.mean(self.w.replayer.run(d)))
        s = 1.0 - t_fix / t0 if t0 > 0 else 0.0
        return min(s, self.total) if cap else s

    def fixed(
        self, mask: np.ndarray, among: np.ndarray | None = None, steady: np.ndarray | None = None
    ) -> np.ndarray:
        """Measured durations with the ``mask`` slots at the median of their peers among
        ``among`` (default: the unmasked slots) in each step; those also in ``steady`` at
        their own durations over their steady excess (:meth:`_unslowed`)."""
        w = self.w
        d = w.measured.copy()
        key = self.peer
        rows = np.flatnonzero(mask)
        use = ~mask if among is None else among
        ref = _median_by_key(key, w.measured, use, rows)
        have = ~np.isnan(ref[:, 0])
        d[rows[have]] = ref[have]
        if steady is not None and (calm := have & steady[rows]).any():
            d[rows[calm]] = self._unslowed(rows[calm], ref[calm])
        lone = rows[~have]
        if len(lone):
            d[lone] = self._scaled(lone, mask)
        return d

    def _unslowed(self, rows: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """The ``rows``' measured durations divided by how much slower than their peers'
        median (``ref``) each operation ran, as a rolling median over :data:`STEADY_STEPS`
        steps: a run without the cause, not one without the noise.

        Setting a straggler to its peers' median removes its own jitter with its slowness,
        and two ranks that jitter apart wait for each other in every step: with one peer that
        wait is several percent of the step, and a run without the fault still has it. The
        excess is taken per operation (each piece of a span on its own), not per kind of
        operation: a rank whose extra time sits in one piece of its forward (the piece before
        the step's next collective, say) and not in the pieces between its tensor-parallel
        collectives keeps arriving late where it was late when one ratio is spread over every
        piece. The rolling median follows a cause that starts late; a step where the
        operation ran less than that much slower is fixed at the peers' median (never faster
        than them), and so is an operation that was not steadily slower (median ratio under
        :data:`STEADY_MIN`): a straggler whose extra time shows between the spans has no
        excess there to take out."""
        own = self.w.measured[rows].astype(np.float64)
        q = np.divide(own, ref, out=np.full_like(own, np.nan), where=ref > 0)
        roll = pd.DataFrame(q.T).rolling(STEADY_STEPS, center=True, min_periods=1).median()
        f = np.minimum(roll.to_numpy().T, np.maximum(q, 1.0))
        f = np.maximum(np.nan_to_num(f, nan=1.0), 1.0)
        out = (own / f).astype(self.w.measured.dtype)
        flat = np.median(np.nan_to_num(q, nan=1.0), axis=1) < STEADY_MIN
        out[flat] = ref[flat]
        return out

    def evened(self, mask: np.ndarray) -> np.ndarray:
        """Measured durations with the ``mask`` slots and every peer of theirs (the same
        operation on the other ranks) at their mean in each step: the same total work, spread
        evenly. A hot expert's extra tokens are taken from the other experts; routing them
        evenly gives every rank the mean, not the lighter ranks' time."""
        w = self.w
        d = w.measured.copy()
        key = self.peer
        want = np.zeros(int(key.max()) + 1 if len(key) else 0, bool)
        want[key[mask]] = True
        rows = np.flatnonzero(want[key])
        if not len(rows):
            return d
        k, inv = np.unique(key[rows], return_inverse=True)
        sums = np.zeros((len(k), d.shape[1]))
        np.add.at(sums, inv, w.measured[rows])
        d[rows] = (sums / np.bincount(inv, minlength=len(k))[:, None])[inv]
        return d

    def _scaled(self, lone: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Per lone slot and step: its measured time scaled by the unmasked ranks' median time
        in its kind of operation over its rank's own (per byte for transfers; unscaled where
        there is nothing to compare). A transfer kind its rank spent no time in that step gets
        its bytes at the median time per byte."""
        w = self.w
        out = w.measured[lone].astype(np.float32)
        for lab in np.unique(self.label[lone]):
            same = self.label == lab
            ranks, inv = np.unique(self.rank[same], return_inverse=True)
            per = np.zeros((len(ranks), w.measured.shape[1]))
            np.add.at(per, inv, w.measured[same])
            transfer = not self.compute[same][0]
            if transfer:  # transfers of other sizes: time per byte
                size = np.bincount(inv, weights=self.nbytes[same], minlength=len(ranks))
                if (size <= 0).any():
                    continue
                per /= size[:, None]
            masked = np.zeros(len(ranks), bool)
            np.logical_or.at(masked, inv, mask[same])
            if masked.all():
                continue
            ref = np.median(per[~masked], axis=0)
            pos = {int(r): i for i, r in enumerate(ranks)}
            for j in np.flatnonzero(self.label[lone] == lab):
                own = per[pos[int(self.rank[lone[j]])]]
                ratio = ref / np.where(own > 0, own, 1)
                idle = self.nbytes[lone[j]] * ref if transfer else out[j]
                out[j] = np.where(own > 0, out[j] * ratio, idle)
        return out

    def seen_excess(self, mask: np.ndarray) -> float:
        """Seconds per step by which the ``mask`` slots run over their peers' median (their
        :meth:`fixed` durations), summed over the slots, the mean over the steps: how much of a
        rank's excess the replay holds. Time that no span covers is in no slot (the replay has
        no gaps): a rank that sleeps between its spans holds its excess there."""
        if not mask.any():
            return 0.0
        rows = np.flatnonzero(mask)
        over = self.w.measured[rows] - self.fixed(mask)[rows]
        return float(np.maximum(over, 0).sum(axis=0).mean())

    # -- masks -------------------------------------------------------------------------------
    def ranks_compute(self, ranks: list[int]) -> np.ndarray:
        """Mask of the compute slots of ``ranks``."""
        return self.compute & np.isin(self.rank, ranks)

    def stage_compute(self, stage: int) -> np.ndarray:
        """Mask of the compute slots of pipeline stage ``stage``."""
        return self.compute & (self.w.coords["pp"] == stage)

    def link(self, ends: list[int], groups: set[str]) -> np.ndarray:
        """Members of every collective instance / send-recv whose members include both ends
        (all of ``ends`` when more than two), in the named groups."""
        g = self.w.graph
        m = g.members
        if not len(m):
            return np.zeros(len(g.group), bool)
        gid = np.repeat(np.arange(g.n_groups), np.diff(g.member_start))
        hits = np.bincount(gid, weights=np.isin(self.rank[m], ends), minlength=g.n_groups)
        need = 2 if len(ends) >= 2 else 1
        grp = np.array([o.rsplit(" ", 1)[-1] for o in g.slots.ops])[g.slots.op]
        ok = hits >= min(need, len(ends))
        if groups:
            first = m[g.member_start[:-1]]
            ok &= np.isin(grp[first], list(groups))
        mask = np.zeros(len(g.group), bool)
        mask[m[ok[gid]]] = True
        return mask


def _peer_keys(rank: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Which slots are peers: the same operation (``key``) at the same occurrence on its rank
    (the n-th ``forward#0/3`` of a rank is peer to the n-th on the others, not to its own
    other microbatches; a trace's kernels of one name but many shapes stay apart)."""
    if not len(key):
        return key
    order = np.lexsort((np.arange(len(key)), key, rank))
    r, k = rank[order], key[order]
    new = np.r_[True, (r[1:] != r[:-1]) | (k[1:] != k[:-1])]
    first = np.maximum.accumulate(np.where(new, np.arange(len(key)), 0))
    occ = np.empty(len(key), dtype=np.int64)
    occ[order] = np.arange(len(key)) - first
    return np.unique(key.astype(np.int64) * (int(occ.max()) + 1) + occ, return_inverse=True)[1]


def _host_span(w: WhatIf, hosts: dict[int, str]) -> np.ndarray:
    """Per slot: how many hosts its collective or send/recv instance spans (0: compute; an
    unknown host counts as one)."""
    g = w.graph
    out = np.zeros(len(g.group), np.int64)
    if not hosts or not len(g.members):
        return out
    names = {h: i + 1 for i, h in enumerate(sorted(set(hosts.values())))}
    by_rank = np.zeros(int(g.slots.rank.max()) + 1, np.int64)
    for r, h in hosts.items():
        if 0 <= r < len(by_rank):
            by_rank[r] = names[h]
    code = by_rank[g.slots.rank[g.members]]
    gid = np.repeat(np.arange(g.n_groups), np.diff(g.member_start))
    pairs = np.unique(np.stack([gid, code], axis=1), axis=0)
    out[g.members] = np.bincount(pairs[:, 0], minlength=g.n_groups)[gid]
    return out


def _median_by_key(key: np.ndarray, d: np.ndarray, use: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For each of ``rows``: the per-step median of ``d`` over the ``use`` slots of its key
    (NaN when there is none)."""
    out = np.full((len(rows), d.shape[1]), np.nan, dtype=np.float32)
    want = np.zeros(int(key.max()) + 1 if len(key) else 0, bool)
    want[key[rows]] = True
    peers = np.flatnonzero(want[key] & use)
    if not len(peers):
        return out
    order = peers[np.argsort(key[peers], kind="stable")]
    k = key[order]
    bounds = np.flatnonzero(np.r_[True, k[1:] != k[:-1], True])
    starts = {int(k[lo]): (lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)}
    mine = np.argsort(key[rows], kind="stable")
    rk = key[rows][mine]
    cuts = np.flatnonzero(np.r_[True, rk[1:] != rk[:-1], True])
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        span = starts.get(int(rk[a]))
        if span is not None:
            out[mine[a:b]] = np.median(d[order[span[0] : span[1]]], axis=0)
    return out


def rows_per_step(run: Run, lo: int, hi: int) -> float:
    """The median number of span and collective rows in a step of [lo, hi] (from the digests)."""
    got = run.query("findings/step_rows", lo=int(lo), hi=int(hi))
    return float(got["n"].median()) if len(got) else 0.0


def open_costs(run: Run, lo: int, hi: int) -> tuple[Costs | None, str | None]:
    """The run's what-if over the last steps of [lo, hi] that fit :data:`MAX_CELLS`
    (operations x steps; each step replays on its own), or None and why not."""
    if run.ranks is None and run.world_size > MAX_RANKS:
        return None, f"more than {MAX_RANKS} ranks"
    if hi < lo:
        return None, "no complete step"
    per_step = rows_per_step(run, lo, hi)
    if per_step > MAX_OPS:
        return None, f"{per_step:,.0f} operations per step (megascope whatif RUN replays them)"
    keep = max(MIN_STEPS, int(MAX_CELLS // per_step)) if per_step > 0 else hi - lo + 1
    try:
        # the opened run itself, so the parts it left out stay out; a restricted run holds
        # some ranks' rows only, and the what-if replays every rank
        source = run if run.ranks is None else run.path
        w = prepare(source, (max(lo, hi - keep + 1), hi), typical="study")
        got = run.execute("select rank, host from rank_coords where host is not null")
        return Costs(w, dict(zip(got["rank"].astype(int), got["host"], strict=True))), None
    except WhatIfError as e:
        return None, str(e)
    except (ValueError, IndexError, MemoryError) as e:  # a graph the engine cannot replay
        log.warning("megascope: no what-if for this run (%s); severities are estimates", e)
        return None, f"what-if failed: {e}"


def is_work_imbalance(f: Finding) -> bool:
    """A load imbalance by work given (its evidence names the work), not the spread one."""
    return f["kind"] == "load_imbalance" and "work" in f["evidence"]


def redistributed(f: Finding) -> bool:
    """A load imbalance whose work would be spread, not removed, without its cause: a hot
    expert's tokens (routed evenly, the other experts get them) or the all_to_all bytes they
    bring. A replica given more tokens is priced as a run without the extra tokens."""
    return is_work_imbalance(f) and f["evidence"]["work"]["kind"] in ("expert_tokens", "a2a_bytes")


def uncapped(f: Finding) -> bool:
    """Priced without the cap at the ideal's saving: fixed from the same operation on peers
    that run as a run without the cause would (:data:`UNCAPPED`, a load imbalance by work)."""
    return f["kind"] in UNCAPPED or is_work_imbalance(f)
