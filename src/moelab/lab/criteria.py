"""Pre-registered criteria: parse one line of text, evaluate it on runs' metrics.

Grammar (one criterion per line; the canonical form is what records store)::

    METRIC [AGG] [over steps A-B] [in ARM [- ARM | / ARM]] OP VALUE[%] [; falsified if OP VALUE[%]]

    throughput/mfu median over steps 50-199 >= 22.5%
    moe/drop_fraction max <= 1%
    eval/prose/loss last in shared - routed <= -0.01; falsified if >= 0

AGG is one of last (the default), mean, median, min, max, over the logged values in the step
window (both ends included; the whole run when omitted). Without ``in``, the criterion must hold
on every arm's run; ``in A - B`` and ``in A / B`` compare two arms. The falsification threshold is
optional; a value between the two thresholds is "not met (inconclusive)".
"""

from __future__ import annotations

import difflib
import math
import re
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "last": lambda v: v[-1], "mean": statistics.fmean, "median": statistics.median,
    "min": min, "max": max,
}
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b, ">": lambda a, b: a > b,
}
MET, NOT_MET, NO_DATA = "met", "not met", "not enough data"

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_ARM = r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*"
_PATTERN = re.compile(
    rf"^(?P<metric>[A-Za-z0-9_./-]+)"
    rf"(?:\s+(?P<agg>{'|'.join(AGGREGATIONS)}))?"
    rf"(?:\s+over\s+steps\s+(?P<a>\d+)\s*-\s*(?P<b>\d+))?"
    rf"(?:\s+in\s+(?P<arm>{_ARM})(?:\s+(?P<combine>[-/])\s+(?P<arm2>{_ARM}))?)?"
    rf"\s*(?P<op><=|>=|<|>)\s*(?P<value>{_NUM})(?P<pct>%)?"
    rf"(?:\s*;\s*falsified\s+if\s*(?P<fop><=|>=|<|>)\s*(?P<fvalue>{_NUM})(?P<fpct>%)?)?\s*$")


@dataclass(frozen=True)
class Threshold:
    op: str
    value: float  # as a fraction when percent (22.5% -> 0.225)
    percent: bool = False

    def holds(self, x: float) -> bool:
        return OPERATORS[self.op](x, self.value)

    def __str__(self) -> str:
        return f"{self.op} {fmt_value(self.value, self.percent)}"


@dataclass(frozen=True)
class Criterion:
    metric: str
    success: Threshold
    agg: str = "last"
    window: tuple[int, int] | None = None
    arms: tuple[str, ...] = ()
    combine: str | None = None  # "-" or "/" between two arms
    falsify: Threshold | None = None

    def subject(self) -> str:
        """What is measured, without the thresholds (used as a label)."""
        s = f"{self.metric} {self.agg}"
        if self.window:
            s += f" over steps {self.window[0]}-{self.window[1]}"
        if self.arms:
            s += " in " + f" {self.combine} ".join(self.arms)
        return s

    def __str__(self) -> str:
        s = f"{self.subject()} {self.success}"
        return s + (f"; falsified if {self.falsify}" if self.falsify else "")


def fmt_value(x: float, percent: bool = False) -> str:
    if percent:
        return f"{100 * x:.4g}%"
    return f"{x:.4g}"


def _threshold(op: str, value: str, pct: str | None) -> Threshold:
    v = float(value)
    return Threshold(op, v / 100 if pct else v, bool(pct))


# the grammar's parts in order (required ones marked): where a criterion stops matching them
# is the word an error names
_PARTS = ((r"[A-Za-z0-9_./-]+", True), (rf"(?:{'|'.join(AGGREGATIONS)})\b", False),
          (r"over\s+steps\s+\d+\s*-\s*\d+", False),
          (rf"in\s+{_ARM}(?:\s+[-/]\s+{_ARM})?", False),
          (rf"(?:<=|>=|<|>)\s*{_NUM}%?", True),
          (rf";\s*falsified\s+if\s*(?:<=|>=|<|>)\s*{_NUM}%?", False))
# the metric families a run's metrics.jsonl holds (eval/loss: the ladder's mean held-out loss),
# and the names each logs, last part (eval/DOMAIN/loss, moe/layer_I/drop_fraction); a test
# checks a trained run's log against them
METRIC_NAMES = {
    "train": ("loss", "total_loss", "aux_loss", "z_loss", "router_z_loss", "grad_norm", "lr",
              "tokens"),
    "eval": ("loss", "bpb"),
    "throughput": ("tokens_per_s", "mfu", "share_of_measured_peak"),
    "moe": ("drop_fraction", "sender_drop_fraction", "receiver_drop_fraction", "late_fraction",
            "load_max_over_mean", "routing_entropy"),
    "hw": ("cpu_percent", "mem_percent", "process_rss_gb", "accel_util_percent",
           "accel_mem_gb", "accel_mem_percent"),
    "data": ("seq_len",),
}
METRIC_FAMILIES = tuple(METRIC_NAMES)


