"""PNG plots of ``charts.chart_data`` for reports (matplotlib, no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

from moelab.lab.charts import ALERT_COLOR
from moelab.util import atomic_write_bytes

DASHES = ("-", "--", ":", "-.")


def _ylim(chart: dict, series: list[dict], scale: float) -> tuple[float, float] | None:
    """Limits from the runs that finished or are running, so that a run that blew up does not
    flatten everyone else's curve (its points may leave the axes; the report lists it).
    Non-negative percentages start at 0, so that "no drops" reads as a line on the floor."""
    values = [v * scale for s in series for v in s["y"]]
    good = [v * scale for s in series if s["usable"] for v in s["y"]]
    if chart["percent"] and values and min(values) >= 0:
        top = max(max(values) * 1.1, 1.0)
        return -0.03 * top, top  # a little room below 0, so a line at 0 is not hidden
    if not good or all(s["usable"] for s in series):
        return None
    lo, hi = min(good), max(good)
    pad = 0.08 * (hi - lo or abs(hi) or 1.0)
    return (lo / 1.5, hi * 1.5) if chart["log_y"] and lo > 0 else (lo - pad, hi + pad)


def _draw(ax, chart: dict, series: list[dict], bands: list[dict], alerts: list[dict]) -> None:
    from matplotlib.ticker import MaxNLocator

    scale = 100.0 if chart["percent"] else 1.0
    for b in bands:
        ax.fill_between(b["x"], [v * scale for v in b["lo"]], [v * scale for v in b["hi"]],
                        color=b["color"], alpha=0.15, lw=0, label=b["label"])
        if b.get("mid"):
            ax.plot(b["x"], [v * scale for v in b["mid"]], color=b["color"], lw=0.8, ls=":")
    lim = _ylim(chart, series, scale)
    for s in series:
        ys = [v * scale for v in s["y"]]
        off = lim is not None and not s["usable"] and any(not lim[0] <= v <= lim[1] for v in ys)
        note = "" if s["usable"] else f" ({s['status']}{', off scale' if off else ''})"
        if s["superseded"]:  # thin and on top, so that it shows even where a rerun matches it
            ax.plot(s["x"], ys, color=s["color"], lw=1.2, ls=":", zorder=4,
                    label=s["label"] + " (superseded)")
            continue
        ax.plot(s["x"], ys, color=s["color"], lw=1.6, ls=DASHES[s["dash"] % len(DASHES)],
                marker="o" if len(s["x"]) <= 12 else None, ms=3.5, label=s["label"] + note)
    points = [(a["x"], a["y"] * scale) for a in alerts if isinstance(a["y"], (int, float))]
    if points:
        ax.scatter(*zip(*points), marker="x", s=40, color=ALERT_COLOR, zorder=5, label="alert")
    if chart["log_y"]:
        ax.set_yscale("log")
    if lim is not None:
        ax.set_ylim(*lim)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def plot_chart(chart: dict, path: Path) -> None:
    """One chart; a chart with panels (held-out loss by domain) gets one small plot per panel,
    runs in their colours, so arms are compared within a domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(s["panel"] for s in chart["series"] if s.get("panel")))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 2.6 * len(panels)), 3.2),
                                 dpi=120, squeeze=False)
        for ax, panel in zip(axes[0], panels):
            series = [{**s, "dash": 0, "label": s["name"]} for s in chart["series"]
                      if s["panel"] == panel]
            _draw(ax, chart, series, [b for b in chart["bands"] if b.get("panel") == panel], [])
            ax.set_title(panel, fontsize=10)
        axes[0][0].set_ylabel(chart["ylabel"])
        axes[0][-1].legend(fontsize=8, frameon=False)
        fig.suptitle(chart["title"], fontsize=11, x=0.01, ha="left")
    else:
        n_lines = len(chart["series"]) + len(chart["bands"]) + bool(chart["alerts"])
        wide = n_lines > 5  # many lines: the legend goes beside the plot, not over the curves
        fig, ax = plt.subplots(figsize=(9.5 if wide else 7.5, 3.6), dpi=120)
        _draw(ax, chart, chart["series"], chart["bands"], chart["alerts"])
        ax.set_title(chart["title"], fontsize=11, loc="left")
        ax.set_ylabel(chart["ylabel"])
        if wide:
            ax.legend(fontsize=7.5, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def plot_charts(charts: list[dict], out_dir: Path) -> list[tuple[str, str]]:
    """One PNG per chart in ``out_dir``; returns (title, file name) pairs in chart order."""
    out = []
    for chart in charts:
        name = f"{chart['id']}.png"
        plot_chart(chart, out_dir / name)
        out.append((chart["title"], name))
    return out
