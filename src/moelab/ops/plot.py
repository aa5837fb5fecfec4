"""Figures of run operations: a replan's LR before/after, and runs with their branches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moelab.config import RunConfig, load_run_config
from moelab.config.errors import require
from moelab.run.logs import read_metrics
from moelab.train.changes import logged_lr
from moelab.util import check_output_file, open_atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def lr_by_tokens(cfg: RunConfig, *steps: int) -> tuple[list[int], np.ndarray]:
    """(tokens, LR) of a config's plan at ~600 steps (plus ``steps``), for plotting."""
    grid = np.unique(np.r_[np.linspace(0, cfg.train.steps, 600).round(), steps].astype(int))
    return [cfg.data.tokens_before(int(s)) for s in grid], logged_lr(cfg, grid)


def plot_file(given: str | None, default: Path) -> Path:
    """Where ``--plot`` saves the figure, checked before any work: a name without a suffix gets
    ``.png`` (matplotlib's own choice, so the path said is the one written); a folder, a format
    matplotlib cannot write or a place this user cannot write is refused."""
    from matplotlib.backend_bases import FigureCanvasBase

    if given is None:
        return default
    path = Path(given)
    require(not path.is_dir(), f"--plot {given}", f"a folder; name a file in it, e.g. "
            f"{path / default.name}")
    path = path if path.suffix else path.with_name(path.name + ".png")
    kinds = FigureCanvasBase.get_supported_filetypes()
    require(path.suffix[1:].lower() in kinds, f"--plot {given}", "not an image format "
            f"matplotlib writes; end the name with one of .{', .'.join(sorted(kinds))}")
    check_output_file(path, "--plot")
    return path


def plot_replan(before: RunConfig, after: RunConfig, at: int, path: Path | str) -> Path:
    """LR against tokens for the plan now and the plan after the replan."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for cfg, label, style in ((before, "now", "--"), (after, "after replan", "-")):
        ax.plot(*lr_by_tokens(cfg, at), style, label=f"{label} (end step {cfg.train.steps})")
    ax.axvline(after.data.tokens_before(at), color="grey", lw=0.8,
               label=f"takes effect (step {at})")
    ax.set(xlabel="tokens", ylabel="learning rate", title="moelab replan")
    ax.legend()
    fig.tight_layout()
    with open_atomic(path, "wb") as f:  # an interrupted save leaves the old plot, or none
        fig.savefig(f, dpi=120, format=Path(path).suffix[1:].lower() or "png")
    plt.close(fig)
    return Path(path)


def run_curves(run_dir: Path | str) -> dict[str, np.ndarray]:
    """step, tokens, lr, loss, seq_len of a run's logged training steps."""
    recs = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl")[0] if "train/loss" in r]
    cfg = load_run_config(run_dir)
    steps = np.array([r["step"] for r in recs])
    return {"step": steps, "tokens": np.array([cfg.data.tokens_before(int(s)) for s in steps]),
            "lr": np.array([r["train/lr"] for r in recs]),
            "loss": np.array([r["train/loss"] for r in recs]),
            "seq_len": np.array([r.get("data/seq_len", cfg.data.seq_len) for r in recs])}


def plot_runs(runs: dict[str, Path | str], path: Path | str, *, marks: dict[str, int] | None = None,
              plans: dict[str, RunConfig] | None = None, smooth: int = 9) -> Path:
    """LR and training loss against tokens for each run (label -> run folder); ``plans`` adds
    dashed LR curves of configs (e.g. the plan before a replan); ``marks`` draws labelled
    vertical lines at steps of the first run (replan, branch point)."""
    plt = _pyplot()
    fig, (ax_lr, ax_loss) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for label, cfg in (plans or {}).items():
        ax_lr.plot(*lr_by_tokens(cfg), "--", color="grey", lw=1, label=label)
    first = None
    for label, run in runs.items():
        c = run_curves(run)
        first = first or c
        ax_lr.plot(c["tokens"], c["lr"], label=label)
        k = min(smooth, len(c["loss"]))
        loss = np.convolve(c["loss"], np.ones(k) / k, mode="valid") if k > 1 else c["loss"]
        ax_loss.plot(c["tokens"][k - 1:], loss, label=f"{label} (mean of {k} steps)")
    for name, step in (marks or {}).items():
        tokens = np.interp(step, first["step"], first["tokens"])
        for ax in (ax_lr, ax_loss):
            ax.axvline(tokens, color="grey", lw=0.8, ls=":")
        ax_lr.annotate(name, (tokens, ax_lr.get_ylim()[1]), fontsize=8, va="top", rotation=90)
    ax_lr.set(ylabel="learning rate")
    ax_loss.set(xlabel="tokens", ylabel="training loss")
    ax_lr.legend(fontsize=8, loc="lower left")
    ax_loss.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
