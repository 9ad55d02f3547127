"""The work each simulated rank is given, and what it does to its compute.

The simulator writes the ``work`` table of docs/spec.md §2 beside the spans, so that the
analyzer can tell a rank that was given more work from one that is slower at the same work:

* ``tokens``: every rank of a data-parallel replica records its replica's tokens per
  microbatch (``micro_batch * seq_len``; ``seq_skew:rank=R,factor=F`` gives R's replica F
  times as many);
* ``attention`` (only with ``--work-imbalance``, the simulator's uneven sequence lengths): the
  sum of the squared document lengths, one document per row, times that step's work factor;
* ``expert_tokens`` (only with ``experts``): per microbatch and expert, the token assignments
  the routers of its expert-parallel group sent it, summed over the stage's MoE layers, on
  every rank that holds it (every stage, tensor and context rank of its ep index).

Routing: each router sends ``TOP_K`` assignments per token, spread over the experts with
preferences drawn per (router, microbatch, step) around even (lognormal, sigma
:data:`EXPERT_NOISE`: a healthy run's experts differ by a few percent, never exactly zero);
``hot_expert:expert=E,share=S`` sends share S of every router's assignments to E and the rest
as it would have.

Compute: a block's forward and backward are :data:`MLP_SHARE` MLP (the experts: two matrices of
4 x hidden against attention's four of hidden) and the rest attention and projections. The
non-MLP part scales with the replica's own tokens, the MLP part with the token assignments its
experts received over an even share (``TOP_K`` x its own tokens; a dense MLP: its own tokens).
So a holder that processes x times the even expert tokens computes ``1/3 + 2/3 x`` as long, a
replica given F times the tokens F times as long. The all_to_all that moves tokens to the
experts is not drawn (its time stays inside the compute), so ``a2a_sent`` rows are not
written. Rows per rank, step and microbatch: one (tokens) in a plain run, so the largest
simulated runs grow by little; an attention row and an expert row per expert held only when
asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from analyzer.synth.cluster import Cluster
from analyzer.synth.config import SynthConfig
from tracer.rundir import coords_of
from tracer.schema import TABLES

MLP_SHARE = 2.0 / 3.0  # of a forward or backward: the MLP's (experts') share of the compute
TOP_K = 2  # experts each token is routed to (the trainer's default)
EXPERT_NOISE = 0.03  # lognormal sigma of a router's preference for an expert
_KINDS = ("tokens", "attention", "expert_tokens")


@dataclass
class WorkChunk:
    """A chunk of steps' work rows for every position of a stage (the same on every stage):
    per row its step, microbatch and kind (shared), its value and key per dp index."""

    step: np.ndarray  # (n,) int32
    microbatch: np.ndarray  # (n,) int32
    kind: np.ndarray  # (n,) index into _KINDS
    value: np.ndarray  # (dp, n) int64
    key: np.ndarray  # (dp, n) int32
    dp_of: np.ndarray  # (R,) each stage position's dp index

    def _columns(self, dp: np.ndarray, keep: np.ndarray, ranks: np.ndarray) -> dict:
        """Columns of the kept entries of the (len(dp), n) matrix of rows of ``ranks``."""
        n = len(self.step)
        flat = np.flatnonzero(keep)
        col = flat % n
        kinds = pa.DictionaryArray.from_arrays(
            pa.array(self.kind[col].astype(np.int32)), pa.array(list(_KINDS))
        )
        return {
            "rank": pa.array(ranks[flat // n].astype(np.int32)),
            "step": pa.array(self.step[col]),
            "microbatch": pa.array(self.microbatch[col]),
            "kind": kinds,
            "key": pa.array(self.key[dp].reshape(-1)[flat]),
            "value": pa.array(self.value[dp].reshape(-1)[flat]),
            "group": pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(len(flat), np.int32)), pa.array([""])
            ),
            "seq": pa.array(np.full(len(flat), -1, dtype=np.int64)),
        }

    def table(self, first_rank: int, positions: np.ndarray, lost: np.ndarray | None) -> pa.Table:
        """The rows of the stage's ``positions`` (global rank ``first_rank + position``), rank
        after rank; ``lost``: per position the first step whose rows a crash lost."""
        dp = self.dp_of[positions]
        keep = np.ones((len(positions), len(self.step)), bool)
        if lost is not None:
            keep &= self.step[None, :] < lost[:, None]
        cols = self._columns(dp, keep, first_rank + positions)
        names = TABLES["work"].names
        return pa.Table.from_arrays([cols[c] for c in names], names=names)


class WorkModel:
    """Per step: each rank's work rows and the compute factor they cause (module docstring)."""

    def __init__(self, cfg: SynthConfig, cl: Cluster) -> None:
        m = cfg.model
        self.dp, self.mb = cl.shape[0], cfg.microbatches
        self.dp_of = np.repeat(np.arange(self.dp), cl.stage_size // self.dp)
        self.rows_tokens = m.micro_batch * m.seq_len
        self.attention_unit = m.micro_batch * m.seq_len**2  # one document per row
        self.layers = m.layers_per_stage
        self.tok = np.ones(self.dp)
        for f in cfg.faults:
            if f.kind == "seq_skew":
                self.tok[coords_of(f.rank, cfg.mesh)["dp"]] *= f.factor
        self.experts, self.ep = cfg.experts, cfg.ep if cfg.experts else 1
        self.held = self.experts // self.ep if self.experts else 0
        self.hot = [(f.expert, f.share) for f in cfg.faults if f.kind == "hot_expert"]
        self.rng = np.random.default_rng([cfg.seed, 0xE7])  # its own stream
        self.plain = not self.experts and (self.tok == 1.0).all()
        self.begin()

    def begin(self) -> None:
        """Start a chunk of steps."""
        self._steps: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def _routing(self) -> np.ndarray:
        """(dp, mb, experts): the share of each router's assignments each expert receives."""
        q = self.rng.lognormal(0.0, EXPERT_NOISE, size=(self.dp, self.mb, self.experts))
        q /= q.sum(axis=2, keepdims=True)
        for expert, share in self.hot:
            rest = 1.0 - q[..., expert : expert + 1]
            q *= np.where(rest > 0, (1.0 - share) / np.where(rest > 0, rest, 1.0), 0.0)
            q[..., expert] = share
        return q

    def step(self, step: int, imbalance: np.ndarray | None) -> np.ndarray | None:
        """Record ``step``'s rows; return the forward/backward compute factor per stage
        position (None: every rank does the even work). ``imbalance``: the step's factor per
        dp index from ``--work-imbalance`` (None when off), which the attention rows carry."""
        tokens = self.rows_tokens * self.tok  # (dp,) per microbatch
        cols = [np.repeat(tokens[:, None], self.mb, axis=1)[..., None]]  # (dp, mb, 1)
        keys = [np.full((self.dp, self.mb, 1), -1)]
        factor = self.tok.copy()
        if imbalance is not None:
            att = self.attention_unit * self.tok * imbalance
            cols.append(np.repeat(att[:, None], self.mb, axis=1)[..., None])
            keys.append(keys[0])
        if self.experts:
            p = self._routing() * (TOP_K * tokens)[:, None, None]  # assignments per router
            group = np.arange(self.dp) // self.ep
            sent = np.zeros((self.dp // self.ep, self.mb, self.experts))
            np.add.at(sent, group, p)  # per ep group, what its experts receive
            first = (np.arange(self.dp) % self.ep) * self.held
            mine = first[:, None] + np.arange(self.held)[None, :]  # (dp, held) expert ids
            got = sent[group[:, None], :, mine].transpose(0, 2, 1)  # (dp, mb, held)
            x = got.sum(axis=2).mean(axis=1) / (TOP_K * self.rows_tokens)
            factor = (1.0 - MLP_SHARE) * self.tok + MLP_SHARE * x
            cols.append(got * self.layers)
            keys.append(np.broadcast_to(mine[:, None, :], got.shape))
        value = np.rint(np.concatenate(cols, axis=2)).astype(np.int64).reshape(self.dp, -1)
        key = np.concatenate(keys, axis=2).astype(np.int32).reshape(self.dp, -1)
        per_mb = sum(c.shape[2] for c in cols)
        kind = np.array([0] + ([1] if imbalance is not None else []) + [2] * self.held)
        self._steps.append((step, value, key, np.tile(kind, self.mb), np.repeat(
            np.arange(self.mb, dtype=np.int32), per_mb)))  # fmt: skip
        if self.plain:
            return None
        return factor[self.dp_of]

    def chunk(self) -> WorkChunk | None:
        """The rows of the steps since :meth:`begin` (None: no step)."""
        if not self._steps:
            return None
        n = len(self._steps[0][1][0])
        return WorkChunk(
            step=np.repeat(np.array([s[0] for s in self._steps], dtype=np.int32), n),
            microbatch=np.concatenate([s[4] for s in self._steps]),
            kind=np.concatenate([s[3] for s in self._steps]),
            value=np.concatenate([s[1] for s in self._steps], axis=1),
            key=np.concatenate([s[2] for s in self._steps], axis=1),
            dp_of=self.dp_of,
        )
