"""Sim stage: non-negative least squares for the calibrated cost model.

A step cost is a sum of non-negative costs (a constant, per token, per request, ...);
letting a coefficient go negative fits noise and predicts nonsense (even negative
durations) outside the measured range. Lawson and Hanson's active-set method, written
for the few features the calibration uses.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iterations: int | None = None) -> np.ndarray:
    """x >= 0 minimizing ||a @ x - b||_2, for a of shape [rows, features]."""
    rows, num_features = a.shape
    assert b.shape == (rows,)
    max_iterations = max_iterations or 30 * num_features
    x = np.zeros(num_features)
    passive = np.zeros(num_features, dtype=bool)  # features allowed to be non-zero
    tolerance = 1e-10 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(rows, num_features)
    for _ in range(max_iterations):
        gradient = a.T @ (b - a @ x)  # the direction that reduces the residual
        candidates = ~passive & (gradient > tolerance)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            z = np.zeros(num_features)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x toward z only as far as keeps every coefficient >= 0, and drop
            # the ones that reach zero.
            blocked = passive & (z <= 0)
            alpha = float(np.min(x[blocked] / (x[blocked] - z[blocked])))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x
