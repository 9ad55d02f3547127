"""Variable-length data (``--data varlen``), the work it records, and the ``seq_skew`` fault.

* Varlen batches are a pure function of (seed, step, dp_rank), every row full of whole
  documents ended by the separator (the last one truncated), their lengths heavy-tailed.
* ``megascope train --dp 2 --data varlen`` trains, and its ``work`` table holds one ``tokens``
  and one ``attention`` row per rank, step and microbatch, equal to what the data says.
* ``seq_skew:rank=1,factor=2`` gives rank 1's replica twice the rows: its ``tokens`` (and,
  with fixed data, its ``attention``) read twice rank 0's, and the loss stays the one-process
  loss on the replicas' batches side by side (the replicas' means weighted by their rows), on
  dp2 with fixed data and on dp2 pp2 with varlen: the replica computed on twice the rows.
  What the rows cost in time depends on the machine (a CPU with cores to spare runs twice the
  rows in little more time); ``bench/accuracy.py --work`` measures how ``analyze`` reads it.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

import duckdb
import pytest
import torch
from helpers.cli import run_main

from tracer.faults import parse_fault
from trainer import progress
from trainer.cliconfig import LaunchConfig, from_mapping
from trainer.config import ParallelConfig
from trainer.data import MIN_DOC, SEPARATOR, Batch, make_batch
from trainer.engine import Engine
from trainer.faults import replica_rows
from trainer.parallel.mesh import Mesh

SKEW = "seq_skew:rank=1,factor=2"


def _varlen(**kw) -> Batch:
    args = dict(seed=5, step=3, dp_rank=1, microbatches=16, micro_batch_size=4, seq_len=256)
    return make_batch(**{**args, **kw, "data": "varlen"})


def test_varlen_batches_are_deterministic_full_rows_of_documents():
    a = _varlen()
    assert a.tokens.shape == (16, 4, 257) and a.tokens.dtype == torch.int64
    b = _varlen()
    assert torch.equal(a.tokens, b.tokens) and a.documents == b.documents
    assert not torch.equal(a.tokens, _varlen(step=4).tokens)
    assert not torch.equal(a.tokens, _varlen(dp_rank=0).tokens)
    for mb, docs in enumerate(a.documents):
        rows, row, filled = [], [], 0
        for n in docs:  # a microbatch's documents, row after row
            row.append(n)
            filled += n
            if filled == 256:
                rows.append(row)
                row, filled = [], 0
        assert row == [] and len(rows) == 4  # every row's documents fill its inputs
        for r, lengths in enumerate(rows):
            inputs = a.tokens[mb, r, :-1]
            ends = torch.tensor(lengths).cumsum(0) - 1
            # each document ends with the separator, the last one (truncated) may not
            expected = ends[:-1] if inputs[-1] != SEPARATOR else ends
            assert torch.equal((inputs == SEPARATOR).nonzero().flatten(), expected)
            assert min(lengths[:-1], default=MIN_DOC) >= MIN_DOC


def test_varlen_document_lengths_are_heavy_tailed():
    a = _varlen()
    lengths = [n for docs in a.documents for n in docs]
    median = statistics.median(lengths)
    assert max(lengths) >= 4 * median
    assert statistics.pstdev(lengths) / statistics.mean(lengths) > 0.5
    top = sorted(lengths, reverse=True)[: len(lengths) // 10]
    assert sum(top) > 0.2 * sum(lengths)  # a tenth of the documents hold a fifth of the tokens
    assert len(set(a.attention)) == len(a.attention)  # the work varies across microbatches
    assert a.attention == tuple(sum(n * n for n in docs) for docs in a.documents)
    fixed = make_batch(seed=5, step=3, dp_rank=1, microbatches=2, micro_batch_size=4, seq_len=256)
    assert fixed.attention == (4 * 256**2,) * 2 and fixed.tokens_per_microbatch == 4 * 256


def test_seq_skew_rows_per_replica():
    dp2 = {"dp": 2, "pp": 1, "tp": 1, "cp": 1}
    assert replica_rows([], dp2, 2) == [2, 2]
    assert replica_rows([parse_fault(SKEW)], dp2, 2) == [2, 4]
    big = {"dp": 2, "pp": 2, "tp": 2, "cp": 1}  # rank 6: pp1 dp1 tp0; rank 5: pp1 dp0 tp1
    assert replica_rows([parse_fault("seq_skew:rank=6,factor=3")], big, 2) == [2, 6]
    assert replica_rows([parse_fault("seq_skew:rank=5,factor=1.1")], big, 2) == [3, 2]


# -- launched runs ------------------------------------------------------------------------------
def _rows(run: str, table: str, sql: str) -> list[tuple]:
    files = glob.glob(os.path.join(run, table, "*", "*.parquet"))
    query = "with t as (select * from read_parquet($files, hive_partitioning=false)) " + sql
    return duckdb.connect().execute(query, {"files": files}).fetchall()


def _config(run: str) -> LaunchConfig:
    with open(os.path.join(progress.progress_dir(run), "launch.json"), encoding="utf-8") as f:
        return from_mapping(json.load(f))


def _work(run: str) -> dict[tuple[int, str, int, int], int]:
    rows = _rows(run, "work", "select rank, kind, step, microbatch, value from t")
    work = {(r, k, s, mb): v for r, k, s, mb, v in rows}
    assert len(work) == len(rows)  # one row per rank, kind, step and microbatch
    return work


def _one_process_losses(cfg: LaunchConfig) -> list[float]:
    """The one-process engine on the replicas' batches side by side (their rows as the
    run's faults set them)."""
    train, dp = cfg.train, cfg.parallel.dp
    rows = replica_rows(cfg.run.faults, cfg.parallel.sizes, train.micro_batch_size)
    engine = Engine(cfg.model, train, Mesh(ParallelConfig()))
    losses = []
    for step in range(train.steps):
        parts = [
            make_batch(seed=train.seed, step=step, dp_rank=r, microbatches=train.microbatches,
                       micro_batch_size=rows[r], seq_len=cfg.model.seq_len, data=train.data)
            for r in range(dp)
        ]  # fmt: skip
        losses.append(engine.train_step(torch.cat([p.tokens for p in parts], dim=1)))
    return losses


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, trained) -> str:
    run = str(tmp_path_factory.mktemp("varlen") / "run")
    trained(run, "--device", "cpu", "--data", "varlen", "--dp", "2", "--steps", "10")
    return run


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, trained) -> str:
    run = str(tmp_path_factory.mktemp("skew") / "run")
    trained(
        run, "--device", "cpu", "--data", "fixed", "--dp", "2", "--steps", "6", "--inject", SKEW
    )
    return run


