"""Candidate layouts of the run's ranks, and one step of each built and replayed.

A candidate is ``dp x tp x pp x cp`` equal to the run's world size, training the run's global
batch (``dp x microbatches`` microbatches of the run's size, so ``microbatches = global / dp``),
with or without full recompute and with the optimizer sharded over ``dp`` or not. A layout the
model cannot take (``tp`` not dividing the heads, the MLP or the vocabulary, ``cp`` not dividing
the sequence or the heads per ``tp`` rank, more stages than layers, a batch that ``dp`` does not
divide) is left out with its reason.

Each candidate's step is the simulator's step graph (:class:`analyzer.synth.stepgraph.StepGraph`:
1F1B over the stages, every layer's tensor- and context-parallel collectives, pipeline
transfers, the DP reduce-scatter, update and all-gather), with every block's duration set from
the fitted :class:`~analyzer.plan.fit.Costs` instead of drawn, and replayed once by the
what-if's :class:`~analyzer.whatif.replay.Replayer`. The replay gives the step time; two more
replays split it: without communication (what is left is compute and the pipeline's bubble),
and the busiest rank's own compute.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from analyzer.plan.fit import Costs
from analyzer.plan.shape import Shape
from analyzer.synth.cluster import build_cluster
from analyzer.synth.config import ModelShape, SynthConfig
from analyzer.synth.stepgraph import COLL, COMP, DATA, OPT, RECV, SEND, StepGraph
from analyzer.whatif.replay import Replayer


@dataclass(frozen=True)
class Layout:
    """One candidate: the mesh sizes, microbatches per step, recompute and whether the optimizer
    states are sharded over dp."""

    dp: int
    tp: int
    pp: int
    cp: int
    microbatches: int
    recompute: str = "none"  # none | full
    sharded: bool = True  # optimizer states sharded over dp (ZeRO-1)

    def mesh(self) -> dict[str, int]:
        """The layout's ``{dp, pp, tp, cp}``."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp}

    def key(self) -> tuple[int, int, int, int]:
        """The mesh sizes as (dp, tp, pp, cp), without recompute or sharding."""
        return self.dp, self.tp, self.pp, self.cp


