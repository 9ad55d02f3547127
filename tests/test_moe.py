"""Mixture of experts: the routed MLP, its load-balancing loss, the hot_expert fault, and an
expert-parallel run of ``megascope train`` (dp2 ep2 on gloo) with its collectives and work.

Equivalence of the expert-parallel engine with the one-process one is in
tests/test_parallel_equivalence.py (the ``moe`` layouts).
"""

from __future__ import annotations

import dataclasses
import glob
import os

import duckdb
import pytest
import torch
import torch.nn.functional as F
from helpers.cli import run_main

from trainer import progress
from trainer.config import ModelConfig
from trainer.model import GPT, MLP, count_params, flops_per_token
from trainer.moe import AUX_LOSS_COEF, MoE, balance_loss, force_expert, set_hot_expert

SMALL = ModelConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, experts=4, top_k=2)


def test_route_picks_the_top_k_and_the_layer_sums_the_weighted_experts() -> None:
    torch.manual_seed(0)
    moe = MoE(SMALL, MLP)
    x = torch.randn(3, 16, 32)
    probs, idx, weights = moe.route(x)
    assert probs.shape == (3, 16, 4) and idx.shape == weights.shape == (3, 16, 2)
    torch.testing.assert_close(probs, F.softmax(moe.router(x), dim=-1))
    assert (idx[..., 0] != idx[..., 1]).all()
    assert torch.equal(idx, probs.topk(2, dim=-1).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 16))
    # token by token: the weighted sum of its experts' outputs
    expected = torch.zeros_like(x)
    for b in range(3):
        for t in range(16):
            for j in range(2):
                e = str(int(idx[b, t, j]))
                expected[b, t] += weights[b, t, j] * moe.experts[e](x[b, t][None])[0]
    with torch.no_grad():
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)


def test_balance_loss_is_one_when_even_and_reaches_the_router_through_the_gradient() -> None:
    even = torch.full((2, 4, 4), 0.25)
    idx = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).expand(2, 4, 2)
    assert balance_loss(even, idx).item() == pytest.approx(1.0)
    skewed = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(2, 4, 4)
    assert balance_loss(skewed, torch.zeros(2, 4, 1, dtype=torch.long)).item() > 2.5

    torch.manual_seed(0)
    moe = MoE(SMALL, MLP)
    x = torch.randn(2, 16, 32)

    def router_grad(scale: float, by_hand: bool = False) -> torch.Tensor:
        moe.zero_grad()
        moe.aux_loss_scale = scale
        loss = moe(x).square().sum()
        if by_hand:
            probs, idx, _ = moe.route(x)
            loss = loss + AUX_LOSS_COEF * balance_loss(probs, idx)
        loss.backward()
        return moe.router.weight.grad.clone()

    # the auxiliary loss joins through the gradient: scale 1 is adding it to the loss by hand
    with_aux = router_grad(1.0)
    torch.testing.assert_close(with_aux, router_grad(0.0, by_hand=True))
    assert not torch.allclose(with_aux, router_grad(0.0))


def test_moe_model_trains_in_one_process() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, 256, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5, losses
    experts = [n for n, p in model.named_parameters() if ".experts." in n and p.grad is not None]
    assert len(experts) == 2 * 4 * 4  # every expert of both layers got a gradient


def test_count_params_and_flops_per_token_of_a_mixture() -> None:
    assert count_params(SMALL) == sum(p.numel() for p in GPT(SMALL).parameters())
    dense = dataclasses.replace(SMALL, experts=0)
    mlp = 32 * 128 + 128 + 128 * 32 + 32
    # a token runs top_k = 2 experts (one more MLP than dense) and the router
    assert flops_per_token(SMALL) == flops_per_token(dense) + 6 * 2 * (mlp + 32 * 4)
    assert count_params(SMALL) == count_params(dense) + 2 * (3 * mlp + 32 * 4)


