"""Where a step series changes level: one change point by binary segmentation, robustly.

A fault that begins (or ends) inside a run shifts its ranks' series (their excess of own work
over their peers', a share of a step) from one level to another. The step at which it shifts
is the split of the series into a before and an after that each sit closest to their own
level: for every split ``k`` (each side at least ``min_side`` steps), the sum of the absolute
deviations of each side from its median; the least is the change point. Medians and absolute
deviations, not means and squares, so that a one-off spike (a pause, a scheduling hiccup)
moves no split. The evidence that there is a change is the difference of the two medians over
its standard error: the residuals' mean absolute deviation as a sigma (x 1.2533), times
1.2533 sqrt(1/k + 1/(n-k)) (the standard error of a median). This is the single change point
of binary segmentation (the L1 cost of a piecewise constant fit), as change-point detectors of
training jobs use it; a series with more than one change is split at the largest, which is
what a window of steps around one fault holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# a normal distribution's sigma is sqrt(pi / 2) times its mean absolute deviation; and the
# standard error of a median of k normal values is sqrt(pi / 2) sigma / sqrt(k)
MEAN_DEVIATION_TO_SIGMA = MEDIAN_SE = 1.2533


@dataclass(frozen=True)
class Shift:
    """A level shift: ``at`` is the index of the first value of the new level."""

    at: int
    before: float  # median of the values before it
    after: float  # ... and from it on
    z: float  # the difference in standard errors of the series' noise


def level_shift(values: np.ndarray, min_side: int = 2) -> Shift | None:
    """The single level shift that best splits ``values`` (finite; None: too short)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2 * min_side:
        return None
    _, at = min((_cost(x, k), k) for k in range(min_side, n - min_side + 1))
    return split_at(x, at)


def split_at(values: np.ndarray, at: int) -> Shift:
    """``values`` split before index ``at`` (0 < at < len): the two levels, and the difference
    in standard errors, as :func:`level_shift` reads its best split; how far a series shifted
    where another one did."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    a, b = float(np.median(x[:at])), float(np.median(x[at:]))
    sigma = MEAN_DEVIATION_TO_SIGMA * _cost(x, at) / n  # the residuals' mean absolute deviation
    if not sigma > 0:
        sigma = 1e-12
    z = abs(b - a) / (MEDIAN_SE * sigma * np.sqrt(1.0 / at + 1.0 / (n - at)))
    return Shift(at=at, before=a, after=b, z=float(z))


def _cost(x: np.ndarray, k: int) -> float:
    """The sum of absolute deviations of each side of a split before ``k`` from its median."""
    return float(np.abs(x[:k] - np.median(x[:k])).sum() + np.abs(x[k:] - np.median(x[k:])).sum())
