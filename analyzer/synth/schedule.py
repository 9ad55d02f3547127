"""The static shape of a training step: the 1F1B order (plain or interleaved) and the layers'
collectives.

Nothing here depends on time; :mod:`analyzer.synth.stepgraph` walks these lists into the
step's graph.
"""

from __future__ import annotations

from dataclasses import dataclass


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B (PipeDream-flush) order of one stage: ``[("F", 0), ("F", 1), ("B", 0), ...]``.

    Stage ``s`` of ``p`` first runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one
    forward and one backward while forwards remain, then drains the remaining backwards. The
    last stage therefore alternates from the start, and the first stage holds the most
    activations in flight.
    """
    warmup = min(stages - stage - 1, microbatches)
    ops = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        ops.append(("F", warmup + i))
        ops.append(("B", i))
    ops += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return ops


def interleaved_1f1b(
    stage: int, stages: int, microbatches: int, chunks: int
) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order of one stage holding ``chunks`` model chunks:
    ``[("F", chunk, mb), ...]`` (needs ``microbatches`` a multiple of ``stages``).

    The stage's ``chunks * microbatches`` forwards run in groups of ``stages`` microbatches,
    chunk after chunk (chunk 0 of microbatches 0..p-1, chunk 1 of the same, ..., then chunk 0
    of microbatches p..2p-1, ...); backwards in the same groups with the chunks reversed. Stage
    ``s`` runs ``2 (p - s - 1) + (chunks - 1) p`` warm-up forwards (all of them when there are
    only ``p`` microbatches), then alternates one forward and one backward, then drains the
    backwards. Global model chunk ``chunk * p + stage`` holds the chunk's layers: a forward
    goes on to the next stage, from the last stage to the first stage's next chunk.
    """
    p, m, v = stages, microbatches, chunks
    total = m * v

    def at(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warmup = total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)
    ops = [("F", *at(k, False)) for k in range(warmup)]
    for i in range(total - warmup):
        ops.append(("F", *at(warmup + i, False)))
        ops.append(("B", *at(i, True)))
    ops += [("B", *at(k, True)) for k in range(total - warmup, total)]
    return ops


@dataclass(frozen=True)
class Piece:
    """One piece of a forward or backward: compute a fraction of it, then maybe a collective.

    ``op`` is empty for pure compute; ``axis`` is the group kind (``tp`` or ``cp``); ``size``
    says which message it moves: ``act`` (a microbatch's full activations) or ``kv`` (keys and
    values of the local sequence shard, for context parallelism).
    """

    fraction: float
    op: str = ""
    axis: str = ""
    size: str = "act"


def _layer(backward: bool, sp: bool, cp: bool) -> list[Piece]:
    """One transformer layer: attention then MLP, with tensor parallelism around each.

    With sequence parallelism (Megatron SP) each block is entered by an all_gather of the
    sequence-sharded activations and left by a reduce_scatter; without it, each block ends in an
    all_reduce. Context parallelism adds an all_gather of keys and values before attention in
    the forward and the matching reduce_scatter of their gradients in the backward.
    """
    enter = [Piece(0.0, "all_gather", "tp")] if sp else []
    leave = "reduce_scatter" if sp else "all_reduce"
    if not backward:
        attn = (
            [Piece(0.15), Piece(0.0, "all_gather", "cp", "kv"), Piece(0.35)] if cp else [Piece(0.5)]
        )
        return [*enter, *attn, Piece(0.0, leave, "tp"), *enter, Piece(0.5), Piece(0.0, leave, "tp")]
    attn = (
        [Piece(0.35), Piece(0.0, "reduce_scatter", "cp", "kv"), Piece(0.15)] if cp else [Piece(0.5)]
    )
    return [*enter, Piece(0.5), Piece(0.0, leave, "tp"), *enter, *attn, Piece(0.0, leave, "tp")]


def pass_pieces(
    backward: bool, *, layers: int, sp: bool, tp: bool, cp: bool, coarse: bool
) -> list[Piece]:
    """The pieces of one forward (or backward) pass of a stage, fractions summing to one.

    ``coarse`` folds the layers into one: the same compute, one collective of each kind per
    pass (carrying every layer's bytes), so a 12,288-rank run stays small on disk.
    """
    count = 1 if coarse else layers
    pieces: list[Piece] = []
    for _ in range(count):
        for p in _layer(backward, sp, cp):
            if p.op and ((p.axis == "tp" and not tp) or (p.axis == "cp" and not cp)):
                continue
            pieces.append(Piece(p.fraction / count, p.op, p.axis, p.size))
    return [p for p in pieces if p.op or p.fraction > 0]
