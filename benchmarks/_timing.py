"""The timing helper the benchmark scripts share (imported as a sibling: the scripts run from this folder)."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_time(fn: Callable[[], object], repeat: int = 5, *, warmup: bool = False) -> float:
    """Median wall time of ``repeat`` calls of ``fn`` in seconds; ``warmup`` first makes one untimed call
    (imports, caches), so the median measures the steady state."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
