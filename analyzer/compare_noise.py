"""Whether a difference between two runs is beyond the noise: a bootstrap over steps.

Each quantity compared (the step time, a phase, a collective kind, a rank's own work) is a
series with one value per step in each run. The difference is the median of B's steps less the
median of A's. Its interval: A's and B's steps are drawn again with replacement, each run on its
own, ``RESAMPLES`` times from a generator of a fixed seed (the output is the same on every
call), and the difference of the medians of each draw is taken; the interval runs between the
``(1 - LEVEL) / 2`` and ``(1 + LEVEL) / 2`` quantiles of those differences (the percentile
bootstrap). Every quantity is resampled with the same draws of steps, so a step that is slow
everywhere stays one step.

Many quantities are compared at once (the phases, each collective kind, each rank's own work
and phases), and at 95% each, one in twenty of a healthy pair's would read as changed. So the
intervals of a family of ``m`` quantities hold together at 95% (Bonferroni): each is B - A
plus or minus ``z(1 - 0.05 / 2m)`` standard deviations of its bootstrap differences (the
percentile interval's tails would need far more draws than ``RESAMPLES``); the step time, a
family of one, keeps the percentile interval.

A difference is beyond the noise when its interval does not hold zero and it is at least
``FLOOR_SHARE`` of A's median step: two runs of one configuration differ by more than the
spread of either's steps says (the machine between the runs, a placement), so a difference too
small to matter is not called one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95
SEED = 0
FLOOR_SHARE = 0.01  # a difference under 1% of A's median step is within the noise
CHUNK = 4_000_000  # resampled values per block of quantities (memory: 8 bytes each)


@dataclass(frozen=True)
class Diff:
    """One quantity of A against B, in the series' unit: medians, difference and interval."""

    a: float
    b: float
    diff: float
    low: float
    high: float


def _medians(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Median of each draw of rows (steps) of ``values`` (steps x quantities): (draws x q)."""
    out = np.empty((draws.shape[0], values.shape[1]))
    per = max(1, CHUNK // max(1, draws.size))
    for j in range(0, values.shape[1], per):
        block = values[:, j : j + per][draws]  # (draws, steps, block)
        median = np.nanmedian if np.isnan(block).any() else np.median  # the latter is faster
        out[:, j : j + per] = median(block, axis=1)
    return out


def bootstrap(
    a: np.ndarray,
    b: np.ndarray,
    *,
    resamples: int = RESAMPLES,
    families: Sequence[int] | None = None,
) -> list[Diff]:
    """The difference of medians (B - A) of each column of ``a`` and ``b`` (steps x
    quantities, NaN where a step lacks one) with its bootstrap interval (module docstring).
    ``families``: per column, the size of the family whose intervals must hold together (1:
    the column alone, the default). A column empty on one side gives NaN there."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError("a and b: steps x quantities, the same quantities")
    q = a.shape[1]
    if q == 0:
        return []
    if a.shape[0] == 0 or b.shape[0] == 0:
        nan = float("nan")
        return [Diff(nan, nan, nan, nan, nan) for _ in range(q)]
    rng = np.random.default_rng(SEED)
    draws_a = rng.integers(0, a.shape[0], size=(resamples, a.shape[0]))
    draws_b = rng.integers(0, b.shape[0], size=(resamples, b.shape[0]))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: NaN, quietly
        med_a, med_b = np.nanmedian(a, axis=0), np.nanmedian(b, axis=0)
        spread = _medians(b, draws_b) - _medians(a, draws_a)
        low = np.nanquantile(spread, (1 - LEVEL) / 2, axis=0)
        high = np.nanquantile(spread, (1 + LEVEL) / 2, axis=0)
        m = np.ones(q) if families is None else np.asarray(families, dtype=float)
        joint = m > 1
        if joint.any():
            z = np.array([NormalDist().inv_cdf(1 - (1 - LEVEL) / (2 * k)) for k in m[joint]])
            sd = np.nanstd(spread[:, joint], axis=0)
            centre = (med_b - med_a)[joint]
            low[joint], high[joint] = centre - z * sd, centre + z * sd
    return [
        Diff(
            float(med_a[i]),
            float(med_b[i]),
            float(med_b[i] - med_a[i]),
            float(low[i]),
            float(high[i]),
        )  # fmt: skip
        for i in range(q)
    ]


def beyond(d: Diff, floor: float) -> bool:
    """Whether ``d`` is beyond the noise: its interval excludes zero, and it is ``floor`` or
    more (in the series' unit)."""
    if not np.isfinite(d.diff) or not np.isfinite(d.low) or not np.isfinite(d.high):
        return False
    return (d.low > 0 or d.high < 0) and abs(d.diff) >= floor