def test_varlen_run_trains_and_records_its_work(healthy):
    losses = [r["loss"] for r in progress.read_steps(healthy)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    cfg = _config(healthy)
    assert cfg.train.data == "varlen"
    train, T = cfg.train, cfg.model.seq_len
    work = _work(healthy)
    for rank in (0, 1):
        for step in range(10):
            batch = make_batch(seed=train.seed, step=step, dp_rank=rank, seq_len=T,
                               microbatches=train.microbatches,
                               micro_batch_size=train.micro_batch_size, data="varlen")  # fmt: skip
            for mb in range(train.microbatches):
                assert work[rank, "tokens", step, mb] == train.micro_batch_size * T
                assert work[rank, "attention", step, mb] == batch.attention[mb]
    assert len(work) == 2 * 2 * 10 * train.microbatches
    assert len({v for (_, k, _, _), v in work.items() if k == "attention"}) > 10


def test_seq_skew_doubles_the_replicas_tokens_and_attention(skewed):
    work = _work(skewed)
    cfg = _config(skewed)
    B, T = cfg.train.micro_batch_size, cfg.model.seq_len
    assert cfg.train.data == "fixed"  # a row is one document of seq_len tokens
    for step in range(6):
        for mb in range(cfg.train.microbatches):
            assert work[1, "tokens", step, mb] == 2 * work[0, "tokens", step, mb] == 2 * B * T
            assert work[1, "attention", step, mb] == 2 * work[0, "attention", step, mb]
            assert work[0, "attention", step, mb] == B * T * T


def test_seq_skew_loss_is_the_token_weighted_one_process_loss(skewed):
    losses = [r["loss"] for r in progress.read_steps(skewed)]
    reference = _one_process_losses(_config(skewed))
    assert len(losses) == 6
    assert losses == pytest.approx(reference, rel=1e-5)


def test_seq_skew_on_dp2_pp2_trains_and_matches_one_process(tmp_path, trained):
    run = str(tmp_path / "run")
    trained(run, "--device", "cpu", "--data", "varlen", "--dp", "2", "--pp", "2", "--steps", "4", "--no-trace",
           "--inject", SKEW)  # fmt: skip
    losses = [r["loss"] for r in progress.read_steps(run)]
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(_one_process_losses(_config(run)), rel=1e-5)


def test_bad_data_kind_is_one_line_exit_2(tmp_path):
    res = run_main("train", "--data", "bogus", "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus" in lines[0] and "varlen" in lines[0], res.stderr
    assert not os.path.exists(tmp_path / "run")
