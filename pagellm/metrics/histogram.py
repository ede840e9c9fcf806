"""Percentiles from a latency histogram's bucket counts, over the whole run or a recent window.

The server already counts every request's TTFT and TPOT in Prometheus histograms; the live page
reads percentiles from those same counts (no second bookkeeping), interpolated within a bucket
as Prometheus' ``histogram_quantile`` does. A window is the difference of two readings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramCounts:
    """Cumulative counts per upper bound (the last bound is +Inf), as Prometheus exposes them."""

    upper_bounds: tuple[float, ...]
    cumulative: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def since(self, earlier: HistogramCounts) -> HistogramCounts:
        """The observations made after ``earlier`` (a reading of the same histogram)."""
        if earlier.upper_bounds != self.upper_bounds:
            raise ValueError("readings of different histograms")
        return HistogramCounts(self.upper_bounds, tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative)))

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 < q < 1), linear within its bucket; None without observations.
        Beyond the last finite bound, the last finite bound (the estimate cannot say more)."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"q must be in (0, 1), got {q}")
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in zip(self.upper_bounds, self.cumulative):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                in_bucket = cumulative - lower_count
                fraction = (rank - lower_count) / in_bucket if in_bucket > 0 else 1.0
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound
