"""The ladder plan as text: the table `moelab ladder plan` prints and its notes (runs left
out, rungs raised to the minimum steps, rungs that warm up too briefly)."""

from __future__ import annotations

import math

from moelab.config import RunConfig
from moelab.ladder.plan import LadderRule, Rung, run_stats


def format_ladder_plan(target_name: str, target: RunConfig, rungs: list[Rung],
                       rule: LadderRule = LadderRule(), left_out: list[str] = ()) -> str:
    """The plan as a table: parameters, tokens, FLOPs, cost share per rung and in total; then
    the runs ``left_out`` (plan_ladder's) and notes."""
    t = run_stats(target)
    rows = [(r.name, r.stats, r.cfg.optim.lr) for r in rungs]
    rows.append((f"target {target_name}", {**t, "share": 1.0}, target.optim.lr))
    head = (f"{'rung':<22} {'layers':>6} {'heads':>5} {'total':>10} {'active':>10} "
            f"{'tokens':>10} {'steps':>8} {'FLOPs':>10} {'% target':>9} {'peak LR':>9}")
    lines = [head, "-" * len(head)]
    for name, s, lr in rows:
        lines.append(f"{name:<22} {s['n_layers']:>6} {s['n_heads']:>5} {_si(s['params_total']):>10}"
                     f" {_si(s['params_active']):>10} {_si(s['tokens']):>10} {s['steps']:>8,}"
                     f" {s['flops']:>10.3g} {100 * s['share']:>8.3f}% {lr:>9.3g}")
    share = sum(r.stats["share"] for r in rungs)
    per_active = t["tokens"] / t["params_active"]
    lines.append(f"ladder cost: {100 * share:.3f}% of the target's training FLOPs "
                 f"({sum(r.stats['flops'] for r in rungs):.3g} of {t['flops']:.3g}); "
                 f"tokens per active parameter {_ratio(per_active)}")
    cap = ("the target itself" if rule.max_run_share >= 1 else
           f"{rule.max_run_share:g} of the target's FLOPs (--max-run-share)")
    notes = [left_out and f"note: left out as costing more than {cap}: {', '.join(left_out)} "
             "(each its FLOPs against the target's)", min_steps_note(rungs, per_active),
             warmup_note(rungs, target.schedule_steps, bool(rule.widths))]
    return "\n".join(lines + [n for n in notes if n])


def min_steps_note(rungs: list[Rung], per_active: float) -> str | None:
    """A note naming the rungs raised to the ladder's minimum steps (their tokens per active
    parameter above what their multiplier asks), or None."""
    raised = [r for r in rungs if r.stats.get("raised") and r.stats["replicate"] == 0]
    if not raised:
        return None
    ratios = ", ".join(f"{r.stats['tokens'] / r.stats['params_active']:.3g}" for r in raised)
    return (f"note: {len(raised)} rung(s) ({', '.join(r.name for r in raised)}) train the "
            f"minimum of {raised[0].cfg.train.steps} steps, more than their tokens per active "
            f"parameter ask ({ratios} against the target's {_ratio(per_active)} x their "
            "multiplier): the fit sees them where they are; a smaller --batch-size or a target "
            "that trains longer gives them their ratio")


def warmup_note(rungs: list[Rung], schedule_steps: int = 0,
                widths_given: bool = False) -> str | None:
    """A note naming the rungs whose warmup is shorter than Adam's second-moment horizon
    1 / (1 - b2) steps: their first full-LR steps use unsettled moment estimates, and the end
    loss then varies with the seed (1.1% seed sd at 4 warmup steps, 0.4% at 40, measured in
    examples/lab/0003-ladder-design-1-warmup-10-one-lr.md). None when all warm up long enough.
    ``schedule_steps``: the target's schedule, to name the warmup that would do; with
    ``widths_given`` (--widths), --top-share lengthens no rung and is not suggested."""
    short = [r for r in rungs if r.stats["replicate"] == 0
             and r.cfg.optim.warmup_steps < 1 / (1 - r.cfg.optim.b2)]
    if not short:
        return None
    horizon = 1 / (1 - short[0].cfg.optim.b2)
    steps = sorted({r.cfg.optim.warmup_steps for r in short})
    need = math.ceil(100 * horizon / min(r.cfg.train.steps for r in short))  # % that would do
    fix = (f"optim.warmup_steps={math.ceil(need / 100 * schedule_steps)} ({need}% of the "
           f"target's steps; rungs keep the fraction) gives every rung {horizon:.0f}"
           if need <= 50 and schedule_steps else
           f"{need}% of the target's steps as warmup (optim.warmup_steps; rungs keep the "
           f"fraction) gives every rung {horizon:.0f}" if need <= 50 else
           f"the shortest would need {need}% of its steps: plan longer rungs ("
           + ("wider --widths, a larger token multiplier or a smaller --batch-size)"
              if widths_given else "a larger --top-share or token multiplier)"))
    return (f"note: {len(short)} rung(s) ({', '.join(r.name for r in short)}) warm up over "
            f"{steps[0]}" + (f"-{steps[-1]}" if len(steps) > 1 else "") + " step(s), fewer than "
            f"Adam's second-moment horizon 1 / (1 - b2) = {horizon:.0f}; their losses carry more "
            f"seed noise; {fix}")


def _ratio(x: float) -> str:
    """Tokens per parameter to one decimal, or 3 significant digits below 1 (not 0.0)."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.3g}"


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"
