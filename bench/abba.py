"""Back-to-back pairs in ABBA order, for the benchmarks that compare trainpod with a baseline.

This machine's speed drifts by tens of percent from run to run, and its disk swings one write +
fsync by 2-4x. The benchmarks therefore run the two sides one right after the other, the order
alternating (ABBA) so that a drift, or the disk's lagging work from the previous run, favours
neither. They judge on the best run of each, since interference only ever adds time (timeit's
reasoning), and show the median of the pair ratios beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

B = TypeVar("B")
M = TypeVar("M")


def paired(
    pairs: int,
    baseline: Callable[[], B],
    measured: Callable[[], M],
    between: Callable[[], None] = lambda: None,
) -> tuple[list[B], list[M]]:
    """(the baseline's results, the measured side's results), `pairs` of each in ABBA order;
    `between` runs after every run (to drop what it wrote, say)."""
    base_results: list[B] = []
    measured_results: list[M] = []
    for pair in range(pairs):
        runs = [(base_results, baseline), (measured_results, measured)]
        for results, run in runs if pair % 2 == 0 else reversed(runs):
            results.append(run())
            between()
    return base_results, measured_results
