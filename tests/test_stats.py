from __future__ import annotations

import math

import pytest

from kvflow_ray.core.stats import percentile


def test_percentile_is_the_nearest_rank_on_the_sorted_values() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted
    assert percentile(values, 0.0) == 1 and percentile(values, 1.0) == 100
    assert percentile(values, 0.5) == 51  # element round(0.5 x 99) = 50 (0-based) of 1..100: one of the values
    assert percentile(values, 0.99) == 99  # round(98.01) = 98
    assert percentile([3.0], 0.9) == 3.0


def test_percentile_of_nothing_is_the_default() -> None:
    assert math.isnan(percentile([], 0.5))
    assert percentile([], 0.5, 0.0) == 0.0 and percentile([], 0.5, None) is None


@pytest.mark.parametrize("q", [-0.1, 1.5, 99])
def test_percentile_takes_a_fraction(q: float) -> None:
    with pytest.raises(ValueError, match="within"):
        percentile([1.0, 2.0], q)
