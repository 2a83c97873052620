"""Workload stage: when requests arrive."""

from __future__ import annotations

import math
import random

from pagellm.errors import ConfigError


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times (seconds from the start) of num_requests requests.

    Gaps between arrivals are gamma-distributed with shape `burstiness` and mean
    1 / request_rate: burstiness 1 is a Poisson process, below 1 burstier, above 1 more
    even. The first request goes at 0. An infinite rate sends everything at 0.
    """
    if num_requests < 0:
        raise ConfigError(f"the number of requests must be >= 0, got {num_requests}")
    if not (request_rate > 0):
        raise ConfigError(f"the request rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ConfigError(f"burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    # Its own stream, so that the arrivals do not move when the workload's draws change.
    rng = random.Random(f"arrivals:{seed}")
    scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    times = []
    now = 0.0
    for i in range(num_requests):
        if i > 0:
            now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times