def _stuck_at(text: str) -> str:
    """The first word of ``text`` the grammar's parts do not match, quoted, or "its end"."""
    pos = 0
    for part, required in _PARTS:
        m = re.compile(r"\s*" + part).match(text, pos)
        if m:
            pos = m.end()
        elif required:
            break
    rest = text[pos:].split()
    return repr(" ".join(rest[:2]) if rest[:1] == [";"] else rest[0]) if rest else "its end"


def check_metric_family(c: Criterion, text: str) -> None:
    """Refuse a criterion on a metric no run logs (a typo such as trian/loss would be
    pre-registered and then never have data)."""
    family = c.metric.split("/")[0]
    if "/" not in c.metric or family not in METRIC_FAMILIES:
        near = difflib.get_close_matches(family, METRIC_FAMILIES, n=1)
        raise ValueError(f"criterion {text!r}: {c.metric!r} is no metric a run logs"
                         + (f" (did you mean {near[0]}/...?)" if near else "")
                         + f"; metrics are FAMILY/NAME, families {', '.join(METRIC_FAMILIES)} "
                         "(the keys of a run's metrics.jsonl)")
    name = c.metric.rsplit("/", 1)[1]
    if name not in METRIC_NAMES[family]:
        near = difflib.get_close_matches(name, METRIC_NAMES[family], n=1)
        raise ValueError(f"criterion {text!r}: no run logs a {family}/ metric named {name!r}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; {family}/ holds {', '.join(METRIC_NAMES[family])}")


def check_arms(c: Criterion, text: str) -> None:
    """Refuse ``in A - A`` (or ``A / A``): an arm against itself gives 0 (or 1) whatever its
    runs log, so a pre-registered typo would decide the criterion before any run."""
    if len(c.arms) == 2 and c.arms[0] == c.arms[1]:
        raise ValueError(f"criterion {text!r}: compares arm {c.arms[0]!r} with itself, which "
                         f"gives {0 if c.combine == '-' else 1} whatever its runs log; name two "
                         "different arms")


def parse_criterion(text: str) -> Criterion:
    """Parse one criterion; ValueError says what is wrong and shows the grammar."""
    m = _PATTERN.match(text.strip())
    if not m:
        raise ValueError(f"criterion {text!r}: not understood at {_stuck_at(text.strip())}; "
                         "write METRIC [AGG] [over steps A-B] "
                         "[in ARM [- ARM | / ARM]] OP VALUE[%] [; falsified if OP VALUE[%]], e.g. "
                         "'throughput/mfu median over steps 50-199 >= 22.5%' (AGG: "
                         f"{', '.join(AGGREGATIONS)}; OP: {', '.join(OPERATORS)})")
    g = m.groupdict()
    window = (int(g["a"]), int(g["b"])) if g["a"] is not None else None
    if window and window[0] > window[1]:
        raise ValueError(f"criterion {text!r}: step window {window[0]}-{window[1]} is empty; "
                         "write the first step first")
    arms = tuple(a for a in (g["arm"], g["arm2"]) if a)
    success = _threshold(g["op"], g["value"], g["pct"])
    falsify = _threshold(g["fop"], g["fvalue"], g["fpct"]) if g["fop"] else None
    if falsify and _overlap(success, falsify):
        raise ValueError(f"criterion {text!r}: a value can meet both '{success}' and "
                         f"'falsified if {falsify}'; the falsification threshold must lie on the "
                         "other side of the success threshold")
    return Criterion(g["metric"], success, g["agg"] or "last", window, arms, g["combine"], falsify)


def _overlap(a: Threshold, b: Threshold) -> bool:
    """Whether some value satisfies both thresholds (they are half-lines)."""
    if (a.op[0] == "<") == (b.op[0] == "<"):
        return True
    up, low = (a, b) if a.op[0] == "<" else (b, a)
    if low.value < up.value:
        return True
    return low.value == up.value and up.op == "<=" and low.op == ">="


@dataclass(frozen=True)
class Verdict:
    status: str  # MET, NOT_MET or NO_DATA
    value: float | None  # the measured number the thresholds were applied to
    detail: str  # how it was measured, or why there is not enough data
    falsified: bool | None = None  # None: the criterion has no falsification threshold
    short_run: bool = False  # rests on a run with fewer steps than the record's minimum
    runs: tuple[str, ...] = ()  # arms whose runs it used

    def label(self) -> str:
        if self.status != NOT_MET:
            return self.status
        if self.falsified is None:
            return NOT_MET
        return "not met (falsified)" if self.falsified else "not met (inconclusive)"


