"""The step model: a discrete-event simulation of 1F1B training (plain, or interleaved over
model chunks), vectorized across ranks.

Each pipeline stage has a clock, one float64 per rank in a ``(dp, cp, tp)`` array (seconds
since the run's start). The stages' 1F1B op lists are walked in an order that respects their
dependencies (a forward needs the previous stage's activations, a backward the next stage's
gradients), and each op advances the clocks of all of the stage's ranks at once:

* compute takes ``base * lasting factor * step factor * lognormal noise``;
* a collective over an axis ends, for every member, at the last member's arrival plus a transfer
  time ``latency + bytes * busbw_factor(n) / bandwidth * slow_link * noise`` (nccl-tests
  factors: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n);
* a pipeline transfer starts when both the (non-blocking) send and the receive are posted and
  takes ``latency + bytes / bandwidth``; the receiver waits for it, the sender does not.

After the last backward, every stage reduce-scatters its gradient buckets over dp, runs the
optimizer on its shard and all-gathers the parameters back (a ZeRO-style sharded optimizer).

Hangs and crashes make a rank's clock infinite at its first compute of the step; ``max`` then
carries the infinity to every rank that waits on it, directly or through a chain of
dependencies, which is exactly what a stuck job looks like.
"""

from __future__ import annotations

import numpy as np

from analyzer.synth.cluster import AXIS_OF, Cluster
from analyzer.synth.config import SynthConfig
from analyzer.synth.record import StageLog
from analyzer.synth.schedule import interleaved_1f1b, one_f_one_b, pass_pieces

BUS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


