"""Operation arguments read and checked: token counts, mixtures, the step a token count
ends at, and whether RoPE covers a longer context.

The changes themselves (``Change``, ``apply_change``) and the resume rules that keep a run's
past fixed live in ``moelab.train.changes``: a resume applies them, so they sit below ``ops``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from moelab.config import RunConfig
from moelab.config.errors import INT32_MAX, file_for_run_folder, require
from moelab.config.run import rope_reach
from moelab.train.changes import PlanError
from moelab.util import is_url


def steps_for_tokens(cfg: RunConfig, tokens: int) -> int:
    """The first step count that has trained at least ``tokens`` tokens."""
    segs = cfg.data.segments()
    for g, nxt in zip(segs, [*segs[1:], None]):
        need = tokens - cfg.data.tokens_before(g.start)
        n = max(0, -(-need // (g.seq_len * g.batch_size)))
        if nxt is None or g.start + n <= nxt.start:
            return g.start + n
    raise AssertionError("unreachable: the last segment has no end")


def check_end(end: int, option: str) -> int:
    """``end``, a new last step computed from ``option``; the compiled step counts steps in
    int32, so a later end would fail there with a traceback."""
    require(end <= INT32_MAX, option, f"ends at step {end:,}, past the last step a run can "
            f"count ({INT32_MAX:,}); choose a smaller value")
    return end


_NUMBER = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_tokens(text: str, what: str = "tokens") -> int:
    """'2048', '1.5M', '2e6', '10B' -> a positive whole number of tokens."""
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([kKmMbBtT]?)\s*", str(text))
    if m and float(m.group(1)) <= 0:
        raise PlanError(f"{what}: {text!r}: must be more than 0 tokens; write e.g. 2048, 1.5M")
    if not m:
        raise PlanError(f"{what}: {text!r} is not a token count; write e.g. 2048, 1.5M, 10B")
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2).lower()]))


def step_arg(text: str) -> int:
    """A step count on the command line: a whole number, written as the config accepts one
    (``1000``, ``1e3``); argparse's own ``int`` refuses ``1e3``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps")
    return int(value)


def check_run_folder(run: Path | str) -> None:
    """A run operation's folder must exist: one message for every operation (the config file
    it lacks would be named instead)."""
    if is_url(run):  # checked before Path(), which mangles it: file:///x -> file:/x
        raise FileNotFoundError(f"{run}: a URL; replan and branch work on a local run folder: "
                                "copy the run here (`moelab resume URL` resumes it where it is, "
                                "`moelab history URL` shows it)")
    if Path(run).is_file():
        raise NotADirectoryError(file_for_run_folder(run))
    if not Path(run).is_dir():
        raise FileNotFoundError(f"{run}: no such folder; give a run folder written by "
                                "`moelab train` or `moelab branch`")


def parse_mixture(text: str) -> dict[str, float]:
    """'prose=0.7,code=0.3' -> {'prose': 0.7, 'code': 0.3}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(rf"([\w.-]+)\s*=\s*({_NUMBER})", part)
        if not m:
            raise PlanError(f"--mixture {text}: {part!r} is not DOMAIN=WEIGHT (weight >= 0); "
                            "write e.g. prose=0.7,code=0.3")
        if m.group(1) in out:  # as a YAML mapping refuses a repeated key
            raise PlanError(f"--mixture {text}: domain {m.group(1)!r} given twice; keep one")
        out[m.group(1)] = float(m.group(2))
    if not out or sum(out.values()) <= 0:
        raise PlanError(f"--mixture {text}: no weight > 0; write e.g. prose=0.7,code=0.3")
    return out


def rope_note(cfg: RunConfig) -> str:
    """Whether RoPE tells positions apart across the longest context stage
    (``moelab.config.run.rope_reach``)."""
    r, wave, span, longest = rope_reach(cfg)
    if not span:
        return f"RoPE: not used; longest context {longest:,} tokens"
    verdict = ("ok" if span <= wave else "WARNING: beyond the wavelength distant "
               "positions alias (model.rope_theta is fixed for a run: plan it at the start)")
    return (f"RoPE: theta {cfg.model.rope_theta:g} on {r} dims per head, longest wavelength "
            f"{wave:,.0f} tokens; longest distance a RoPE layer attends over "
            f"{span:,} tokens (context up to {longest:,}): {verdict}")