def count_labels(labels) -> str:
    """'3 met, 1 not met (falsified)': verdict labels counted, met first, missing data last."""
    ordered = sorted(labels, key=lambda x: (x != MET, x == NO_DATA, x))
    return ", ".join(f"{ordered.count(x)} {x}" for x in dict.fromkeys(ordered))


@dataclass(frozen=True)
class ArmRun:
    """What a criterion needs from one arm's run: (step, value) series and the last step."""
    arm: str
    last_step: int
    series: Callable[[str], list[tuple[int, float]]]
    keys: Callable[[], set[str]] | None = None  # every metric the run logged, to name a typo


def _aggregate(c: Criterion, run: ArmRun) -> tuple[float | None, str]:
    """(aggregated value, how) or (None, why there is not enough data)."""
    points = run.series(c.metric)
    if c.window:
        a, b = c.window
        if run.last_step < b:
            return None, f"{run.arm} reached step {run.last_step}, the window ends at {b}"
        points = [(s, v) for s, v in points if a <= s <= b]
    if not points:
        where = f" in steps {c.window[0]}-{c.window[1]}" if c.window else ""
        # a mistyped metric (eval/los) passes `lab new` and would read as missing data forever
        logged = run.keys() if run.keys is not None else set()
        near = [] if c.metric in logged else difflib.get_close_matches(c.metric, logged, 1, .85)
        hint = f" (it logs {near[0]}: a typo in the criterion?)" if near else ""
        return None, f"{run.arm} logged no {c.metric}{where}{hint}"
    value = AGGREGATIONS[c.agg]([v for _, v in points])
    shown = fmt_value(value, c.success.percent)
    return value, f"{run.arm}: {c.agg} of {len(points)} value{'s' * (len(points) != 1)} = {shown}"


def _no_data_why(missing: Sequence[str], arms: Sequence[str]) -> str:
    """Why the ``missing`` arms give no data: no usable run, or (for an arm none of the record's
    ``arms`` is: a typo in the criterion reads as missing data forever) no run attached."""
    absent = [a for a in missing if arms and a not in arms]
    unusable = [a for a in missing if a not in absent]
    why = [f"no usable run for arm {', '.join(unusable)}"] if unusable else []
    if absent:
        near = [m for a in absent for m in difflib.get_close_matches(a, arms, 1, 0.6)]
        why.append(f"no run is attached as arm {', '.join(absent)} (the record's arms: "
                   f"{', '.join(arms)}{f'; a typo for {near[0]!r}?' if near else ''}): attach "
                   f"one with --arm {absent[0]}, or correct the criterion")
    return "; ".join(why)


def evaluate(c: Criterion, runs: Sequence[ArmRun], min_steps: int = 0,
             arms: Sequence[str] = ()) -> Verdict:
    """The verdict of ``c`` on one usable run per arm (``runs``); see the module docstring.
    ``arms``: every arm the record names (its attached runs'): a criterion without ``in`` must
    hold on each, so one of them without a usable run leaves it without enough data."""
    by_arm = {r.arm: r for r in runs}
    missing = [a for a in (c.arms or arms) if a not in by_arm]
    if missing or not runs:
        why = _no_data_why(missing, arms) if missing else "no usable runs"
        return Verdict(NO_DATA, None, why)
    used = [by_arm[a] for a in c.arms] if c.arms else list(runs)
    short = bool(min_steps) and any(r.last_step < min_steps for r in used)
    names = tuple(r.arm for r in used)
    values, notes = [], []
    for r in used:
        v, note = _aggregate(c, r)
        if v is None:
            return Verdict(NO_DATA, None, note, short_run=short, runs=names)
        values.append(v)
        notes.append(note)
    if c.combine:
        if c.combine == "/" and values[1] == 0:
            return Verdict(NO_DATA, None, f"{names[1]} is 0: the ratio is undefined",
                           short_run=short, runs=names)
        value = values[0] - values[1] if c.combine == "-" else values[0] / values[1]
        notes.append(f"{names[0]} {c.combine} {names[1]} = {fmt_value(value, c.success.percent)}")
        values = [value]
    # Without arms every run must pass; the reported value is the worst one for the threshold.
    worst = max(values) if c.success.op[0] == "<" else min(values)
    if not all(math.isfinite(v) for v in values):
        return Verdict(NOT_MET, worst, "; ".join(notes) + " (not finite)", None, short, names)
    met = all(c.success.holds(v) for v in values)
    falsified = None if c.falsify is None else (not met and any(c.falsify.holds(v) for v in values))
    return Verdict(MET if met else NOT_MET, worst, "; ".join(notes), falsified, short, names)
