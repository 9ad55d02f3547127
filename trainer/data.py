"""Byte-level training data from real text that ships with the package.

The corpus (``trainer/corpus.txt.gz``, about 0.8 MB of text) is the docstrings of the pure
Python modules of CPython's standard library, extracted by :func:`build_corpus` and shipped
so that every machine, whatever its Python version, trains on the same bytes. Source:
CPython 3.11 ``Lib/``, Python Software Foundation License (the PSF licence allows
redistribution of the text with its notice; the file's first lines carry it).
If the file is missing, :func:`load_corpus` builds it from the running interpreter's library.

Batches are a pure function of ``(seed, step, dp_rank)`` (and of their shape): a generator
seeded from a hash of the three draws everything random in them, so a resumed run, or a rerun
on another machine, sees exactly the same data, DP ranks see different data, and every rank of
a data-parallel replica (its pipeline stages, TP and CP ranks) loads the same batch.

Two kinds of data (``--data``):

* ``fixed`` — each row is a window of ``seq_len + 1`` bytes at a random offset of the corpus.
  For the work records every row counts as one document of ``seq_len`` tokens.
* ``varlen`` — each row is packed from whole documents of heavy-tailed lengths, as GPT-2
  trained: document lengths are lognormal (median a quarter of the row, sigma
  :data:`LOG_SIGMA`) rounded and clipped to ``[MIN_DOC, seq_len + 1]``; a document of length
  ``L`` is ``L - 1`` bytes of the corpus from a random offset followed by the separator byte
  :data:`SEPARATOR` (NUL, which the ASCII corpus never holds; it plays the part of GPT-2's
  end-of-text token). Documents follow each other until the row is full, the last one
  truncated. Attention spans the whole row (no document mask), so every row costs the same
  compute; what varies is the documents' lengths, which :class:`Batch` returns beside the
  tokens (within the inputs, the first ``seq_len`` tokens of a row) for the work records.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CORPUS_PATH = os.path.join(os.path.dirname(__file__), "corpus.txt.gz")
NOTICE = (
    "Docstrings of the Python standard library (CPython Lib/), "
    "Copyright (c) 2001 Python Software Foundation; All Rights Reserved; "
    "distributed under the Python Software Foundation License Version 2.\n\n"
)


def _docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one source file, in file order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc and len(doc) > 40:
            out.append(doc.strip())
    return out


def build_corpus(limit_bytes: int = 800_000) -> bytes:
    """Concatenate standard-library docstrings (sorted file order, ASCII only) up to
    ``limit_bytes``. Deterministic for a given Python version."""
    root = sysconfig.get_paths()["stdlib"]
    parts = [NOTICE]
    size = len(NOTICE)
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                for doc in _docstrings(f.read()):
                    text = doc.encode("ascii", "ignore").decode() + "\n\n"
                    parts.append(text)
                    size += len(text)
                    if size >= limit_bytes:
                        return "".join(parts).encode()[:limit_bytes]
    return "".join(parts).encode()


@functools.lru_cache(maxsize=1)
def load_corpus() -> torch.Tensor:
    """The shipped corpus as a uint8 tensor (built from the local library if absent)."""
    try:
        with gzip.open(CORPUS_PATH, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        log.warning("%s missing; building the corpus from the standard library", CORPUS_PATH)
        data = build_corpus()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _generator(seed: int, step: int, dp_rank: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{step}:{dp_rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


SEPARATOR = 0  # the byte that ends every document of a varlen row
MIN_DOC = 8  # the shortest varlen document, in tokens
LOG_SIGMA = 1.0  # the spread of the lognormal document lengths


@dataclass(frozen=True)
class Batch:
    """One DP replica's batch for one step.

    ``tokens``: int64 (microbatches, rows, seq_len + 1) (inputs ``[..., :-1]``, targets
    ``[..., 1:]``). ``documents``: per microbatch, the lengths of its documents within the
    inputs, row after row (each row's sum to ``seq_len``)."""

    tokens: torch.Tensor
    documents: tuple[tuple[int, ...], ...]

    @property
    def tokens_per_microbatch(self) -> int:
        """The input tokens of one microbatch: rows x seq_len."""
        _, rows, t1 = self.tokens.shape
        return rows * (t1 - 1)

    @property
    def attention(self) -> tuple[int, ...]:
        """Per microbatch, the sum of its documents' squared lengths (causal attention's work)."""
        return tuple(sum(n * n for n in docs) for docs in self.documents)


def _fixed_rows(g: torch.Generator, data: torch.Tensor, n: int, t1: int) -> torch.Tensor:
    """(n, t1) windows of the corpus at random offsets."""
    starts = torch.randint(0, data.numel() - t1, (n,), generator=g)
    return torch.stack([data[s : s + t1] for s in starts.tolist()]).long()


def _doc_lengths(g: torch.Generator, n: int, t1: int) -> torch.Tensor:
    """(n, k) heavy-tailed document lengths, enough (k) to fill a row of ``t1`` tokens."""
    shortest = min(MIN_DOC, t1)
    k = -(-t1 // shortest)
    median = max(t1 / 4, shortest)
    draws = torch.randn((n, k), generator=g, dtype=torch.float64)
    return (median * torch.exp(LOG_SIGMA * draws)).round().clamp(shortest, t1).long()


def _packed_rows(
    g: torch.Generator, data: torch.Tensor, n: int, t1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, t1) rows packed from whole documents, and (n, k) the lengths drawn for them (see
    :func:`_within` for the lengths as the rows hold them)."""
    lengths = _doc_lengths(g, n, t1)  # (n, k)
    starts = torch.randint(0, data.numel() - t1, lengths.shape, generator=g)  # (n, k)
    ends = lengths.cumsum(1)  # (n, k): where each document ends in its row (exclusive)
    pos = torch.arange(t1).expand(n, t1).contiguous()  # (n, t1)
    doc = torch.searchsorted(ends, pos, right=True)  # (n, t1): the document at each position
    offset = pos - (ends - lengths).gather(1, doc)  # (n, t1): position within the document
    rows = data[starts.gather(1, doc) + offset].long()
    rows[offset == lengths.gather(1, doc) - 1] = SEPARATOR  # each document's last token
    return rows, lengths


def make_batch(
    *,
    seed: int,
    step: int,
    dp_rank: int,
    microbatches: int,
    micro_batch_size: int,
    seq_len: int,
    data: str = "fixed",
    corpus: torch.Tensor | None = None,
) -> Batch:
    """This DP replica's :class:`Batch` for ``step``: ``microbatches`` of ``micro_batch_size``
    rows of ``seq_len + 1`` tokens, of the ``data`` kind (``fixed`` | ``varlen``)."""
    text = load_corpus() if corpus is None else corpus
    M, B, t1 = microbatches, micro_batch_size, seq_len + 1
    if text.numel() <= t1:
        raise ValueError(f"corpus of {text.numel()} bytes is too short for seq_len={seq_len}")
    g = _generator(seed, step, dp_rank)
    if data == "fixed":
        rows = _fixed_rows(g, text, M * B, t1)
        docs = tuple((seq_len,) * B for _ in range(M))
    elif data == "varlen":
        rows, lengths = _packed_rows(g, text, M * B, t1)
        inputs = _within(lengths, seq_len).view(M, -1)  # (M, B * k)
        docs = tuple(tuple(n for n in mb.tolist() if n > 0) for mb in inputs)
    else:
        raise ValueError(f"data must be 'fixed' or 'varlen', not {data!r}")
    return Batch(rows.view(M, B, t1), docs)


def _within(lengths: torch.Tensor, limit: int) -> torch.Tensor:
    """(n, k) document lengths cut to the first ``limit`` tokens of their rows: the last
    document truncated, those past the limit 0."""
    ends = lengths.cumsum(1)
    return ends.clamp(max=limit) - (ends - lengths).clamp(max=limit)


def get_batch(**kwargs) -> torch.Tensor:
    """The tokens of :func:`make_batch` (same arguments): int64 (microbatches,
    micro_batch_size, seq_len + 1)."""
    return make_batch(**kwargs).tokens


def global_batch(
    *, dp: int, micro_batch_size: int, rows: Sequence[int] | None = None, **kwargs
) -> torch.Tensor:
    """The batches of all ``dp`` replicas side by side along the row dimension:
    (microbatches, sum of rows, seq_len + 1), what a one-process run with the same global batch
    sees. ``rows``: each replica's rows per microbatch (default ``micro_batch_size`` each; see
    :func:`trainer.faults.replica_rows`). The one-process loss is the mean over every token,
    which the replicas' means give when weighted by their rows (the engine's loss weight)."""
    sizes = list(rows) if rows is not None else [micro_batch_size] * dp
    parts = [get_batch(dp_rank=r, micro_batch_size=sizes[r], **kwargs) for r in range(dp)]
    return torch.cat(parts, dim=1)
