"""The CI gate of ``megascope compare --fail-above PCT``: whether B's step is slower than A's by
more than PCT%, beyond a noise model that holds run-to-run drift, not only step-to-step spread.

Each run is a series of step times (per step, the median over its ranks). The reference is one
run A or several baseline runs A1..Ak (``compare A1 A2 A3 -- B``), their steps pooled.

* **The change**: B's median step less the reference's (the report's step row), in percent of
  the reference's median.
* **The noise** of that change, as a standard deviation ``sqrt(steps^2 + drift^2)``:

  - ``steps``: the step-to-step part, the standard deviation of the percentile bootstrap's
    differences (:func:`analyzer.compare_noise.bootstrap`: steps drawn again, a fixed seed);
  - ``drift``: the run-to-run part, which no bootstrap over one run's steps sees (on shared
    cores two runs of one configuration differ by more than either's steps spread). One run
    cannot show it: the spread between runs is a prior, ``--drift PCT`` of the reference's
    median step (:data:`DRIFT_PRIOR`, 3%: healthy runs on 2 shared cores spread by 2-4%,
    docs/benchmarks.md), pooled with the spread of the baselines' medians where there are two
    or more (the prior counts as :data:`PRIOR_RUNS` runs: ``k`` baselines give ``k - 1``
    degrees of freedom of their own, so their spread takes over as they grow), times
    sqrt(1 + 1/k) (B against the mean of k runs, each with its own level). Each reference
    run's second half less its first half (medians of the halves; their root mean square) is
    a floor: a run that drifts within itself drifts between runs at least as much. B's own
    halves are not noise: a B slowed in part of its steps would widen its own interval and
    pass.

  The interval is the change plus or minus z(0.975) = 1.96 of that deviation.
* **The evidence**: ranks that a culprit's finding (a straggler, a data stall, a throttled or
  hung rank: the kinds that say a rank went wrong,
  :data:`analyzer.findings.registry.CULPRIT_KINDS`) names in B and no reference run's finding
  names with the same kind (a straggler that appeared, as the report's findings list it), or
  that the reference names too but whose price (below) grew from A to B by more than PCT (a
  healthy reference on shared cores names a straggler now and then; the same rank slowed in B
  is then "in A"), whose own work (the step less exposed communication) is longer in B than in
  A. ``analyze`` judged
  that rank against its peers of the same run, so it changed whatever the run-to-run drift
  says; and a rank that turns slow for part of the run moves B's mean step by what it costs
  even where it is slow in fewer than half of B's steps, which the median does not see. A
  pipeline stage whose compute over the other stages' grew from A to B by at least a margin
  (5% in the ranks' CPU time where both runs counted it, else its detector's 10%), and that a
  ``stage_imbalance`` of B names, is evidence too
  (:func:`analyzer.compare.stage_evidence`: with one rank per stage no straggler names a slow
  rank), priced at what undoing that growth saves of B's step.
* **The price** of that evidence: the largest severity ``s`` of those findings (the share of
  B's step a run without the culprit saves: the what-if's, where the report has one), as the
  change it stands for, ``s / (1 - s)`` of the reference's median step; for a culprit the
  reference names too, the growth of that price (:func:`grown`). It is read within B,
  so no drift between runs moves it: where two runs of one configuration differ by more than
  PCT (a machine that slows by a third from one minute to the next), B's median may read no
  slower than A's while the rank named in B alone costs it more than PCT.

* **The work**, on a CPU device whose ranks counted their training threads' CPU time: the same
  change and interval read over the series of the ranks' CPU time a step (per step, the mean
  over the ranks). On shared cores a run's wall time holds the host's minute: two healthy
  pipeline runs trained 20 s apart read medians 26% apart with the same CPU time a step
  (+0.4%), while over 20 such twins the CPU time moved by 7% (sd) and the wall time by 15%
  (docs/benchmarks.md). A B slower in wall time whose ranks did no more work is the host's.

**Rule.** Without evidence: fail when the change is above PCT% and the interval lies above zero
(B is slower beyond the noise, and by more than PCT%), and, where the work was counted, its
interval lies above zero too (the ranks worked longer: a regression that only waits, a sleep
or a slower disk on every rank, then needs a culprit's finding to fail on a CPU device). With evidence: fail when the change,
B's mean step over the reference's mean step less one, or the evidence's price is above PCT%
(B changed: only the size is asked). Demanding the whole interval above PCT% (the rule
before) passed a real 2 x PCT slowdown whenever the interval was wider than PCT on either
side, as it is on busy cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np

from analyzer.compare_noise import LEVEL, bootstrap

Z = NormalDist().inv_cdf((1 + LEVEL) / 2)  # 1.96 at 95%
# the run-to-run standard deviation of a run's median step where runs do not measure it, in %
# of the reference's median (``--drift PCT``): healthy runs of one configuration on 2 shared
# cores spread by 2-4% (docs/benchmarks.md, "compare --fail-above 5 ... a prior")
DRIFT_PRIOR = 3.0
PRIOR_RUNS = 4  # ...counted as this many runs' spread against the baselines' own (k - 1)
MAX_SEVERITY = 0.95  # the evidence's price stops at 19 times the step


@dataclass(frozen=True)
class Gate:
    """The gate's decision and what it read (ns and percent of the reference's median step)."""

    pct: float  # PCT
    base_ns: float  # the reference's median step
    change_ns: float  # B's median less the reference's
    mean_change_ns: float  # B's mean step less the reference's mean step
    steps_ns: float  # the step-to-step standard deviation of the change
    drift_ns: float  # the run-to-run standard deviation
    drift_from: str  # "A's halves", "the baselines' halves", "the baselines' medians", "the prior"
    # ranks named slow in B only, or in both at a price grown from A
    evidence: list[int] = field(default_factory=list)
    failed: bool = False
    prior_pct: float = DRIFT_PRIOR  # the drift's prior, % of the reference's median step
    price_ns: float = float("nan")  # the evidence's price (module docstring)
    # on a CPU device, the ranks' CPU time a step: B's median less the reference's and the low
    # end of its interval (NaN elsewhere)
    work_change_ns: float = float("nan")
    work_low_ns: float = float("nan")
    work_base_ns: float = float("nan")  # the reference's median CPU time a step

    @property
    def beyond(self) -> bool:
        """Whether the change is above PCT% and its interval above zero: slower beyond the
        noise, by more than PCT% (the rule without evidence)."""
        return bool(self.change_ns > self.limit_ns and np.isfinite(self.low_ns) and self.low_ns > 0)

    @property
    def host_minute(self) -> bool:
        """Whether the ranks' CPU time a step, counted, did not grow beyond its noise: their
        wall time moved without their work (module docstring)."""
        return bool(np.isfinite(self.work_low_ns) and self.work_low_ns <= 0)

    @property
    def limit_ns(self) -> float:
        """PCT% of the reference's median step."""
        return self.base_ns * self.pct / 100

    @property
    def sd_ns(self) -> float:
        """The change's standard deviation: steps and drift together."""
        return math.hypot(self.steps_ns, self.drift_ns)

    @property
    def low_ns(self) -> float:
        """The interval's low end."""
        return self.change_ns - Z * self.sd_ns

    @property
    def high_ns(self) -> float:
        """The interval's high end."""
        return self.change_ns + Z * self.sd_ns

    @property
    def judged_ns(self) -> float:
        """The change held against PCT: the median's, or with evidence the largest of the
        median's, the mean's and the evidence's price."""
        if not self.evidence:
            return self.change_ns
        return max([self.change_ns] + [x for x in (self.mean_change_ns, self.price_ns)
                                       if np.isfinite(x)])  # fmt: skip