@dataclass(frozen=True)
class Timing:
    """One candidate's replayed step and its split: compute, exposed communication and pipeline
    bubble (seconds)."""

    step_s: float
    compute_s: float  # the busiest rank's own compute (forward, backward, optimizer, data)
    exposed_comm_s: float  # what communication adds to the step
    bubble_s: float  # the step without communication, less the busiest rank's compute

    @property
    def dominant(self) -> str:
        """Which of compute, exposed communication and pipeline bubble takes the most of the
        step."""
        parts = {"compute": self.compute_s, "exposed communication": self.exposed_comm_s,
                 "pipeline bubble": self.bubble_s}  # fmt: skip
        return max(parts, key=lambda k: parts[k])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def why_not(shape: Shape, dp: int, tp: int, pp: int, cp: int) -> str | None:
    """Why the model cannot take this layout, or None."""
    g = shape.global_microbatches
    checks = [
        (shape.n_head % tp == 0, f"tp={tp} does not divide the {shape.n_head} heads"),
        (shape.ff % tp == 0, f"tp={tp} does not divide the MLP size {shape.ff}"),
        (shape.vocab % tp == 0, f"tp={tp} does not divide the vocabulary {shape.vocab}"),
        (shape.seq_len % cp == 0, f"cp={cp} does not divide seq_len {shape.seq_len}"),
        ((shape.n_head // tp) % cp == 0 if shape.n_head % tp == 0 else True,
         f"cp={cp} does not divide the heads per tensor-parallel rank"),
        (pp <= shape.n_layer, f"pp={pp} is more stages than the {shape.n_layer} layers"),
        (g % dp == 0, f"dp={dp} does not divide the global batch of {g} microbatches"),
        (not shape.sp or shape.seq_len % (tp * cp) == 0,
         f"sequence parallelism needs tp x cp = {tp * cp} to divide seq_len"),
    ]  # fmt: skip
    for ok, why in checks:
        if not ok:
            return why
    return None


def candidates(shape: Shape, *, recompute: tuple[str, ...] = ("none", "full"),
               sharded: tuple[bool, ...] = (True, False)) -> tuple[list[Layout], list[dict]]:  # fmt: skip
    """Every layout of the run's world (see the module docstring): those the model takes,
    and the others as ``{"dp", "tp", "pp", "cp", "reason"}``."""
    out, refused = [], []
    world = shape.world
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        why = why_not(shape, dp, tp, pp, cp)
        if why:
            refused.append({"dp": dp, "tp": tp, "pp": pp, "cp": cp, "reason": why})
            continue
        m = shape.global_microbatches // dp
        for rc, sh in itertools.product(recompute, sharded):
            if sh is False and dp == 1:
                continue  # one replica: sharded and not are the same
            out.append(Layout(dp, tp, pp, cp, m, rc, sh))
    return out, refused


def _graph(shape: Shape, lay: Layout) -> StepGraph:
    per_stage = -(-shape.n_layer // lay.pp)
    buckets = max(len(shape.dp_buckets(lay.pp, lay.tp, s)) for s in range(lay.pp))
    model = ModelShape(layers_per_stage=per_stage, hidden=shape.d_model, seq_len=shape.seq_len,
                       vocab=shape.vocab, micro_batch=shape.micro_batch, grad_buckets=buckets)  # fmt: skip
    cfg = SynthConfig(mesh=lay.mesh(), steps=1, microbatches=lay.microbatches, noise=0.0,
                      rank_spread=0.0, sp=shape.sp and lay.tp > 1, model=model)  # fmt: skip
    return StepGraph(cfg, build_cluster(cfg, np.random.default_rng(0)))


def _durations(
    shape: Shape, lay: Layout, costs: Costs, sg: StepGraph
) -> tuple[np.ndarray, np.ndarray]:
    """Each block's duration (the same on every rank of its stage), and the part of it that is
    communication: a collective's or transfer's whole, the trainer's collectives the step
    graph leaves out (:meth:`Shape.pass_extras`, spread over a pass's compute pieces by their
    fraction; :meth:`Shape.step_extras`, on the optimizer)."""
    scale = shape.act_bytes / 2.0  # the step graph sizes activations in bf16
    f = [shape.forward_flops(lay.pp, lay.tp, lay.cp, s) for s in range(lay.pp)]
    fwd = [x * costs.forward_s_per_flop for x in f]
    bwd = [x * costs.backward_s_per_flop for x in f]
    if lay.recompute == "full":
        bwd = [b + x * costs.recompute_s_per_flop for b, x in zip(bwd, f, strict=True)]
    upd = [shape.rank_params(lay.pp, lay.tp, s) / (lay.dp if lay.sharded else 1)
           for s in range(lay.pp)]  # fmt: skip
    tp_line = costs.line("tp")
    extra = [[sum(tp_line.seconds(op, lay.tp, b)
                  for op, b in shape.pass_extras(lay.pp, lay.tp, lay.cp, s, backward))
              for backward in (False, True)] for s in range(lay.pp)]  # fmt: skip
    per_step = sum(costs.line(axis).seconds(op, n, 4.0)
                   for axis, op, n in shape.step_extras(lay.mesh()))  # fmt: skip
    grads = [float(sum(shape.dp_buckets(lay.pp, lay.tp, s))) for s in range(lay.pp)]
    per_bucket = [g / sg.cfg.model.grad_buckets for g in grads]
    coll: dict[int, tuple[str, str, int, float]] = {}
    for s, rows in enumerate(sg.rows):
        for row, b in zip(rows.colls, rows.coll_blocks, strict=True):
            mb, op, axis, n, nbytes = row[0], row[1], row[2], int(row[3]), float(row[7])
            if mb >= 0:  # a pass's activations, sized in bf16 by the step graph
                nbytes *= scale
            elif axis == "dp":  # a gradient bucket
                nbytes = per_bucket[s]
            else:  # the cp all-reduce of every bucket
                nbytes = grads[s]
            coll[b] = (op, axis, n, nbytes)
    d = np.zeros(len(sg.blocks))
    comm = np.zeros(len(sg.blocks))
    for i, blk in enumerate(sg.blocks):
        s = blk.stage
        if blk.kind == DATA:
            d[i] = costs.data_s
        elif blk.kind == COMP:
            backward = blk.seconds > 1.5 * sg.fwd_s
            comm[i] = extra[s][backward] * blk.fraction
            d[i] = (bwd[s] if backward else fwd[s]) * blk.fraction + comm[i]
        elif blk.kind == OPT:
            comm[i] = per_step
            d[i] = upd[s] * costs.optimizer_s_per_param + per_step
        elif blk.kind == COLL:
            op, axis, n, nbytes = coll[i]
            d[i] = comm[i] = costs.line(axis).seconds(op, n, nbytes)
        elif blk.kind in (SEND, RECV):
            d[i] = comm[i] = costs.line("pp").seconds("send_recv", 2, sg.p2p_bytes * scale)
    return d, comm


def predict(shape: Shape, lay: Layout, costs: Costs) -> Timing:
    """One step of ``lay`` built and replayed (see the module docstring)."""
    sg = _graph(shape, lay)
    d, comm = _durations(shape, lay, costs, sg)
    rep = Replayer(sg.graph(), np.float64)
    R = sg.R

    def replay(x: np.ndarray) -> float:
        return float(rep.run(np.repeat(x, R)[:, None])[0])

    step = replay(d)
    own = d - comm
    quiet = replay(own)
    stage = np.array([b.stage for b in sg.blocks])
    compute = max(float(own[stage == s].sum()) for s in range(lay.pp))
    return Timing(step, compute, max(0.0, step - quiet), max(0.0, quiet - compute))
