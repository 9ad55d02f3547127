"""The parallel trainer computes what the one-process trainer computes.

Each layout runs a few steps on real gloo process groups (tests/helpers/ranks.py) and is compared
with the one-process Engine on the same global batch: the losses, and every parameter of the
whole model after the last step (TP shards gathered, pipeline stages exchanged). The
one-process Engine is itself checked against the plain GPT trained by torch's AdamW, and
the sharded LAMB against a textbook per-parameter LAMB.

Tolerance. Parallel runs add the same numbers in a different order (a TP all-reduce of partial
matmuls, DP averaging of per-rank means), which in float32 moves gradients by ~1e-7
relative. Adam divides each gradient by ``sqrt(v) + eps``: with the usual ``eps = 1e-8`` an
element whose gradient is itself round-off moves by up to ``lr`` either way. The key bias is
such an element: adding a constant to every key shifts all of a query's scores equally, so
its true gradient is exactly zero and what autograd returns is summation noise. The tests
use ``eps = 1e-4``, which leaves real gradients unaffected and makes the comparison
meaningful; parameters then agree to ~1e-6 relative.

Mixtures of experts (the ``moe`` layouts) run the same comparison: with expert parallelism
(``ep``) each rank holds a share of the experts and the tokens travel to them by all-to-all;
the one-process Engine holds them all.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.data import get_batch, global_batch
from trainer.engine import Engine
from trainer.hooks import RecordingHooks
from trainer.model import GPT
from trainer.optim import lr_at
from trainer.parallel.mesh import Mesh
from trainer.parallel.pipeline import stage_layers

MODEL = ModelConfig(n_layer=4, n_head=4, d_model=32, seq_len=16)
TRAIN = TrainConfig(
    steps=3, microbatches=4, micro_batch_size=2, lr=1e-2, warmup=1, eps=1e-4, bucket_size_mb=0.005
)
MOE = dataclasses.replace(MODEL, experts=4, top_k=2)
SEED = 7
COUNTED = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "batch_isend_irecv",
    "all_to_all_single",
)


def _batch(step: int, dp_rank: int, train: TrainConfig, model: ModelConfig) -> torch.Tensor:
    return get_batch(
        seed=SEED,
        step=step,
        dp_rank=dp_rank,
        microbatches=train.microbatches,
        micro_batch_size=train.micro_batch_size,
        seq_len=model.seq_len,
    )


def _count_collectives(counts: dict[str, int], calls: list, hooks: RecordingHooks) -> None:
    """Wrap torch.distributed's functions as a tracer would: every call must go through them.
    ``calls`` gets (function, the engine span open at the call) for each call."""
    for name in COUNTED:
        original = getattr(dist, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            calls.append((_name, hooks.current))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


def _rank_run(
    rank: int,
    world: int,
    par: ParallelConfig,
    model: ModelConfig,
    train: TrainConfig,
    resume_at: int | None = None,
):
    """Train ``train.steps`` steps; with ``resume_at``, save the engine's state after that
    many steps and go on with a fresh engine (another seed) that loads it."""
    counts, calls, hooks = dict.fromkeys(COUNTED, 0), [], RecordingHooks()
    _count_collectives(counts, calls, hooks)
    mesh = Mesh(par)
    engine = Engine(model, train, mesh, hooks)
    losses = []
    for s in range(train.steps):
        if s == resume_at:
            state = engine.state_dict()
            engine = Engine(model, dataclasses.replace(train, seed=train.seed + 1), mesh, hooks)
            engine.load_state_dict(state)
        losses.append(engine.train_step(_batch(s, mesh.coords["dp"], train, model)))
    counts = dict(counts)  # the training's, not the gathering of the parameters below
    params = {k: v.numpy() for k, v in engine.full_params().items()}
    events = [e for e in hooks.events if e[0] != "optimizer"][: 2 * train.microbatches]
    return {
        "losses": losses,
        "params": params,
        "events": events,
        "counts": counts,
        "calls": calls,
        "buckets": len(engine.dp.buckets),
        "reduced_buckets": sum(b.size > 1 for b in engine.dp.buckets),  # over a group
        "coords": mesh.coords,
    }


def _reference(dp: int, model: ModelConfig, train: TrainConfig):
    """The one-process Engine (no process group at all) on the DP ranks' batches side by side."""
    engine = Engine(model, train, Mesh(ParallelConfig()))
    losses = []
    for s in range(train.steps):
        batch = global_batch(
            dp=dp,
            seed=SEED,
            step=s,
            microbatches=train.microbatches,
            micro_batch_size=train.micro_batch_size,
            seq_len=model.seq_len,
        )
        losses.append(engine.train_step(batch))
    return losses, {k: v.numpy() for k, v in engine.full_params().items()}