def _pct(x: float, base: float) -> float | None:
    return round(100 * x / base, 2) if base and np.isfinite(x) else None


def _ms(x: float) -> float | None:
    return round(x / 1e6, 3) if np.isfinite(x) else None


def halves(series: np.ndarray) -> float:
    """The median of the second half of ``series`` less that of its first (NaN under 4)."""
    y = np.asarray(series, dtype=float)
    y = y[np.isfinite(y)]
    if len(y) < 4:
        return float("nan")
    mid = len(y) // 2
    return float(np.median(y[len(y) - mid :]) - np.median(y[:mid]))


def drift(refs: Sequence[np.ndarray], prior_pct: float = DRIFT_PRIOR) -> tuple[float, str]:
    """The run-to-run standard deviation of B's median step less the reference's, from the
    reference runs ``refs`` (each a series of step times) and the prior (``prior_pct`` of the
    reference's median step), and where it was read (module docstring)."""
    hs = [h for h in (halves(r) for r in refs) if np.isfinite(h)]
    half = math.sqrt(sum(h * h for h in hs) / len(hs)) if hs else 0.0
    medians = [float(np.median(r)) for r in refs if len(r)]
    k = len(medians)
    pooled = np.concatenate([r for r in refs if len(r)]) if k else np.empty(0)
    prior = prior_pct / 100 * float(np.median(pooled)) if k else 0.0
    weight = PRIOR_RUNS if prior > 0 else 0
    if k >= 2:
        own = float(np.var(medians, ddof=1))
        run_var = (weight * prior**2 + (k - 1) * own) / (weight + k - 1)
        where = "the baselines' medians"
    else:
        run_var, where = prior**2, "the prior"
    between = math.sqrt(run_var * (1 + 1 / max(k, 1)))
    if half > between:
        return half, "A's halves" if len(refs) == 1 else "the baselines' halves"
    return between, where


