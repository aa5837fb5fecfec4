"""One PNG of the ladder: the rungs and their fit, L(C), and the target predicted vs observed."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from moelab.ladder.fit import LadderFit, final_value, prediction_steps
from moelab.ladder.observe import EVAL_LOSS, binned, rolling_median, series
from moelab.ladder.schedule_law import RunSchedule
from moelab.util import atomic_write_bytes


def _band(ax, m: dict, x_scale: float, color: str, label: str) -> None:
    x = np.asarray(m["step"]) * x_scale
    if "lo" in m:
        ax.fill_between(x, m["lo"], m["hi"], color=color, alpha=0.25, lw=0,
                        label=f"{label} band")
    ax.plot(x, m["mid"], color=color, lw=1.5, ls="--", label=f"{label} predicted")


def plot_ladder(fit: LadderFit, pred: dict, target_cfg, out: Path | str,
                target_records: list[dict] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(fit.rungs)))
    tps_target = target_cfg.data.seq_len * target_cfg.data.batch_size

    ax = axes[0, 0]  # rungs' held-out loss, the law through them, the target's predicted band
    sf = fit.schedule[EVAL_LOSS]
    for r, col in zip(fit.rungs, colors):
        steps, vals = series(r.records, EVAL_LOSS)
        tps = r.cfg.data.seq_len * r.cfg.data.batch_size
        ax.plot(steps * tps, vals, "o", color=col, ms=4, label=r.name)
        at = prediction_steps(r.cfg.train.steps, 100)
        at = at[at >= 0.05 * r.cfg.train.steps]
        ax.plot(at * tps, sf.predict(RunSchedule.from_config(r.cfg), at)["mid"], color=col,
                lw=1)
    _band(ax, pred["metrics"][EVAL_LOSS], tps_target, "tab:red", "target")
    if target_records:
        steps, vals = series(target_records, EVAL_LOSS)
        ax.plot(steps * tps_target, vals, "s", color="tab:red", ms=5, label="target observed")
    ax.set(xscale="log", xlabel="tokens", ylabel="held-out loss (nats/token)",
           title="rungs, the chosen law, target prediction")
    ax.legend(fontsize=7)

    ax = axes[0, 1]  # final loss against compute
    flops = np.exp(fit.log_flops)
    finals = [final_value(r.records, EVAL_LOSS, r.cfg.train.steps) for r in fit.rungs]
    ax.plot(flops, finals, "ko", label="rungs (final)")
    c_t = pred["target"]["flops"]
    grid = np.geomspace(flops.min() / 1.5, c_t * 1.5, 100)
    for (name, bf), ls in zip(fit.compute.items(), ("-", ":")):
        ax.plot(grid, bf.fit.predict(grid[:, None]), ls, color="gray",
                label=f"L(C), {name.replace('_', ' ')}")
    fin = pred["final"][EVAL_LOSS]
    ax.errorbar([c_t], [fin["mid"]], yerr=[[fin["mid"] - fin["lo"]], [fin["hi"] - fin["mid"]]],
                fmt="D", color="tab:red", capsize=4, label="target predicted (chosen law)")
    if target_records:
        obs = final_value(target_records, EVAL_LOSS, target_cfg.train.steps)
        if obs is not None:
            ax.plot([c_t], [obs], "s", color="tab:blue", ms=7, label="target observed")
    ax.set(xscale="log", xlabel="training FLOPs", ylabel="final held-out loss",
           title="loss vs compute")
    ax.legend(fontsize=7)

    for ax, key, title in ((axes[1, 0], "train/loss", "target training loss"),
                           (axes[1, 1], "train/grad_norm", "target gradient norm")):
        if key in pred["metrics"]:
            _band(ax, pred["metrics"][key], 1.0, "tab:red", "")
        if target_records:
            steps, vals = series(target_records, key)
            if key == "train/loss":
                at, mean = binned(steps, vals, target_cfg.train.steps, 40)
                ax.plot(steps, rolling_median(vals, 5), color="tab:blue", lw=0.5, alpha=0.4)
                ax.plot(at, mean, "-", color="tab:blue", lw=1.5, label="observed (binned mean)")
            else:
                ax.plot(steps, rolling_median(vals, 5), color="tab:blue", lw=1,
                        label="observed (median of 5)")
        ax.set(xlabel="step", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out
