"""The curves shown for a set of runs, as plain data: the report draws them with matplotlib,
the live page with a canvas script. One list of charts serves both, so they always agree."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from moelab.lab.runs import USABLE, RunData, band_for, names_metric, newest_usable

# Run colours (matplotlib's tab10); the live page uses the same ones.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")
ALERT_COLOR = "#d62728"


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    keys: tuple[str, ...]  # metric keys; '*' patterns allowed (one line per matching key)
    ylabel: str = ""
    percent: bool = False  # values are fractions, shown as %
    log_y: bool = False
    panels: bool = False  # in reports, one small plot per matched key (per domain)


CHARTS = (
    Chart("loss", "Training loss", ("train/loss",), "nats/token"),
    Chart("eval_loss", "Held-out loss, mean over domains", ("eval/loss",), "nats/token"),
    Chart("heldout", "Held-out loss by domain", ("eval/*/loss",), "nats/token", panels=True),
    Chart("grad_norm", "Gradient norm", ("train/grad_norm",), "global L2 norm", log_y=True),
    Chart("drops", "Dropped token-expert assignments", ("moe/drop_fraction",
          "moe/sender_drop_fraction", "moe/receiver_drop_fraction"), "% of assignments", True),
    Chart("lr", "Learning rate", ("train/lr",), "LR"),
    Chart("throughput", "Throughput", ("throughput/tokens_per_s",), "tokens/s"),
    Chart("mfu", "Model FLOPs utilisation", ("throughput/mfu",), "% of peak", True),
    Chart("hardware", "Hardware use (whole machine)", ("hw/cpu_percent", "hw/mem_percent",
          "hw/accel_util_percent", "hw/accel_mem_percent"), "% of capacity"),
)
LINE_NAMES = {"hw/cpu_percent": "CPU", "hw/mem_percent": "memory",
              "hw/accel_util_percent": "accelerator", "hw/accel_mem_percent": "accel. memory"}
# A log axis only where values span this factor or more (grad norm over a long run).
LOG_SPAN = 20.0


def _short(chart: Chart, key: str) -> str:
    """The part of a key that tells lines of one chart apart ("prose" in eval/prose/loss)."""
    if "*" in chart.keys[0]:
        return key.split("/")[1]
    return LINE_NAMES.get(key) or key.split("/")[-1].replace("_fraction", "")


def _keys(chart: Chart, available: set[str]) -> list[str]:
    out = []
    for pattern in chart.keys:
        out += sorted(k for k in available if fnmatch.fnmatchcase(k, pattern) and k not in out)
    return out


def _finite(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in points if math.isfinite(v)]


def chart_data(runs: list[RunData]) -> list[dict]:
    """For each chart with data: its series (one per run and key), prediction bands and alerts.

    Secondary keys that stay at zero in every run (sender/receiver drops on one device) are left
    out, so a chart shows what carries information."""
    current = {id(r) for r in newest_usable(runs).values()}
    out = []
    for chart in CHARTS:
        series, bands, alerts = [], [], []
        for i, run in enumerate(runs):
            color = COLORS[i % len(COLORS)]
            keys = _keys(chart, run.keys())
            for j, key in enumerate(keys):
                pts = _finite(run.series(key))
                if not pts or (j > 0 and len(chart.keys) > 1 and not any(v for _, v in pts)):
                    continue
                panel = _short(chart, key) if chart.panels else None
                series.append({"run": i, "name": run.name, "key": key, "label": run.name,
                               "color": color, "dash": j, "status": run.status, "panel": panel,
                               # an arm's older run, replaced in the verdicts by a rerun
                               "superseded": run.status in USABLE and id(run) not in current,
                               "usable": run.status in USABLE, "x": [s for s, _ in pts],
                               "y": [v for _, v in pts]})
                band = band_for(run.prediction, key)
                if band:
                    source = run.prediction.get("source", "prediction")
                    bands.append({"run": i, "key": key, "color": color, "x": band["step"],
                                  "panel": panel,
                                  "label": f"{run.name} predicted ({source})", "lo": band["lo"],
                                  "hi": band["hi"], "mid": band.get("mid")})
                alerts += [{"run": i, "name": run.name, "x": a["step"], "y": a.get("observed")}
                           for a in run.alerts() if names_metric(str(a.get("metric")), key)]
        if len({s["key"] for s in series}) > 1:  # several metrics: say which line is which
            for s in series:
                s["label"] = f"{s['name']} {_short(chart, s['key'])}"
        values = [v for s in series for v in s["y"]] + [v for b in bands for v in b["lo"]]
        log_y = (chart.log_y and bool(values) and min(values) > 0
                 and max(values) / min(values) >= LOG_SPAN)
        if series:
            out.append({"id": chart.id, "title": chart.title, "ylabel": chart.ylabel,
                        "percent": chart.percent, "log_y": log_y, "series": series,
                        "bands": bands, "alerts": alerts})
    return out