def grown(severity_a: float, severity_b: float) -> float:
    """The severity whose price (:func:`price`) is that of ``severity_b`` less that of
    ``severity_a``: what a culprit both runs name costs B more than it cost A (0 where it costs
    no more)."""
    sa, sb = (min(max(float(s), 0.0), MAX_SEVERITY) for s in (severity_a, severity_b))
    more = sb / (1 - sb) - sa / (1 - sa)
    return more / (1 + more) if more > 0 else 0.0


def _interval(refs: Sequence[np.ndarray], b: np.ndarray, prior_pct: float) -> tuple:
    """B against the reference runs: the bootstrap's difference of medians, the step-to-step
    and the run-to-run standard deviations, and where the latter was read."""
    pooled = np.concatenate(refs) if refs else np.empty(0)
    (d,) = bootstrap(pooled[:, None], b[:, None])
    steps_sd = (d.high - d.low) / (2 * Z) if np.isfinite(d.high - d.low) else float("nan")
    drift_sd, where = drift(refs, prior_pct)
    return d, steps_sd, drift_sd, where


def price(severity: float, base_ns: float) -> float:
    """The change a culprit of ``severity`` (a share of B's step) stands for: ``s / (1 - s)`` of
    the reference's median step ``base_ns`` (NaN without one)."""
    if not (np.isfinite(severity) and severity > 0):
        return float("nan")
    s = min(float(severity), MAX_SEVERITY)
    return base_ns * s / (1 - s)


def decide(
    refs: Sequence[np.ndarray],
    b: np.ndarray,
    pct: float,
    evidence: list[int],
    prior_pct: float = DRIFT_PRIOR,
    severity: float = float("nan"),
    work: tuple[Sequence[np.ndarray], np.ndarray] | None = None,
) -> Gate:
    """The gate on reference runs ``refs`` and run ``b`` (series of step times, ns), PCT, the
    ranks of evidence, the drift's prior in %, the evidence's largest severity and, on a CPU
    device, the same runs' series of the ranks' CPU time a step (module docstring)."""
    refs = [np.asarray(r, dtype=float) for r in refs]
    pooled = np.concatenate(refs) if refs else np.empty(0)
    b = np.asarray(b, dtype=float)
    d, steps_sd, drift_sd, where = _interval(refs, b, prior_pct)
    mean_change = float(b.mean() - pooled.mean()) if len(b) and len(pooled) else float("nan")
    cost = price(severity, d.a) if evidence else float("nan")
    gate = Gate(pct, d.a, d.diff, mean_change, steps_sd, drift_sd, where, sorted(evidence),
                prior_pct=prior_pct, price_ns=cost)  # fmt: skip
    if work is not None:
        w_refs = [np.asarray(r, dtype=float) for r in work[0]]
        w, w_steps, w_drift, _ = _interval(w_refs, np.asarray(work[1], dtype=float), prior_pct)
        gate = replace(gate, work_change_ns=w.diff, work_base_ns=w.a,
                       work_low_ns=w.diff - Z * math.hypot(w_steps, w_drift))  # fmt: skip
    limit = gate.limit_ns
    if not (np.isfinite(gate.judged_ns) and np.isfinite(limit)):
        return gate
    if evidence:
        failed = gate.judged_ns > limit
    else:
        failed = gate.beyond and not gate.host_minute
    return replace(gate, failed=bool(failed))