def _assert_same_training(results, par, model, train) -> None:
    ref_losses, ref_params = _reference(par.dp, model, train)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["losses"] == results[0]["losses"]  # every rank returns the same value
    params = results[0]["params"]
    assert set(params) == set(ref_params)
    init = _initial_params(model)
    for name, ref in ref_params.items():
        assert not np.allclose(ref, init[name]), f"{name} did not train"
        np.testing.assert_allclose(params[name], ref, rtol=1e-5, atol=1e-6, err_msg=name)
        for r in results[1:]:
            np.testing.assert_array_equal(r["params"][name], params[name])


def _initial_params(model: ModelConfig) -> dict[str, np.ndarray]:
    torch.manual_seed(TRAIN.seed)
    return {k: v.detach().numpy() for k, v in GPT(model).named_parameters()}


def _assert_1f1b_order(results) -> None:
    """Stage 0 of 2 warms up with one extra forward; stage 1 alternates from the start."""
    order = {r["coords"]["pp"]: [(n[0], mb) for n, _, mb in r["events"]] for r in results}
    f, b = "f", "b"
    assert order[0] == [(f, 0), (f, 1), (b, 0), (f, 2), (b, 1), (f, 3), (b, 2), (b, 3)]
    assert order[1] == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2), (f, 3), (b, 3)]


LAYOUTS = {
    "dp2": (ParallelConfig(dp=2), MODEL),
    "tp2": (ParallelConfig(tp=2), MODEL),
    "tp2_sp_learned_parallel_block": (
        ParallelConfig(tp=2, sp=True),
        dataclasses.replace(MODEL, pos="learned", parallel_block=True),
    ),
    "pp2_window_rmsnorm": (
        ParallelConfig(pp=2),
        dataclasses.replace(MODEL, sliding_window=6, norm="rmsnorm", n_layer=3),
    ),
    # context parallelism (Ulysses): the sequence split over cp, attention over all of it
    "cp2": (ParallelConfig(cp=2), MODEL),
    "cp2_tp2": (ParallelConfig(cp=2, tp=2), MODEL),
    "cp2_tp2_sp_learned": (
        ParallelConfig(cp=2, tp=2, sp=True),
        dataclasses.replace(MODEL, pos="learned"),
    ),
    "dp2_cp2": (ParallelConfig(dp=2, cp=2), MODEL),
    "pp2_cp2_window": (
        ParallelConfig(pp=2, cp=2),
        dataclasses.replace(MODEL, sliding_window=6, n_layer=3),
    ),
    # mixtures of experts: all experts on every rank, then sharded over ep
    "dp2_moe": (ParallelConfig(dp=2), MOE),
    "dp2_ep2_moe": (ParallelConfig(dp=2, ep=2), MOE),
    "pp2_dp2_ep2_moe": (ParallelConfig(pp=2, dp=2, ep=2), MOE),
    "tp2_dp2_ep2_moe": (ParallelConfig(tp=2, dp=2, ep=2), MOE),
}


