"""Context parallelism (Ulysses): the all-to-all layout, and what the tracer records of it.

One spawn of two gloo ranks (cp=2) with the tracer attached checks that

* ``Ulysses.to_heads`` turns each rank's chunk of the sequence (all heads) into the whole
  sequence of its share of the heads, and ``to_sequence`` turns that back;
* a training step of the engine gives the one-process loss, and every attention's exchanges
  (two in the forward, two in the backward) are ``all_to_all`` rows of the ``cp`` group, with
  the same sequence numbers on both members.

Whole-model equivalence over several steps and layouts (with dp, tp, sp, pp) is in
tests/test_parallel_equivalence.py.
"""

from __future__ import annotations

import glob
import os

import duckdb
import torch

import tracer
from tracer.config import TracerConfig
from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.data import get_batch
from trainer.engine import Engine
from trainer.parallel.context import Ulysses, local_chunk
from trainer.parallel.mesh import Mesh

MODEL = ModelConfig(n_layer=2, n_head=4, d_model=32, seq_len=16)
TRAIN = TrainConfig(steps=1, microbatches=2, micro_batch_size=2, eps=1e-4)
QUIET = TracerConfig(hang_timeout_s=0, flush_every_s=60)


def _batch() -> torch.Tensor:
    return get_batch(seed=3, step=0, dp_rank=0, microbatches=2, micro_batch_size=2, seq_len=16)


def _rank(rank: int, world: int, run: str) -> dict:
    mesh = Mesh(ParallelConfig(cp=2))
    tracer.attach(run, mesh=dict(mesh.sizes), groups={"cp": mesh.groups["cp"]}, config=QUIET)
    # qkv of 3 x 4 heads x 2 dims over 6 tokens: value = 1000 * token + column
    B, T, H, D = 2, 6, 4, 2
    full = 1000.0 * torch.arange(T).view(1, T, 1) + torch.arange(3 * H * D).view(1, 1, -1)
    full = full.expand(B, T, 3 * H * D).contiguous()
    ulysses = Ulysses(mesh.groups["cp"])
    t = T // 2
    heads = ulysses.to_heads(full[:, rank * t : (rank + 1) * t].contiguous())
    mine = full.view(B, T, 3, 2, H // 2 * D)[:, :, :, rank].reshape(B, T, -1)
    y = full[..., : H * D].view(B, T, 2, -1)[:, :, rank]  # (B, T, H/2*D): this rank's heads
    back = ulysses.to_sequence(y.contiguous())
    expected_back = full[:, rank * t : (rank + 1) * t, : H * D]
    engine = Engine(MODEL, TRAIN, mesh)
    tracer.step(0)
    loss = engine.train_step(_batch())
    tracer.close()
    return {
        "heads_ok": torch.equal(heads, mine),
        "back_ok": torch.equal(back, expected_back),
        "loss": loss,
    }


def test_ulysses_layout_loss_and_traced_all_to_all(tmp_path, ranks) -> None:
    tokens = torch.arange(16).view(2, 8)
    assert torch.equal(local_chunk(tokens, 2, 1), tokens[:, 4:])  # contiguous chunks
    assert local_chunk(tokens, 1, 0) is tokens
    run = str(tmp_path / "run")
    results = ranks(_rank, 2, run)
    assert all(r["heads_ok"] and r["back_ok"] for r in results)
    reference = Engine(MODEL, TRAIN, Mesh(ParallelConfig()))
    ref_loss = reference.train_step(_batch())
    for r in results:
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
    files = glob.glob(os.path.join(run, "collectives", "*", "*.parquet"))
    rows = (
        duckdb.connect()
        .execute(
            "select rank, seq, group_size, nbytes from read_parquet($f, hive_partitioning=false)"
            " where op = 'all_to_all' and \"group\" = 'cp' order by rank, seq",
            {"f": files},
        )
        .fetchall()
    )
    per_rank = {rank: [(s, n) for r, s, _, n in rows if r == rank] for rank, *_ in rows}
    # the layout check's two exchanges, then 4 per layer per microbatch
    assert len(per_rank[0]) == 2 + 4 * MODEL.n_layer * TRAIN.microbatches
    assert per_rank[0] == per_rank[1]  # same seq and size on both members
    assert {size for _, _, size, _ in rows} == {2}
