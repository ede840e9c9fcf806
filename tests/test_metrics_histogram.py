"""Percentiles from histogram bucket counts (the web page's TTFT/TPOT), over a run and a window."""

import pytest

from pagellm.engine.protocol import EngineStats
from pagellm.metrics.histogram import HistogramCounts
from pagellm.metrics.prometheus import PrometheusMetrics


def test_quantiles_interpolate_within_a_bucket() -> None:
    counts = HistogramCounts((0.1, 0.5, 1.0, float("inf")), (2.0, 6.0, 8.0, 10.0))
    assert counts.count == 10
    assert counts.quantile(0.1) == pytest.approx(0.05)  # rank 1 of the first bucket's 2: halfway to 0.1
    assert counts.quantile(0.5) == pytest.approx(0.1 + 0.4 * 3 / 4)  # rank 5: 3 of the second bucket's 4
    assert counts.quantile(0.99) == 1.0  # in +Inf: the last finite bound
    assert HistogramCounts((1.0, float("inf")), (0.0, 0.0)).quantile(0.5) is None
    with pytest.raises(ValueError):
        counts.quantile(1.0)


def test_a_window_is_the_difference_of_two_readings() -> None:
    metrics = PrometheusMetrics("m", stats=EngineStats)
    for seconds in (3.0, 3.0, 3.0):  # an old, slow period
        metrics.observe_time_to_first_token(seconds)
    before = metrics.latency_counts()
    for seconds in (0.003, 0.007, 0.05, 0.05, 0.05):
        metrics.observe_time_to_first_token(seconds)
    now = metrics.latency_counts()
    window = now["ttft"].since(before["ttft"])
    assert (window.count, now["ttft"].count) == (5, 8)
    assert window.quantile(0.5) == pytest.approx(0.04 + 0.02 * 0.5 / 3)  # rank 2.5 among the five recent
    assert now["ttft"].quantile(0.9) > 2.5  # the whole run still sees the slow ones
    assert now["tpot"].count == 0 and now["tpot"].quantile(0.5) is None
