"""The one percentile rule every report uses (the simulator, the load generator, the benchmarks), and the
paired bootstrap the quality harnesses put intervals on their figures with."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
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


def paired_bootstrap(n: int, stat: Callable[[Sequence[int]], float], rng: random.Random,
                     resamples: int) -> tuple[float, float, float]:
    """`stat` over all `n` items and its paired-bootstrap 95% interval: the items are resampled together
    (with replacement), so a statistic comparing two methods on the same items keeps their pairing."""
    point = stat(range(n))
    draws = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return point, draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]
