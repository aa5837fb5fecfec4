"""The error every config check raises, the one-line check that raises it, the check that an
optional feature's extra is installed, and the message for a URL whose storage cannot be
reached."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from moelab.util import extra_command, nearest_existing

# Steps and token counts reach jitted code (step counter, LR schedule) as int32: larger values
# must be refused before any work, naming the option.
INT32_MAX = 2**31 - 1


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it."""


def require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


def require_steps(value: int, field_name: str) -> None:
    """A step count fits the int32 step counter and LR schedule of the jitted step."""
    require(value <= INT32_MAX, field_name, f"{value} is more steps than the jitted step counter "
            f"holds (int32, at most {INT32_MAX}); give a smaller value")


def require_seed(value: int, field_name: str) -> None:
    """A seed the PRNG key and the sampler take as is: larger ones would wrap silently onto
    smaller seeds (a 32-bit key), negative ones are refused by numpy mid-run."""
    require(0 <= value <= INT32_MAX, field_name, f"{value} must be in [0, {INT32_MAX}]")


def file_for_run_folder(path: Path | str) -> str:
    """The one-line refusal of a file given where a run folder goes: a run's own file (its
    config.yaml, say) names the folder holding it."""
    parent = Path(path).parent
    fix = (f"give its folder, {parent}" if (parent / "config.yaml").is_file()
           else "give the folder `moelab train` or `moelab branch` wrote")
    return f"{path}: a file, not a run folder; {fix}"


def need_extra(module: str, extra: str, what: str) -> None:
    """Stop, naming the extra to install, when ``what`` needs a package that a plain install
    leaves out (found without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs {module}, which is not installed; install the "
                          f"{extra} extra: {extra_command(extra)}")


def unreachable(url: str, e: Exception, fix: str = "") -> str:
    """The one-line message for ``url`` whose storage ``e`` failed to reach (each filesystem
    raises its own: gcsfs, s3fs, aiohttp, httpx), ``fix`` appended to the advice."""
    return (f"{url}: cannot be reached ({type(e).__name__}: {' '.join(str(e).split())}); check "
            f"the network, the URL and its credentials{fix}")


def require_folder(path: Path | str, what: str, fix: str) -> None:
    """Refuse a folder that a file stands at or above, before any work: the OS's own error
    ("Not a directory", "File exists") names neither the option nor the file in the way."""
    block = nearest_existing(path)
    require(block.is_dir(), what, f"{block} is a file, not a folder; {fix}")
