"""The fault-injection language of docs/spec.md §5, parsed and validated.

``KIND:key=value,...`` — for example ``slow_rank:rank=3,factor=1.2`` or
``slow_link:ranks=2-6,factor=4``; ``slow_ckpt:ms=300`` acts on every rank (a slow disk under
the checkpoints, which only the trainer writes); ``hot_expert:expert=3,share=0.5`` acts on the
router of every rank (the ranks that hold expert 3 get more work); ``seq_skew:rank=2,factor=2``
gives rank 2's data-parallel replica twice the tokens; ``slow_offload:rank=1,ms=50`` makes
each of rank 1's optimizer-offload transfers 50 ms longer (the trainer's only). Parsing is torch-free and shared by the
trainer (which makes the faults real) and the simulator (which models them; it has no
checkpoints). Every problem raises
:class:`FaultSpecError` whose message is one line naming the spec and what is wrong with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault spec: its kind, the spec as given, and the keys of its kind (the others keep
    their defaults)."""

    kind: str
    spec: str  # as given on the command line
    rank: int = -1  # the rank it acts on (-1 for slow_link)
    ranks: tuple[int, int] = (-1, -1)  # slow_link's two ends
    factor: float = 1.0  # slow_rank, slow_link
    step: int = -1  # hang, crash; slow_rank's first slow step (-1: from the start)
    every: int = 0  # pause
    ms: float = 0.0  # pause, slow_data, slow_ckpt, slow_offload
    expert: int = -1  # hot_expert: the expert the router favours
    share: float = 0.0  # hot_expert: the share of the routed tokens it receives

    def touches(self, rank: int) -> bool:
        """Whether the fault acts on ``rank``: its ``rank``, or an end of its link."""
        return rank == self.rank or rank in self.ranks


# kind -> (required keys, key -> parser name)
_KEYS: dict[str, tuple[str, ...]] = {
    "slow_rank": ("rank", "factor"),
    "slow_link": ("ranks", "factor"),
    "hang": ("rank", "step"),
    "crash": ("rank", "step"),
    "pause": ("rank", "every", "ms"),
    "slow_data": ("rank", "ms"),
    "slow_ckpt": ("ms",),
    "slow_offload": ("rank", "ms"),
    "hot_expert": ("expert", "share"),
    "seq_skew": ("rank", "factor"),
}

# keys a kind may also take
_OPTIONAL: dict[str, tuple[str, ...]] = {"slow_rank": ("step",)}

KINDS = tuple(_KEYS)


def _int(spec: str, key: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise FaultSpecError(f"{spec!r}: {key}={text!r} is not an integer") from None
    if value < minimum:
        raise FaultSpecError(f"{spec!r}: {key} must be >= {minimum}, got {value}")
    return value


def _float(spec: str, key: str, text: str, *, minimum: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"{spec!r}: {key}={text!r} is not a number") from None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise FaultSpecError(f"{spec!r}: {key} must be a finite number {bound}, got {text}")
    return value


def parse_fault(spec: str, world_size: int | None = None) -> Fault:
    """Parse one ``KIND:key=value,...`` spec; check ranks against ``world_size`` when given."""
    text = spec.strip()
    kind, sep, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _KEYS:
        raise FaultSpecError(
            f"{spec!r}: unknown fault kind {kind!r} (expected one of {', '.join(KINDS)})"
        )
    if not sep or not rest.strip():
        raise FaultSpecError(f"{spec!r}: expected {kind}:{'=..,'.join(_KEYS[kind])}=..")
    values = _key_values(spec, kind, rest)
    fields = {key: _field(spec, key, value) for key, value in values.items()}
    fault = Fault(kind=kind, spec=text, **fields)  # type: ignore[arg-type]
    if world_size is not None:
        for r in (fault.rank, *fault.ranks):
            if r >= world_size:
                raise FaultSpecError(
                    f"{spec!r}: rank {r} is outside the world of {world_size} ranks"
                )
    return fault


def _key_values(spec: str, kind: str, rest: str) -> dict[str, str]:
    """The ``key=value`` pairs of a spec of ``kind``: each key known, given once, none missing."""
    values: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise FaultSpecError(f"{spec!r}: {item.strip()!r} is not key=value")
        allowed = _KEYS[kind] + _OPTIONAL.get(kind, ())
        if key not in allowed:
            raise FaultSpecError(
                f"{spec!r}: unknown key {key!r} for {kind} (expected {', '.join(allowed)})"
            )
        if key in values:
            raise FaultSpecError(f"{spec!r}: key {key!r} given twice")
        values[key] = value
    missing = [k for k in _KEYS[kind] if k not in values]
    if missing:
        raise FaultSpecError(f"{spec!r}: missing {', '.join(missing)}")
    return values


def _field(spec: str, key: str, value: str) -> object:
    """The value of one known key, checked: a rank, a link's two ranks, a factor, ..."""
    if key == "ranks":
        a, dash, b = value.partition("-")
        if not dash:
            raise FaultSpecError(f"{spec!r}: ranks={value!r} must be A-B")
        pair = (_int(spec, key, a.strip(), 0), _int(spec, key, b.strip(), 0))
        if pair[0] == pair[1]:
            raise FaultSpecError(f"{spec!r}: a link needs two different ranks")
        return pair
    if key == "factor":
        return _float(spec, key, value, minimum=1.0, strict=False)
    if key == "ms":
        return _float(spec, key, value, minimum=0.0, strict=True)
    if key == "share":
        share = _float(spec, key, value, minimum=0.0, strict=True)
        if share > 1.0:
            raise FaultSpecError(f"{spec!r}: share must be at most 1, got {value}")
        return share
    # rank, step, expert (from 0) and every (from 1)
    return _int(spec, key, value, 1 if key == "every" else 0)


def parse_faults(specs: Iterable[str], world_size: int | None = None) -> list[Fault]:
    """Parse every spec (:func:`parse_fault`), in order."""
    return [parse_fault(s, world_size) for s in specs]
