"""Config stage: the checks every config runs on the values it is built with."""

from __future__ import annotations

from pagellm.errors import ConfigError


def check_int(owner: str, name: str, value: object, minimum: int) -> None:
    """`owner.name` must be an int of at least `minimum` (a ConfigError naming it if not)."""
    # bool is an int subclass; `block_size=True` is a bug, not a size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be at least {minimum}, got {value}.")
