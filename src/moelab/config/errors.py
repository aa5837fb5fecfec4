"""The error every config check raises, the one-line check that raises it, and the check that
an optional feature's extra is installed."""

from __future__ import annotations

import importlib.util

# Steps and token counts reach jitted code (step counter, LR schedule) as int32: larger values
# must be refused before any work, naming the option.
INT32_MAX = 2**31 - 1


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it."""


def require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


def need_extra(module: str, extra: str, what: str) -> None:
    """Stop, naming the extra to install, when ``what`` needs a package that a plain install
    leaves out (found without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs {module}, which is not installed: pip install "
                          f"'moelab[{extra}]' (in a checkout: pip install -e '.[{extra}]'; "
                          "./install.sh installs every extra)")
