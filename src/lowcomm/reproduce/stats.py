"""Verdicts by the two-standard-deviation rule of docs/ALGORITHMS.md §7.2.

A measured quantity is a :class:`Stat`: one value per seed. An ordering "a < b" holds only if
the mean gap exceeds two seed standard deviations (the larger of the two groups' sample
standard deviations); reversed by more than that, it does not hold; in between it is
inconclusive (within noise). With fewer than two seeds there is no noise estimate, so an
ordering is inconclusive however large the gap.

A claim built of several comparisons (a chain such as "a < b ≈ c") holds if every link holds,
does not hold if any link does not hold, and is inconclusive otherwise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HOLDS = "holds"
FAILS = "does not hold"
NOISE = "inconclusive (within noise)"
NOT_MEASURED = "not measured"
VERDICTS = (HOLDS, FAILS, NOISE, NOT_MEASURED)


@dataclass(frozen=True)
class Stat:
    """A named quantity measured once per seed."""

    name: str
    values: tuple[float, ...]
    exact: bool = False
    """A constant (a paper's number, a bound): its standard deviation is 0, not unknown."""

    @property
    def mean(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return statistics.fmean(finite) if finite and len(finite) == len(self.values) else math.nan

    @property
    def sd(self) -> float:
        """Sample standard deviation over seeds (NaN with fewer than two values)."""
        if self.exact:
            return 0.0
        if len(self.values) < 2 or not math.isfinite(self.mean):
            return math.nan
        return statistics.stdev(self.values)

    def text(self, digits: int = 4) -> str:
        if not self.values:
            return f"{self.name}: no finished run"
        if not math.isfinite(self.mean):
            return f"{self.name}: non-finite ({', '.join(f'{v:g}' for v in self.values)})"
        if self.exact:
            return f"{self.name} = {self.mean:g}"
        spread = "" if math.isnan(self.sd) else f" ± {self.sd:.{digits}f}"
        return f"{self.name} = {self.mean:.{digits}f}{spread} (n={len(self.values)})"


def constant(name: str, value: float) -> Stat:
    """A number that is not measured (a paper's value, a threshold)."""
    return Stat(name, (value,), exact=True)


def derive(name: str, function: Callable[..., float], *stats: Stat) -> Stat:
    """A per-seed derived quantity, e.g. the gap between two methods run on the same seeds."""
    count = min((len(s.values) for s in stats), default=0)
    return Stat(name, tuple(function(*(s.values[i] for s in stats)) for i in range(count)))


@dataclass(frozen=True)
class Link:
    """One comparison inside a claim, with its verdict and the numbers behind it."""

    text: str
    verdict: str
    detail: str


def two_sd(a: Stat, b: Stat) -> float:
    """The noise band: two seed standard deviations (the larger of the two groups'); NaN if
    either group has no noise estimate (one seed)."""
    if math.isnan(a.sd) or math.isnan(b.sd):
        return math.nan
    return 2.0 * max(a.sd, b.sd)


def _unmeasurable(a: Stat, b: Stat) -> str | None:
    for stat in (a, b):
        if not stat.values:
            return f"{stat.name} has no finished run"
        if not math.isfinite(stat.mean):
            return f"{stat.name} is not finite"
    return None


def less(a: Stat, b: Stat, *, strict: bool = True, text: str | None = None) -> Link:
    """The claim a < b (strict) or a ≤ b / a ≲ b (not strict).

    Strict: holds if b - a > 2 sd, does not hold if a - b > 2 sd, else within noise. Not strict:
    holds unless a exceeds b by more than 2 sd (equality within noise satisfies "≤").
    """
    label = text or f"{a.name} {'<' if strict else '≤'} {b.name}"
    missing = _unmeasurable(a, b)
    if missing is not None:
        return Link(label, NOT_MEASURED, missing)
    gap = b.mean - a.mean
    band = two_sd(a, b)
    detail = f"gap {gap:+.4g}, 2 sd {band:.4g}"
    if math.isnan(band):
        return Link(label, NOISE, f"gap {gap:+.4g}; one seed, no noise estimate")
    if strict:
        verdict = HOLDS if gap > band else FAILS if gap < -band else NOISE
    else:
        verdict = FAILS if gap < -band else HOLDS
    return Link(label, verdict, detail)


def greater(a: Stat, b: Stat, *, strict: bool = True, text: str | None = None) -> Link:
    """The claim a > b (strict) or a ≥ b."""
    return less(b, a, strict=strict, text=text or f"{a.name} {'>' if strict else '≥'} {b.name}")


def about_equal(a: Stat, b: Stat, *, rel_tol: float | None = None, text: str | None = None) -> Link:
    """The claim a ≈ b.

    Without a tolerance: holds if |a - b| ≤ 2 sd, else does not hold. With ``rel_tol`` (a
    claimed bound such as "< 1%"): holds if |a - b| < rel_tol·|b|; does not hold if the gap
    exceeds both the bound and 2 sd; otherwise inconclusive (the gap is beyond the bound but
    within noise).
    """
    label = text or f"{a.name} ≈ {b.name}"
    missing = _unmeasurable(a, b)
    if missing is not None:
        return Link(label, NOT_MEASURED, missing)
    gap = a.mean - b.mean
    band = two_sd(a, b)
    detail = f"gap {gap:+.4g}, 2 sd {band:.4g}"
    if rel_tol is not None:
        bound = rel_tol * abs(b.mean)
        detail += f", bound {rel_tol:.1%} = {bound:.4g}"
        if abs(gap) < bound:
            return Link(label, HOLDS, detail)
        if math.isnan(band):
            return Link(label, NOISE, detail + "; one seed, no noise estimate")
        return Link(label, FAILS if abs(gap) > band else NOISE, detail)
    if math.isnan(band):
        return Link(label, NOISE, f"gap {gap:+.4g}; one seed, no noise estimate")
    return Link(label, HOLDS if abs(gap) <= band else FAILS, detail)


def below(a: Stat, bound: float, *, text: str | None = None) -> Link:
    """The claim a < bound for a constant bound: holds if mean + 2 sd < bound, does not hold if
    mean - 2 sd > bound, else within noise. One seed: the value alone decides (no band)."""
    label = text or f"{a.name} < {bound:g}"
    if not a.values or not math.isfinite(a.mean):
        return Link(label, NOT_MEASURED, f"{a.name} has no finite measurement")
    band = 0.0 if math.isnan(a.sd) else 2.0 * a.sd
    detail = f"mean {a.mean:.4g}, 2 sd {band:.4g}, bound {bound:g}"
    if a.mean + band < bound:
        return Link(label, HOLDS, detail)
    if a.mean - band > bound:
        return Link(label, FAILS, detail)
    return Link(label, NOISE, detail)


def combine(links: Sequence[Link]) -> str:
    """Verdict of a claim made of several links."""
    verdicts = [link.verdict for link in links]
    if not verdicts or all(v == NOT_MEASURED for v in verdicts):
        return NOT_MEASURED
    if FAILS in verdicts:
        return FAILS
    if all(v == HOLDS for v in verdicts):
        return HOLDS
    return NOISE


@dataclass
class Finding:
    """The outcome of one prediction: the claim, the measured numbers and the verdict."""

    id: str
    claim: str
    measured: list[str]
    links: list[Link] = field(default_factory=list)
    verdict: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = combine(self.links)
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}")
