"""Byte-level training data from real text that ships with the package.

The corpus (``trainer/corpus.txt.gz``, about 0.8 MB of text) is the docstrings of the pure
Python modules of CPython's standard library, extracted by :func:`build_corpus` and shipped
so that every machine, whatever its Python version, trains on the same bytes. Source:
CPython 3.11 ``Lib/``, Python Software Foundation License (the PSF licence allows
redistribution of the text with its notice; the file's first lines carry it).
If the file is missing, :func:`load_corpus` builds it from the running interpreter's library.

Batches are a pure function of ``(seed, step, dp_rank)``: a generator seeded from a hash of
the three draws the sequence start offsets, so a resumed run, or a rerun on another machine,
sees exactly the same data, and DP ranks see different data.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import logging
import os
import sysconfig

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


def get_batch(
    *,
    seed: int,
    step: int,
    dp_rank: int,
    microbatches: int,
    micro_batch_size: int,
    seq_len: int,
    corpus: torch.Tensor | None = None,
) -> torch.Tensor:
    """This DP rank's batch for ``step``: int64 tokens (microbatches, micro_batch_size,
    seq_len + 1), each row a random window of the corpus (inputs are ``[..., :-1]``,
    targets ``[..., 1:]``)."""
    data = load_corpus() if corpus is None else corpus
    n = microbatches * micro_batch_size
    if data.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {data.numel()} bytes is too short for seq_len={seq_len}")
    starts = torch.randint(
        0, data.numel() - seq_len - 1, (n,), generator=_generator(seed, step, dp_rank)
    )
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows.view(microbatches, micro_batch_size, seq_len + 1)


def global_batch(*, dp: int, **kwargs) -> torch.Tensor:
    """The batches of all ``dp`` ranks side by side along the micro-batch dimension:
    (microbatches, dp * micro_batch_size, seq_len + 1), what a one-process run with the same
    global batch sees (same loss: equal-size token means average to the global mean)."""
    return torch.cat([get_batch(dp_rank=r, **kwargs) for r in range(dp)], dim=1)
