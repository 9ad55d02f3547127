"""The graph of one training step, built once per run from the schedule.

The synth times its steps with the what-if's replay engine (:mod:`analyzer.whatif.replay`), so
its step is a graph of *slots* (each rank's operations) and *groups* (collectives, whose
members end together at the last arrival plus the transfer), as the what-if reads from a run.
Every operation happens on all ranks of one pipeline stage at once, so the graph is built from
*blocks*: a block is one operation of one stage, ``R = dp * cp * tp`` slots, slot
``block * R + j`` for the stage's ``j``-th rank (its ``(dp, cp, tp)`` position, C order).

Each rank's step, in order:

* ``pause`` (zero but on paused steps) and ``data``: the step begins where the rank's last
  step ended (the replay's ``origin``), a pause outside any span, then the data span;
* the stage's 1F1B (or interleaved) op list, walked in an order that respects the pipeline (a
  forward needs the previous stage's activations, a backward the next stage's gradients). A
  pass is its pieces (compute, collectives over tp or cp); the stage's first pass of the step
  opens with a ``gate`` (zero, infinite where a hang or crash fires: everyone who waits on the
  rank, directly or not, then never finishes). A pipeline transfer is a group of two, a send
  and a recv: it ends at the later of the two postings plus the transfer; the receiver waits
  for it, the sender does not (its next operation follows the pass the send left);
* the sharded optimizer: cp all_reduce, dp reduce_scatter of the gradient buckets, the
  update, dp all_gather.

Building the graph walks the op lists once, symbolically: it allocates blocks, records the
order in which the step's random numbers are drawn (:mod:`analyzer.synth.durations`) and the
rows each stage writes, whose times are references to its blocks' starts and ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from analyzer.synth.cluster import AXIS_OF, Cluster
from analyzer.synth.config import SynthConfig
from analyzer.synth.schedule import interleaved_1f1b, one_f_one_b, pass_pieces
from analyzer.whatif.graph import Graph, graph_from_arrays

PAUSE, DATA, GATE, COMP, OPT, COLL, SEND, RECV = range(8)


class SpanRow(NamedTuple):
    """A span's static columns, the same on every rank of the stage."""

    mb: int
    name: str
    kind: str
    source: str


class CollRow(NamedTuple):
    """A collective row's static columns: ``seq0 + step * dseq`` its sequence number in
    ``step`` (``dseq`` the key of the step's count while the graph is built), ``peer`` the
    offset of the peer's rank (0: none)."""

    mb: int
    op: str
    group: str
    size: int
    seq0: int
    dseq: Any
    peer: int
    nbytes: int


@dataclass
class Rows:
    """The rows one stage writes per step: their static columns and the blocks they time.

    A span runs from the start of its first block to the end of its last; a collective row
    is one block: issued at the block's start (its arrival), started then (a send or recv: at
    the later posting of the pair), ended at the block's end. ``seq0 + step * dseq`` is the
    row's sequence number in ``step``."""

    spans: list[SpanRow] = field(default_factory=list)
    span_blocks: list[tuple[int, int]] = field(default_factory=list)  # (first, last)
    colls: list[CollRow] = field(default_factory=list)
    coll_blocks: list[int] = field(default_factory=list)


@dataclass
class Block:
    """One operation of one stage (its ``R`` slots), with what its durations need."""

    stage: int
    kind: int
    pred: int  # block whose end this one waits for (same ranks), -1: none
    seconds: float = 0.0  # compute: base seconds (x fraction); collective: bytes x bus factor
    fraction: float = 1.0
    work: bool = False  # the pass's work factor applies
    axis: int = -1  # collective: array axis of its groups
    link: int = -1  # send/recv: pipeline link (stage s <-> s + 1), -1: the wrap-around
    pair: int = -1  # send/recv: the other side
    draw: int = -1  # offset of its random numbers in the step's draws (recv: the pair's)


BUS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


