"""Activation recompute (``--recompute full|selective``) trains exactly as without it, and the
forward it runs again in the backward is a ``recompute`` span inside the backward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.data import global_batch
from trainer.engine import Engine
from trainer.hooks import RecordingHooks
from trainer.parallel.mesh import Mesh

MODEL = ModelConfig(n_layer=3, n_head=4, d_model=32, seq_len=16)
TRAIN = TrainConfig(steps=2, microbatches=2, micro_batch_size=2, lr=1e-2, warmup=1, eps=1e-4)


def _train(how: str, mesh: Mesh | None = None) -> tuple[list[float], dict, list]:
    hooks = RecordingHooks()
    engine = Engine(MODEL, dataclasses.replace(TRAIN, recompute=how),
                    mesh or Mesh(ParallelConfig()), hooks)  # fmt: skip
    losses = []
    for s in range(TRAIN.steps):
        batch = global_batch(dp=1, seed=3, step=s, microbatches=TRAIN.microbatches,
                             micro_batch_size=TRAIN.micro_batch_size, seq_len=MODEL.seq_len)  # fmt: skip
        losses.append(engine.train_step(batch))
    params = {k: v.numpy() for k, v in engine.full_params().items()}
    return losses, params, hooks.events


@pytest.mark.parametrize("how, per_backward", [("full", 3), ("selective", 3)])
def test_recompute_trains_as_without_it(how, per_backward):
    ref_losses, ref_params, ref_events = _train("none")
    losses, params, events = _train(how)
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()  # the parameters keep their names
    for k, v in ref_params.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)
    assert not [e for e in ref_events if e[0] == "recompute"]
    # each backward of a microbatch recomputes each of the 3 blocks (or their attention)
    got = [e for e in events if e[0] == "recompute"]
    assert len(got) == per_backward * TRAIN.microbatches * TRAIN.steps
    assert {e[2] for e in got} == set(range(TRAIN.microbatches))


def _tp_worker(rank: int, world: int, how: str) -> list[float]:
    torch.manual_seed(0)
    return _train(how, Mesh(ParallelConfig(tp=2)))[0]


def test_recompute_under_tensor_parallelism_matches(ranks):
    """The recomputed forward runs its tensor-parallel collectives again, on both ranks alike."""
    ref = ranks(_tp_worker, 2, "none")
    got = ranks(_tp_worker, 2, "full")
    assert got == ref


def test_bad_recompute_is_refused():
    with pytest.raises(ValueError, match="train.recompute"):
        TrainConfig(recompute="some")