# Two steps for each layout: the second already reads the optimizer state the first left (the
# runs that resume below take three); a third step adds only collectives' time on shared cores.
LAYOUT_TRAIN = dataclasses.replace(TRAIN, steps=2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_one_process(layout: str, ranks) -> None:
    par, model = LAYOUTS[layout]
    train = LAYOUT_TRAIN
    results = ranks(_rank_run, par.world_size, par, model, train)
    _assert_same_training(results, par, model, train)
    counts = results[0]["counts"]
    if par.dp > 1:  # one reduce-scatter and one all-gather per bucket per step
        n = results[0]["reduced_buckets"] * train.steps  # (ep2 dp2: not the experts')
        assert results[0]["buckets"] > 1
        assert counts["reduce_scatter_single"] == n and counts["all_gather_single"] == n
        # overlap: the gradient reductions start inside the last microbatch's backward
        last_backward = ("backward", "compute", train.microbatches - 1)
        spans = [span for name, span in results[0]["calls"] if name == "reduce_scatter_single"]
        assert spans.count(last_backward) == n
    if par.pp > 1:
        assert counts["batch_isend_irecv"] >= train.microbatches * train.steps
        _assert_1f1b_order(results)
    if par.sp:
        assert counts["all_gather_single"] > 0 and counts["reduce_scatter_single"] > 0
    for r in results:  # two all-to-alls per attention forward, two more in its backward;
        # an expert-parallel MoE layer: counts, tokens out and back, then two in its backward
        layers = len(stage_layers(model.n_layer, par.pp, r["coords"]["pp"]))
        per_layer = (4 if par.cp > 1 else 0) + (5 if par.ep > 1 else 0)
        expected = per_layer * layers * train.microbatches * train.steps
        assert r["counts"]["all_to_all_single"] == expected


def test_dp2_pp2_tp2_sp_matches_one_process(ranks) -> None:
    """All of it at once, resuming from the shards' state after step 2 on the way."""
    par = ParallelConfig(dp=2, pp=2, tp=2, sp=True)
    results = ranks(_rank_run, 8, par, MODEL, TRAIN, 2, timeout=400)
    _assert_same_training(results, par, MODEL, TRAIN)


@pytest.mark.parametrize("par", [ParallelConfig(dp=2), ParallelConfig(tp=2)], ids=["dp2", "tp2"])
def test_lamb_sharded_matches_one_process(par: ParallelConfig, ranks) -> None:
    """LAMB's trust ratio needs whole-parameter norms: all-reduced over the DP slices (dp2)
    and over the TP shards (tp2). The run also resumes from its state after step 1."""
    train = dataclasses.replace(TRAIN, optimizer="lamb", lr=2e-2)
    results = ranks(_rank_run, par.world_size, par, MODEL, train, 1)
    _assert_same_training(results, par, MODEL, train)


def test_expert_parallel_lamb_resumes_and_matches_one_process(ranks) -> None:
    """dp2 ep2: LAMB's per-parameter norms sum the experts' slices over edp, not DP; the
    engine's state (the experts' buckets included) saved after step 1 resumes exactly."""
    par = ParallelConfig(dp=2, ep=2)
    train = dataclasses.replace(TRAIN, optimizer="lamb", lr=2e-2)
    results = ranks(_rank_run, par.world_size, par, MOE, train, 1)
    _assert_same_training(results, par, MOE, train)


# -- the one-process reference itself ----------------------------------------------------------


def _plain_training(train: TrainConfig, step_fn) -> tuple[list[float], dict[str, np.ndarray]]:
    torch.manual_seed(train.seed)
    model = GPT(MODEL)
    losses = []
    for s in range(train.steps):
        batch = _batch(s, 0, train, MODEL)
        model.zero_grad()
        loss = sum(model(mb[:, :-1], mb[:, 1:]) / len(batch) for mb in batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        assert norm > 0
        step_fn(model, s)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().numpy() for k, v in model.named_parameters()}


def test_engine_matches_plain_gpt_with_torch_adamw() -> None:
    train = TRAIN
    opt: list[torch.optim.AdamW] = []

    def step(model: GPT, s: int) -> None:
        if not opt:
            params = list(model.parameters())
            opt.append(
                torch.optim.AdamW(
                    [
                        {
                            "params": [p for p in params if p.dim() >= 2],
                            "weight_decay": train.weight_decay,
                        },
                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
                    ],
                    betas=train.betas,
                    eps=train.eps,
                )
            )
        for g in opt[0].param_groups:
            g["lr"] = lr_at(s, train)
        opt[0].step()

    losses, params = _plain_training(train, step)
    ref_losses, ref_params = _reference(1, MODEL, train)
    np.testing.assert_allclose(ref_losses, losses, rtol=1e-6)
    for name, p in params.items():
        np.testing.assert_allclose(ref_params[name], p, rtol=1e-5, atol=1e-7, err_msg=name)


def test_sharded_lamb_matches_textbook_lamb() -> None:
    train = dataclasses.replace(TRAIN, optimizer="lamb", lr=2e-2)
    state: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(model: GPT, s: int) -> None:
        b1, b2 = train.betas
        for p in model.parameters():
            m, v = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).add_(p.grad**2, alpha=1 - b2)
            u = (m / (1 - b1 ** (s + 1))) / ((v / (1 - b2 ** (s + 1))).sqrt() + train.eps)
            if p.dim() >= 2:
                u = u + train.weight_decay * p
            w_norm, u_norm = p.norm(), u.norm()
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            p.sub_(lr_at(s, train) * trust * u)

    losses, params = _plain_training(train, step)
    ref_losses, ref_params = _reference(1, MODEL, train)
    np.testing.assert_allclose(ref_losses, losses, rtol=1e-6)
    for name, p in params.items():
        np.testing.assert_allclose(ref_params[name], p, rtol=1e-5, atol=1e-6, err_msg=name)


def test_state_dict_resume_continues_identically() -> None:
    """Two steps, save, a fresh engine loads the shard, the third step matches exactly."""
    train = dataclasses.replace(TRAIN, optimizer="adamw")
    a = Engine(MODEL, train, Mesh(ParallelConfig()))
    for s in range(2):
        a.train_step(_batch(s, 0, train, MODEL))
    saved = a.state_dict()
    b = Engine(MODEL, dataclasses.replace(train, seed=99), Mesh(ParallelConfig()))
    b.load_state_dict(saved)
    assert b.step == 2
    assert a.train_step(_batch(2, 0, train, MODEL)) == b.train_step(_batch(2, 0, train, MODEL))
    pa, pb = a.full_params(), b.full_params()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0)