def line(g: Gate) -> str:
    """The decision in one line: the change, the limit, the noise and why it failed or not."""
    pct = _pct(g.change_ns, g.base_ns)
    head = (
        f"--fail-above {g.pct:g}%: B's median step {_signed(pct, '%')} ({_signed(_ms(g.change_ns))}"
        f" ms), limit {_signed(_ms(g.limit_ns))} ms; 95% interval {_signed(_ms(g.low_ns))} to "
        f"{_signed(_ms(g.high_ns))} ms (steps {_signed(_ms(Z * g.steps_ns), '', '+/-')}, drift "
        f"{_signed(_ms(Z * g.drift_ns), '', '+/-')} ms from {_drift_from(g)})"
    )
    if g.evidence:
        ranks = ", ".join(str(r) for r in g.evidence)
        mean = _signed(_pct(g.mean_change_ns, g.base_ns), "%")
        cost = _pct(g.price_ns, g.base_ns)
        priced = f", its price {_signed(cost, '%')}" if cost is not None else ""
        plural = "s" if len(g.evidence) > 1 else ""
        why = (
            f"rank{plural} {ranks} slower in B than in A, mean step {mean}{priced}: "
            f"{'above' if g.failed else 'not above'} the limit"
        )
    elif g.failed:
        why = "above the limit and beyond the noise"
    elif g.beyond and g.host_minute:
        work = _signed(_pct(g.work_change_ns, g.work_base_ns), "%")
        why = (
            f"above the limit and beyond the noise in wall time, but the ranks' CPU time a step "
            f"({work}) did not grow beyond its noise: the host ran them less"
        )
    elif g.change_ns > g.limit_ns:
        why = "above the limit but within the noise"
    else:
        why = "not above the limit"
    return f"{head}; {why} (exit {1 if g.failed else 0})"


def _drift_from(g: Gate) -> str:
    """Where the drift was read, with its prior where the prior was part of it."""
    if g.drift_from in ("the prior", "the baselines' medians"):
        return f"{g.drift_from}, prior {g.prior_pct:g}%"
    return g.drift_from


def _signed(x: float | None, unit: str = "", sign: str = "") -> str:
    """``x`` with its sign (or ``sign`` before it) and one decimal; n/a for None."""
    if x is None:
        return "n/a"
    return f"{sign}{x:.1f}{unit}" if sign else f"{x:+.1f}{unit}"


def as_json(g: Gate) -> dict[str, Any]:
    """The report's ``fail_above`` object."""
    return {
        "pct": g.pct,
        "limit_ms": _ms(g.limit_ns),
        "failed": g.failed,
        "change_pct": _pct(g.change_ns, g.base_ns),
        "mean_change_pct": _pct(g.mean_change_ns, g.base_ns),
        "price_pct": _pct(g.price_ns, g.base_ns),
        "low_ms": _ms(g.low_ns),
        "high_ms": _ms(g.high_ns),
        "steps_sd_ms": _ms(g.steps_ns),
        "drift_sd_ms": _ms(g.drift_ns),
        "drift_pct": _pct(g.drift_ns, g.base_ns),
        "drift_from": g.drift_from,
        "drift_prior_pct": g.prior_pct,
        "evidence": g.evidence,
        "work_change_pct": _pct(g.work_change_ns, g.work_base_ns),
        "work_low_pct": _pct(g.work_low_ns, g.work_base_ns),
        "reason": line(g),
    }
