"""The error every config check raises, and the one-line check that raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it."""


def require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")
