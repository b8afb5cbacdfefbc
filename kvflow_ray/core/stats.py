"""The one percentile rule every report uses (the simulator, the load generator, the benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

D = TypeVar("D", float, None)


def percentile(values: Iterable[float], q: float, default: D = math.nan) -> float | D:
    """The `q`-quantile (0 <= q <= 1) by nearest rank: the sorted values' element at round(q (n - 1)),
    so q = 0 is the minimum, q = 1 the maximum and q = 0.5 a median that is one of the values.
    `default` when there are no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q must be within [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return default
    return ordered[round(q * (len(ordered) - 1))]