class StepModel:
    """Simulates steps one after the other, appending their events to per-stage logs."""

    def __init__(self, cfg: SynthConfig, cluster: Cluster, rng: np.random.Generator) -> None:
        self.cfg, self.cl, self.rng = cfg, cluster, rng
        m, shape = cfg.model, cluster.shape
        self.shape = shape
        self.clock = [np.zeros(shape) for _ in range(cluster.pp)]
        self.logs = [StageLog() for _ in range(cluster.pp)]
        self.seq = {(s, a): 0 for s in range(cluster.pp) for a in AXIS_OF}
        tokens = m.micro_batch * m.seq_len
        tp, cp = cfg.mesh["tp"], cfg.mesh["cp"]
        stage_params = m.layer_params() * m.layers_per_stage
        self.vpp = cfg.vpp
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
        self.ops: list[list[tuple[str, int, int]]] = [
            [(kind, 0, mb) for kind, mb in one_f_one_b(s, cluster.pp, cfg.microbatches)]
            if cfg.vpp == 1
            else interleaved_1f1b(s, cluster.pp, cfg.microbatches, cfg.vpp)
            for s in range(cluster.pp)
        ]
        self.step_factor = [np.ones(shape) for _ in range(cluster.pp)]
        self.work: list[np.ndarray] | None = None  # per-stage forward/backward factor this step
        self.pair_seq: dict[tuple[int, int], int] = {}  # interleaved: next seq per stage pair
        self.blocked = [np.zeros(shape, dtype=bool) for _ in range(cluster.pp)]
        self.step = 0

    # ----------------------------------------------------------------- helpers

    def _noise(self, sigma: float, shape) -> np.ndarray:
        return self.rng.lognormal(0.0, sigma, size=shape) if sigma > 0 else np.ones(shape)

    def _compute(self, s: int, seconds: float, t: np.ndarray) -> np.ndarray:
        """Advance stage ``s`` by ``seconds`` of compute on every rank."""
        dur = seconds * self.cl.compute[s] * self.step_factor[s]
        return t + dur * self._noise(self.cfg.noise, self.shape)

    def _collective(
        self, s: int, axis: str, op: str, nbytes: int, arrival: np.ndarray, mb: int
    ) -> np.ndarray:
        """One collective over every ``axis`` group of stage ``s``; returns the members' ends."""
        ax = AXIS_OF[axis]
        n = self.shape[ax]
        last = arrival.max(axis=ax, keepdims=True)
        bw = self.cl.bandwidth[axis][s]
        gshape = bw.shape
        xfer = self.cfg.model.latency_s + nbytes * BUS_FACTOR[op](n) / bw
        xfer = xfer * self.cl.link[axis][s] * self._noise(self.cfg.noise / 2, gshape)
        end = np.broadcast_to(last + xfer, self.shape)
        seq = self.seq[(s, axis)]
        self.seq[(s, axis)] = seq + 1
        self.logs[s].collective(self.step, mb, op, axis, n, seq, 0, nbytes, arrival, arrival, end)
        return np.array(end)

    def _transfer(
        self, src: int, dst: int, send_at: np.ndarray, recv_at: np.ndarray, mb: int
    ) -> np.ndarray:
        """A pipeline send ``src -> dst`` (adjacent stages, or with model chunks the last
        stage and the first, same position); returns its end."""
        if abs(src - dst) == 1:
            link = min(src, dst)
            bw, slow = self.cl.p2p_bandwidth[link], self.cl.p2p_link[link]
        else:
            bw, slow = self.cl.wrap_bandwidth, self.cl.wrap_link
        start = np.maximum(send_at, recv_at)
        xfer = self.cfg.model.latency_s + self.p2p_bytes / bw
        end = start + xfer * slow * self._noise(self.cfg.noise / 2, self.shape)
        if self.vpp == 1:
            seq = self.step * self.cfg.microbatches + mb  # per (sender, receiver) pair
        else:  # several chunks share a pair: number the transfers in the order they run
            seq = self.pair_seq.get((src, dst), 0)
            self.pair_seq[(src, dst)] = seq + 1
        offset = (dst - src) * self.cl.stage_size
        pp = self.cl.pp
        self.logs[src].collective(
            self.step, mb, "send", "pp", pp, seq, offset, self.p2p_bytes, send_at, start, end
        )
        self.logs[dst].collective(
            self.step, mb, "recv", "pp", pp, seq, -offset, self.p2p_bytes, recv_at, start, end
        )
        return end

    def _pass(self, s: int, mb: int, backward: bool) -> None:
        """One forward or backward of microbatch ``mb`` on stage ``s``, with its collectives."""
        t0 = self.clock[s]
        t = t0
        if self.blocked[s].any():  # a hang or crash fires as the step's first compute span opens
            t = np.where(self.blocked[s], np.inf, t)
            self.blocked[s][:] = False
        base = self.fwd_s * (2.0 if backward else 1.0)
        if self.work is not None:
            base = base * self.work[s]
        for p in self.pieces[backward]:
            if p.fraction > 0:
                t = self._compute(s, base * p.fraction, t)
            if p.op:
                t = self._collective(s, p.axis, p.op, self.nbytes[p.size], t, mb)
        name = "backward" if backward else "forward"
        self.logs[s].span(self.step, mb, name, "compute", "cuda", t0, t)
        self.clock[s] = t

    # ----------------------------------------------------------------- a step

    def _neighbour(self, kind: str, s: int, chunk: int, upstream: bool) -> tuple[int, int]:
        """The (stage, chunk) that feeds (``upstream``) or is fed by an op; (-1, -1): none.

        Forwards flow to higher global chunks (``chunk * pp + stage``), backwards to lower."""
        step = (-1 if kind == "F" else 1) * (1 if upstream else -1)
        g = chunk * self.cl.pp + s + step
        if not 0 <= g < self.cl.pp * self.vpp:
            return -1, -1
        return g % self.cl.pp, g // self.cl.pp

    def _pipeline(self) -> None:
        """Walk the stages' 1F1B lists, running every op whose input has arrived.

        ``sent[(kind, s, chunk, mb)]`` holds the time stage ``s`` posted the send of microbatch
        ``mb``'s activations (``F``) or gradients (``B``) out of model chunk ``chunk``; an op
        waits until its input is there.
        """
        pp = self.cl.pp
        sent: dict[tuple[str, int, int, int], np.ndarray] = {}
        pos = [0] * pp
        while any(pos[s] < len(self.ops[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while pos[s] < len(self.ops[s]):
                    kind, chunk, mb = self.ops[s][pos[s]]
                    src = self._neighbour(kind, s, chunk, upstream=True)
                    if src[0] >= 0 and (kind, *src, mb) not in sent:
                        break
                    self._run_op(s, kind, chunk, mb, src, sent)
                    pos[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"1F1B schedule stuck at {pos} (pp={pp}, vpp={self.vpp})")

    def _run_op(
        self, s: int, kind: str, chunk: int, mb: int, src: tuple[int, int], sent: dict
    ) -> None:
        """Receive the input from ``src`` (if any), run the pass, post the send onwards."""
        if src[0] >= 0:
            posted = sent.pop((kind, *src, mb))
            self.clock[s] = self._transfer(src[0], s, posted, self.clock[s], mb)
        self._pass(s, mb, backward=kind == "B")
        if self._neighbour(kind, s, chunk, upstream=False)[0] >= 0:
            sent[(kind, s, chunk, mb)] = self.clock[s]

    def _optimizer(self, s: int) -> None:
        """Sharded optimizer: reduce-scatter gradient buckets, update the shard, all-gather."""
        m = self.cfg.model
        t = self.clock[s]
        if self.shape[AXIS_OF["cp"]] > 1:
            t = self._collective(s, "cp", "all_reduce", self.bucket_bytes * m.grad_buckets, t, -1)
        dp = self.shape[AXIS_OF["dp"]] > 1
        for _ in range(m.grad_buckets if dp else 0):
            t = self._collective(s, "dp", "reduce_scatter", self.bucket_bytes, t, -1)
        t0 = t
        t = self._compute(s, self.opt_s, t)
        self.logs[s].span(self.step, -1, "optimizer", "compute", "cuda", t0, t)
        for _ in range(m.grad_buckets if dp else 0):
            t = self._collective(s, "dp", "all_gather", self.bucket_bytes, t, -1)
        self.clock[s] = t

    def run_step(
        self,
        step: int,
        factors: list[np.ndarray],
        blocked: list[np.ndarray],
        work: list[np.ndarray] | None = None,
    ) -> None:
        """Simulate step ``step`` on every rank.

        ``factors[s]`` multiplies stage ``s``'s compute this step (throttle, regression);
        ``work[s]`` (None: 1) its forwards and backwards only (uneven work per dp rank);
        ``blocked[s]`` marks the ranks that hang or crash as this step's first compute opens.
        The step begins with a heartbeat and (on paused ranks) a pause outside any span, then
        the data span, the pipeline and the optimizer; the ``step`` span covers all of it.
        """
        self.step = step
        self.step_factor = factors
        self.work = work
        self.blocked = [b.copy() for b in blocked]
        begin = [c.copy() for c in self.clock]
        m = self.cfg.model
        for s in range(self.cl.pp):
            t = self.clock[s] + self._pauses(s, step)
            data = m.data_ms / 1e3 * self._noise(self.cfg.noise, self.shape) + self._slow_data(s)
            self.logs[s].span(step, -1, "data", "data", "host", t, t + data)
            self.clock[s] = t + data
        self._pipeline()
        for s in range(self.cl.pp):
            self._optimizer(s)
            self.logs[s].span(step, -1, "step", "host", "host", begin[s], self.clock[s])

    def _pauses(self, s: int, step: int) -> np.ndarray:
        """Seconds of pause (a GC-like stall) each rank of stage ``s`` takes as ``step`` begins:
        ``pause:rank=R,every=N,ms=M`` fires on steps ``N, 2N, ...`` (as the trainer does)."""
        out = np.zeros(self.shape)
        for f in self.cfg.faults:
            if f.kind == "pause" and step > 0 and step % f.every == 0:
                self._add_at_rank(out, s, f.rank, f.ms / 1e3)
        return out

    def _slow_data(self, s: int) -> np.ndarray:
        out = np.zeros(self.shape)
        for f in self.cfg.faults:
            if f.kind == "slow_data":
                self._add_at_rank(out, s, f.rank, f.ms / 1e3)
        return out

    def _add_at_rank(self, arr: np.ndarray, s: int, rank: int, value: float) -> None:
        size = self.cl.stage_size
        if rank // size == s:
            arr.reshape(-1)[rank % size] += value

    def finite(self) -> bool:
        """Whether any rank can still make progress."""
        return any(np.isfinite(c).any() for c in self.clock)
