"""Unit tests of the plain model, the configs and the data (one process, no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import (
    GPT_1B,
    TINY,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_compatible,
    configs_from_mapping,
)
from trainer.data import get_batch, global_batch, load_corpus
from trainer.model import GPT, Block, Rotary, attention_mask, count_params, flops_per_token
from trainer.optim import lr_at
from trainer.parallel.pipeline import stage_layers

SMALL = ModelConfig(n_layer=2, n_head=4, d_model=32, seq_len=16)


def _model(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def test_shapes_and_initial_loss_near_uniform() -> None:
    model = _model(SMALL)
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    loss = model(idx, idx).detach()
    assert loss.shape == ()
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_causal_future_tokens_do_not_change_the_past(pos: str) -> None:
    model = _model(dataclasses.replace(SMALL, pos=pos))
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sliding_window_masks_old_tokens() -> None:
    """With one layer and window w, token j reaches positions j .. j+w-1 and no further."""
    w, j = 4, 3
    model = _model(dataclasses.replace(SMALL, n_layer=1, sliding_window=w))
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, j] = (idx[0, j] + 7) % 256
    diff = (model(idx) - model(changed)).abs().amax(dim=-1)[0]  # (T,)
    assert (diff[j : j + w] > 0).all()
    assert (diff[j + w :] == 0).all()
    assert (diff[:j] == 0).all()


def test_attention_mask_values() -> None:
    m = attention_mask(5, 2, torch.device("cpu"))
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)
    assert attention_mask(5, None, torch.device("cpu")) is None
    assert attention_mask(5, 5, torch.device("cpu")) is None


def test_rotary_scores_depend_only_on_distance() -> None:
    rot = Rotary(head_dim=8, seq_len=32)
    q, k = torch.randn(8), torch.randn(8)
    qs = rot(q.expand(1, 1, 32, 8).contiguous())[0, 0]  # same vector at every position
    ks = rot(k.expand(1, 1, 32, 8).contiguous())[0, 0]
    s = qs @ ks.T  # (T, T)
    torch.testing.assert_close(s[10, 7], s[20, 17])
    torch.testing.assert_close(s[5, 5], s[30, 30])
    assert not torch.allclose(s[10, 7], s[10, 3])


def test_parallel_block_is_attention_plus_mlp_of_one_norm() -> None:
    cfg = dataclasses.replace(SMALL, parallel_block=True)
    torch.manual_seed(0)
    block = Block(cfg)
    assert block.ln_2 is None
    x = torch.randn(2, 16, 32)
    h = block.ln_1(x)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.mlp(h))
    serial = Block(SMALL)
    serial.load_state_dict(block.state_dict(), strict=False)
    assert not torch.allclose(serial(x), block(x))


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        dataclasses.replace(SMALL, pos="learned", norm="rmsnorm", parallel_block=True, bias=False),
        dataclasses.replace(SMALL, sliding_window=4, d_ff=48),
    ],
    ids=["default", "learned_rms_parallel_nobias", "window_dff"],
)
def test_count_params_and_flops_per_token(cfg: ModelConfig) -> None:
    model = GPT(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    tables = model.wte.weight.numel() + (model.wpe.weight.numel() if model.wpe is not None else 0)
    n = count_params(cfg) - tables
    t_eff = min(cfg.seq_len, cfg.sliding_window or cfg.seq_len)
    assert flops_per_token(cfg) == 6 * n + 12 * cfg.n_layer * cfg.d_model * t_eff


def test_flops_per_token_by_hand() -> None:
    """SMALL: d=32, ff=128, L=2, V=256, T=16, biases, LayerNorm."""
    per_block = (3 * 32 * 32 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32) + 2 * 64
    n = 2 * per_block + 64 + 256 * 32  # blocks, final norm, head (not the token table)
    assert flops_per_token(SMALL) == 6 * n + 12 * 2 * 32 * 16
    assert 1.1e9 < count_params(GPT_1B) < 1.3e9


def test_batches_are_deterministic_per_seed_step_and_rank() -> None:
    kw = dict(microbatches=2, micro_batch_size=3, seq_len=16)
    a = get_batch(seed=1, step=5, dp_rank=0, **kw)
    assert a.shape == (2, 3, 17) and a.dtype == torch.int64
    assert torch.equal(a, get_batch(seed=1, step=5, dp_rank=0, **kw))
    assert not torch.equal(a, get_batch(seed=1, step=6, dp_rank=0, **kw))
    assert not torch.equal(a, get_batch(seed=1, step=5, dp_rank=1, **kw))
    assert not torch.equal(a, get_batch(seed=2, step=5, dp_rank=0, **kw))
    g = global_batch(dp=2, seed=1, step=5, **kw)
    assert torch.equal(g[:, :3], a) and g.shape == (2, 6, 17)


def test_corpus_is_real_text() -> None:
    corpus = load_corpus()
    assert 500_000 < corpus.numel() < 1_000_000
    text = bytes(corpus[:200_000].tolist()).decode("ascii")
    words = text.split()
    assert sum(w.lower() in ("the", "of", "and", "to", "a", "is") for w in words) > 0.08 * len(
        words
    )
    assert "Python Software Foundation" in text[:400]


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = TrainConfig(steps=12, warmup=2, lr=1.0, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(2)] == [0.5, 1.0]
    assert lr_at(2, cfg) == pytest.approx(1.0)
    assert lr_at(7, cfg) == pytest.approx(0.55)
    assert lr_at(12, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(2, 15))


def test_compile_is_on_by_default_on_cuda_only() -> None:
    assert TrainConfig(device="cuda").compiles and not TrainConfig(device="cpu").compiles
    assert not TrainConfig(device="cuda", compile=False).compiles
    assert TrainConfig(device="cpu", compile=True).compiles


def test_stage_layers_split() -> None:
    assert [stage_layers(4, 2, s) for s in range(2)] == [[0, 1], [2, 3]]
    assert [stage_layers(5, 3, s) for s in range(3)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ModelConfig(d_model=30, n_head=4), "multiple of n_head"),
        (lambda: ModelConfig(pos="alibi"), "model.pos"),
        (lambda: check_compatible(TINY, ParallelConfig(cp=3), TrainConfig()), "cp=3 must"),
        (
            lambda: check_compatible(TINY, ParallelConfig(tp=2, cp=4), TrainConfig()),
            "cp=4 must divide the 2 attention heads per tensor-parallel rank",
        ),
        (lambda: TrainConfig(optimizer="sgd"), "train.optimizer"),
        (lambda: check_compatible(TINY, ParallelConfig(tp=3), TrainConfig()), "tp=3"),
        (lambda: check_compatible(TINY, ParallelConfig(pp=5), TrainConfig()), "pp=5"),
        (lambda: configs_from_mapping({"model": {"n_layers": 3}}), "unknown keys: n_layers"),
        (lambda: configs_from_mapping({"modle": {}}), "unknown config sections"),
        (lambda: configs_from_mapping({"model": {"preset": "huge"}}), "model.preset"),
    ],
)
def test_bad_configs_give_one_line_errors(make, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


def test_configs_from_mapping_with_preset() -> None:
    model, par, train = configs_from_mapping(
        {
            "model": {"preset": "gpt-1b", "n_layer": 2},
            "parallel": {"dp": 2},
            "train": {"betas": [0.9, 0.99]},
        }
    )
    assert model.d_model == GPT_1B.d_model and model.n_layer == 2
    assert par.world_size == 2 and train.betas == (0.9, 0.99)