class StepGraph:
    """A step's blocks, draws and rows (see the module docstring); :meth:`graph` expands it."""

    def __init__(self, cfg: SynthConfig, cluster: Cluster) -> None:
        self.cfg, self.cl = cfg, cluster
        m = cfg.model
        self.R, self.shape, self.pp = cluster.stage_size, cluster.shape, cluster.pp
        tokens = m.micro_batch * m.seq_len
        tp, cp = cfg.mesh["tp"], cfg.mesh["cp"]
        stage_params = m.layer_params() * m.layers_per_stage
        chunk_layers = m.layers_per_stage // cfg.vpp  # a model chunk's share of the stage
        self.fwd_s = 2.0 * stage_params * tokens / (tp * cp) / (m.peak_flops * m.efficiency)
        self.fwd_s /= cfg.vpp
        act = tokens // cp * m.hidden * 2  # bf16 activations of one microbatch's shard
        layers = chunk_layers if cfg.detail == "coarse" else 1
        self.nbytes = {"act": act * layers, "kv": 2 * tokens * m.hidden // tp * 2 * layers}
        self.p2p_bytes = act // tp if cfg.sp else act
        self.bucket_bytes = int(stage_params / tp * 2 / m.grad_buckets)
        self.opt_s = 5e-4 + m.optimizer_ms_per_gparam * stage_params / (tp * cfg.mesh["dp"]) / 1e12
        flags = {"sp": cfg.sp, "tp": tp > 1, "cp": cp > 1, "coarse": cfg.detail == "coarse"}
        self.pieces = {b: pass_pieces(b, layers=chunk_layers, **flags) for b in (False, True)}
        self.ops = [
            [(kind, 0, mb) for kind, mb in one_f_one_b(s, self.pp, cfg.microbatches)]
            if cfg.vpp == 1
            else interleaved_1f1b(s, self.pp, cfg.microbatches, cfg.vpp)
            for s in range(self.pp)
        ]
        self.blocks: list[Block] = []
        self.draws: list[tuple[int, int, bool]] = []  # (block, count, half sigma), draw order
        self.rows = [Rows() for _ in range(self.pp)]
        self.last = [-1] * self.pp  # per stage: the block the next operation waits for
        self.seq: dict[tuple, int] = {}  # per (stage, axis) / stage pair: this step's count
        self.n_draws = 0
        self._build()
        # per step, every group's seq moves on by the step's count of it
        for rows in self.rows:
            rows.colls = [c._replace(dseq=self.seq[c.dseq]) for c in rows.colls]

    # ----------------------------------------------------------------- allocation

    def _block(self, stage: int, kind: int, **kw) -> int:
        """A new block on ``stage`` after the stage's last one, which it becomes."""
        b = len(self.blocks)
        self.blocks.append(Block(stage, kind, self.last[stage], **kw))
        self.last[stage] = b
        return b

    def _draw(self, block: int, count: int, half: bool) -> None:
        if self.cfg.noise > 0:
            self.blocks[block].draw = self.n_draws
            self.draws.append((block, count, half))
            self.n_draws += count

    def _count(self, key: tuple) -> int:
        n = self.seq.get(key, 0)
        self.seq[key] = n + 1
        return n

    def _compute(self, s: int, kind: int, seconds: float, fraction: float = 1.0, work=False):
        b = self._block(s, kind, seconds=seconds, fraction=fraction, work=work)
        self._draw(b, self.R, False)
        return b

    def _collective(self, s: int, axis: str, op: str, nbytes: int, mb: int) -> int:
        ax = AXIS_OF[axis]
        n = self.shape[ax]
        b = self._block(s, COLL, seconds=nbytes * BUS_FACTOR[op](n), axis=ax)
        self._draw(b, self.R // n, True)
        seq = self._count((s, axis))
        self.rows[s].colls.append(CollRow(mb, op, axis, n, seq, (s, axis), 0, nbytes))
        self.rows[s].coll_blocks.append(b)
        return b

    def _transfer(self, src: int, dst: int, sent: int, mb: int) -> None:
        """A pipeline send ``src -> dst`` (adjacent stages, or with model chunks the last
        stage and the first, same position) of what block ``sent`` produced."""
        link = min(src, dst) if abs(src - dst) == 1 else -1
        send = len(self.blocks)
        self.blocks.append(Block(src, SEND, sent, link=link, pair=send + 1))
        recv = self._block(dst, RECV, link=link, pair=send)
        self._draw(recv, self.R, True)
        self.blocks[send].draw = self.blocks[recv].draw
        key: tuple[str] | tuple[int, int]
        if self.cfg.vpp == 1:  # per (sender, receiver) pair: step * microbatches + mb
            seq, key = mb, ("microbatches",)
            self.seq[key] = self.cfg.microbatches  # the seq's step increment
        else:  # several chunks share a pair: number the transfers in the order they run
            key = (src, dst)
            seq = self._count(key)
        offset = (dst - src) * self.R
        for stage, b, op, off in ((src, send, "send", offset), (dst, recv, "recv", -offset)):
            row = CollRow(mb, op, "pp", self.pp, seq, key, off, self.p2p_bytes)
            self.rows[stage].colls.append(row)
            self.rows[stage].coll_blocks.append(b)

    # ----------------------------------------------------------------- the step

    def _build(self) -> None:
        m = self.cfg.model
        pause = []
        for s in range(self.pp):
            pause.append(self._block(s, PAUSE))
            b = self._compute(s, DATA, m.data_ms / 1e3)
            self.rows[s].spans.append(SpanRow(-1, "data", "data", "host"))
            self.rows[s].span_blocks.append((b, b))
        self._pipeline()
        for s in range(self.pp):
            self._optimizer(s)
            self.rows[s].spans.append(SpanRow(-1, "step", "host", "host"))
            self.rows[s].span_blocks.append((pause[s], self.last[s]))

    def _pass(self, s: int, mb: int, backward: bool, first: bool) -> None:
        """One forward or backward of microbatch ``mb`` on stage ``s``, with its collectives."""
        opening = self._block(s, GATE) if first else -1
        base = self.fwd_s * (2.0 if backward else 1.0)
        for p in self.pieces[backward]:
            if p.fraction > 0:
                b = self._compute(s, COMP, base, p.fraction, work=True)
                opening = b if opening < 0 else opening
            if p.op:
                b = self._collective(s, p.axis, p.op, self.nbytes[p.size], mb)
                opening = b if opening < 0 else opening
        name = "backward" if backward else "forward"
        self.rows[s].spans.append(SpanRow(mb, name, "compute", "cuda"))
        self.rows[s].span_blocks.append((opening, self.last[s]))

    def _neighbour(self, kind: str, s: int, chunk: int, upstream: bool) -> tuple[int, int]:
        """The (stage, chunk) that feeds (``upstream``) or is fed by an op; (-1, -1): none.

        Forwards flow to higher global chunks (``chunk * pp + stage``), backwards to lower."""
        step = (-1 if kind == "F" else 1) * (1 if upstream else -1)
        g = chunk * self.pp + s + step
        if not 0 <= g < self.pp * self.cfg.vpp:
            return -1, -1
        return g % self.pp, g // self.pp

    def _pipeline(self) -> None:
        """Walk the stages' op lists, running every op whose input has been sent.

        ``sent[(kind, s, chunk, mb)]`` is the block after which stage ``s`` sends microbatch
        ``mb``'s activations (``F``) or gradients (``B``) out of model chunk ``chunk``."""
        pp = self.pp
        sent: dict[tuple[str, int, int, int], int] = {}
        pos = [0] * pp
        while any(pos[s] < len(self.ops[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while pos[s] < len(self.ops[s]):
                    kind, chunk, mb = self.ops[s][pos[s]]
                    src = self._neighbour(kind, s, chunk, upstream=True)
                    if src[0] >= 0 and (kind, *src, mb) not in sent:
                        break
                    if src[0] >= 0:
                        self._transfer(src[0], s, sent.pop((kind, *src, mb)), mb)
                    self._pass(s, mb, backward=kind == "B", first=pos[s] == 0)
                    if self._neighbour(kind, s, chunk, upstream=False)[0] >= 0:
                        sent[(kind, s, chunk, mb)] = self.last[s]
                    pos[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"1F1B schedule stuck at {pos} (pp={pp}, vpp={self.cfg.vpp})")

    def _optimizer(self, s: int) -> None:
        """Sharded optimizer: reduce-scatter gradient buckets, update the shard, all-gather."""
        m = self.cfg.model
        if self.shape[AXIS_OF["cp"]] > 1:
            self._collective(s, "cp", "all_reduce", self.bucket_bytes * m.grad_buckets, -1)
        dp = self.shape[AXIS_OF["dp"]] > 1
        for _ in range(m.grad_buckets if dp else 0):
            self._collective(s, "dp", "reduce_scatter", self.bucket_bytes, -1)
        b = self._compute(s, OPT, self.opt_s)
        self.rows[s].spans.append(SpanRow(-1, "optimizer", "compute", "cuda"))
        self.rows[s].span_blocks.append((b, b))
        for _ in range(m.grad_buckets if dp else 0):
            self._collective(s, "dp", "all_gather", self.bucket_bytes, -1)

    # ----------------------------------------------------------------- the replay's graph

    def group_of(self, axis: int) -> np.ndarray:
        """For each position ``j`` of a stage, its group along ``axis`` (C order of the other
        axes, as the per-group arrays of :class:`Cluster` flatten)."""
        idx = np.indices(self.shape).reshape(3, -1)
        others = [k for k in range(3) if k != axis]
        return np.ravel_multi_index([idx[k] for k in others], [self.shape[k] for k in others])

    def graph(self) -> Graph:
        """The slot graph: blocks expanded to their ``R`` slots, with levels for the replay
        (a slot after the node its start needs; a group in its last member's level)."""
        R, nb = self.R, len(self.blocks)
        stage = np.array([b.stage for b in self.blocks], dtype=np.int64)
        pred = np.array([b.pred for b in self.blocks], dtype=np.int64)
        kind = np.array([b.kind for b in self.blocks])
        axis = np.array([b.axis for b in self.blocks])
        size = np.array([*self.shape, 1])[axis]  # a collective's group size (else 1)
        ngroups = np.where(kind == COLL, R // size, np.where(kind == RECV, R, 0))
        g0 = np.cumsum(ngroups) - ngroups  # a block's groups (a pair's: its recv's)
        level, done = np.zeros(nb, dtype=np.int64), np.zeros(nb, dtype=np.int64)
        for i, b in enumerate(self.blocks):  # blocks come in an order that respects preds
            level[i] = done[b.pred] + 1 if b.pred >= 0 else 0
            done[i] = level[i]
            if b.kind == RECV:
                done[i] = done[b.pair] = max(level[i], level[b.pair])
        j = np.arange(R, dtype=np.int64)
        group = np.full((nb, R), -1, dtype=np.int64)
        for ax in range(3):
            sel = np.flatnonzero((kind == COLL) & (axis == ax))
            group[sel] = g0[sel, None] + self.group_of(ax)[None, :]
        recv = np.flatnonzero(kind == RECV)
        group[recv] = g0[recv, None] + j
        group[[self.blocks[r].pair for r in recv]] = group[recv]
        # levels: slices of the slots (block by block) and groups sorted by level
        order = np.argsort(level, kind="stable")
        slots = (order[:, None] * R + j).reshape(-1)
        n_levels = int(done.max()) + 1 if nb else 0
        cut = np.searchsorted(level[order], np.arange(n_levels + 1)) * R
        owner = np.flatnonzero(ngroups)
        owner = owner[np.argsort(done[owner], kind="stable")]
        n = ngroups[owner]
        groups = np.repeat(g0[owner] - (np.cumsum(n) - n), n) + np.arange(n.sum())
        gcut = np.r_[0, np.cumsum(n)][np.searchsorted(done[owner], np.arange(n_levels + 1))]
        levels = [(slots[cut[i] : cut[i + 1]], groups[gcut[i] : gcut[i + 1]])
                  for i in range(n_levels)]  # fmt: skip
        return graph_from_arrays(
            (stage[:, None] * R + j).reshape(-1),
            np.where(pred[:, None] >= 0, pred[:, None] * R + j, -1).reshape(-1),
            group.reshape(-1),
            levels,
        )