@pytest.mark.parametrize("share", [0.3, 0.5])
def test_hot_expert_gets_its_share_of_the_assignments(share: float) -> None:
    torch.manual_seed(0)
    probs = F.softmax(torch.randn(4000, 4), dim=-1)
    weights, idx = probs.topk(2, dim=-1)
    natural = (idx == 3).float().mean().item()
    hot, w = force_expert(idx, weights, 3, share)
    assert (hot == 3).float().mean().item() == pytest.approx(share, abs=0.01)
    assert natural < 0.27
    assert (hot[:, 0] != hot[:, 1]).all() and torch.equal(w, weights)
    forced = (hot != idx).any(-1)
    assert (hot[forced, 0] == 3).all()  # a forced token has the expert first, the top weight
    model = GPT(SMALL)
    set_hot_expert(model, 3, share)
    assert all(block.mlp.hot == (3, share) for block in model.h)


# -- megascope train --dp 2 --ep 2 -----------------------------------------------------------


def _rows(run: str, table: str, sql: str) -> list[tuple]:
    files = glob.glob(os.path.join(run, table, "*", "*.parquet"))
    assert files, f"no {table} table"
    query = "with t as (select * from read_parquet($files, hive_partitioning=false)) " + sql
    return duckdb.connect().execute(query, {"files": files}).fetchall()


MOE_FLAGS = ["--dp", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--device", "cpu"]


def test_expert_parallel_run_trains_exchanges_tokens_and_records_expert_work(
    tmp_path, train
) -> None:
    """dp2 ep2 with the hot_expert fault on expert 1: the loss falls, the tokens travel by
    all_to_all over the ep group, and expert 1 receives about 40% of the assignments."""
    run = str(tmp_path / "run")
    res = train(
        *MOE_FLAGS, "--steps", "12", "--inject", "hot_expert:expert=1,share=0.4", "--out", run
    )
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [r["loss"] for r in progress.read_steps(run)]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    a2a = _rows(
        run,
        "collectives",
        "select rank, count(*) from t where op = 'all_to_all' and \"group\" = 'ep' and step = 3"
        " group by rank order by rank",
    )
    # default 4 layers, 4 microbatches: 3 exchanges per layer forward, 2 backward
    assert a2a == [(0, 4 * 4 * 5), (1, 4 * 4 * 5)]
    work = _rows(
        run,
        "work",
        "select rank, key, sum(value) from t where kind = 'expert_tokens' group by rank, key"
        " order by key",
    )
    assert [(rank, key) for rank, key, _ in work] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    total = sum(v for _, _, v in work)
    assert total == 12 * 2 * 4 * 2 * 64 * 4 * 2  # steps, dp, mb, rows, tokens, layers, top_k
    assert work[1][2] / total == pytest.approx(0.4, abs=0.02)


@pytest.mark.parametrize(
    "args",
    [
        ["--dp", "2", "--ep", "3", "--experts", "6"],  # ep does not divide dp
        ["--dp", "2", "--ep", "2", "--experts", "3"],  # ep does not divide the experts
        ["--dp", "2", "--ep", "2"],  # ep without experts
        ["--experts", "4", "--inject", "hot_expert:expert=4,share=0.5"],
    ],
    ids=["ep_dp", "ep_experts", "ep_dense", "hot_expert_unknown"],
)
def test_bad_expert_flags_exit_2_with_one_line(tmp_path, args) -> None:
    run = str(tmp_path / "run")
    res = run_main("train", *args, "--out", run)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "error" in res.stderr, res.stderr
    assert not os.path.exists(os.path.join(run, "run.json"))


def test_resume_with_another_ep_is_refused_in_one_line(tmp_path, train) -> None:
    # the mesh (dp2) and the model are the same: only the experts' placement differs, and a
    # checkpoint's expert shards belong to the placement they were saved with
    run = str(tmp_path / "run")
    base = ["--dp", "2", "--experts", "4", "--steps", "3", "--checkpoint-every", "2"]
    first = train(*base, "--ep", "2", "--out", run, "--no-trace", timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    res = train(*base[:-4], "--steps", "6", "--checkpoint-every", "2", "--ep", "1",
                     "--out", run, "--resume", timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "ep=2" in res.stderr and "ep=1" in res.stderr
