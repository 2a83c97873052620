"""Config stage: units and the integer arithmetic every stage sizes things with."""

from __future__ import annotations

GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers (blocks needed for `a` tokens of `b` each)."""
    return -(-a // b)
