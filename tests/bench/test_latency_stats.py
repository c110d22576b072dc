import math

import pytest

from kvserve.bench.latency_stats import percentile, summarize


def test_percentiles_match_hand_computed_linear_interpolation():
    samples = [15.0, 20.0, 35.0, 40.0, 50.0]  # unsorted input is sorted first
    # h = (n-1) q/100 = 4q/100
    assert percentile(samples, 0) == 15.0
    assert percentile(samples, 50) == 35.0  # h = 2
    assert percentile(samples, 40) == pytest.approx(29.0)  # h = 1.6: 20 + 0.6*15
    assert percentile(samples, 90) == pytest.approx(46.0)  # h = 3.6: 40 + 0.6*10
    assert percentile(samples, 99) == pytest.approx(49.6)  # h = 3.96: 40 + 0.96*10
    assert percentile(samples, 100) == 50.0
    assert percentile(list(reversed(samples)), 90) == pytest.approx(46.0)


def test_percentile_of_ten_values():
    samples = [float(x) for x in range(1, 11)]  # 1..10
    assert percentile(samples, 50) == pytest.approx(5.5)  # h = 4.5
    assert percentile(samples, 90) == pytest.approx(9.1)  # h = 8.1
    assert percentile(samples, 99) == pytest.approx(9.91)  # h = 8.91


def test_single_and_empty_samples():
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s.count == 4
    assert s.mean == pytest.approx(4.0)
    assert s.p50 == pytest.approx(2.5)  # h = 1.5
    assert s.p90 == pytest.approx(7.9)  # h = 2.7: 3 + 0.7*7
    assert s.p99 == pytest.approx(9.79)  # h = 2.97: 3 + 0.97*7
    empty = summarize([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)
