"""What a run costs: TRAINPOD_GPU_HOURLY_USD x training time, capped by TRAINPOD_BUDGET_USD."""

from __future__ import annotations

import os
from collections.abc import Mapping

from trainpod.errors import ConfigError


def _usd(name: str, example: str, environ: Mapping[str, str] | None = None) -> float | None:
    raw = (os.environ if environ is None else environ).get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too: no spend compares as over a NaN budget, so it would never stop a run
        raise ConfigError([f"{name}={raw!r} is not an amount in USD; set it like {name}={example}"])
    return value


def hourly_usd(environ: Mapping[str, str] | None = None) -> float | None:
    """The pod's price per hour, for cost tracking (unset: no cost shown)."""
    return _usd("TRAINPOD_GPU_HOURLY_USD", "2.49", environ)


def budget_usd(environ: Mapping[str, str] | None = None) -> float | None:
    """The most a run may spend; at 100% it commits and exits 3 (unset: no cap)."""
    return _usd("TRAINPOD_BUDGET_USD", "50", environ)


def check_environment(counts_cost: bool = True, environ: Mapping[str, str] | None = None) -> None:
    """Fail at the start (exit 2), not hours into a run, when either amount is malformed, or when a workload
    that `counts_cost` (training, your own program) has a budget without the price its cost is counted with:
    that budget would never be spent."""
    environ = os.environ if environ is None else environ
    hourly, budget = hourly_usd(environ), budget_usd(environ)
    if counts_cost and hourly is None and budget is not None:
        raise ConfigError(
            [
                f"TRAINPOD_BUDGET_USD={environ['TRAINPOD_BUDGET_USD']!r} is set but TRAINPOD_GPU_HOURLY_USD is "
                "not: a run's cost is its hours x that price, so without it the budget never stops the run; "
                "set it like TRAINPOD_GPU_HOURLY_USD=2.49 (the pod's price per hour; a cluster's: all its "
                "nodes'), or unset TRAINPOD_BUDGET_USD (a single RunPod pod with its RUNPOD_API_KEY reads "
                "its own price)"
            ]
        )
