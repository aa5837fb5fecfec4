"""`moelab ladder plan | run | fit | guard`: the scaling-ladder workflow on the command line."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from moelab.config.errors import ConfigError, require

EPILOG = ("Typical use: `moelab ladder plan TARGET --out runs/ladder`, `moelab ladder run "
          "runs/ladder`, `moelab ladder fit runs/ladder`, then train the target (`moelab ladder "
          "run runs/ladder --target --guard`) or guard any run: `moelab ladder guard RUN "
          "--prediction runs/ladder/prediction.json`; `moelab ladder forecast RUN --ladder "
          "runs/ladder` forecasts its final loss, `moelab ladder compare A B` the compute "
          "multiplier of one ladder over another.")


def _list_of(kind, what: str, example: str):
    """An argparse type for comma-separated values of ``kind``."""
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected comma-separated {what}, e.g. {example}") from None
    return parse


_ints = _list_of(int, "integers", "768,1024,1536,2048")
_floats = _list_of(float, "numbers", "0.5,1")


def cmd_plan(args) -> int:
    from moelab.config import load_config, split_overrides
    from moelab.data.prepare import with_tokenizer_vocab
    from moelab.ladder.folder import check_out, write_ladder
    from moelab.ladder.plan import LadderRule, plan_ladder
    from moelab.ladder.plan_text import format_ladder_plan

    if args.config is None or "=" in args.config:  # no default: tiny's rungs share one width
        raise ConfigError("ladder plan: give the TARGET config first, a preset or YAML (e.g. "
                          "`moelab ladder plan 535b-a23b`); a small target such as tiny needs "
                          "--widths, since its rungs at --top-share of its compute would share "
                          "one width")
    source, overrides = split_overrides(args.config, args.overrides)
    # data paths absolute, as each rung's run records them: `ladder run` from another
    # working folder trains on the same data, and fits compare runs by it
    target = with_tokenizer_vocab(load_config(source, overrides)).with_frozen_schedule()
    target = target.with_absolute_data()
    check_out(args.out)  # a file in the way is refused before the plan is printed
    rungs = args.rungs if args.rungs is not None else len(args.widths or args.depths or ()) or 4
    rule = LadderRule(rungs=rungs, top_share=args.top_share, spacing=args.spacing,
                      depth_exp=args.depth_exp, widths=args.widths or (),
                      depths=args.depths or (), batch_size=args.batch_size, evals=args.evals,
                      token_multipliers=args.token_multipliers or (1.0,), seeds=args.seeds,
                      lr_exp=args.lr_exp, max_run_share=args.max_run_share)
    rungs = plan_ladder(target, rule, left_out := [])  # written, then shown: a refusal alone
    lad = args.out and write_ladder(args.out, Path(source).stem, target, rule, rungs)
    print(format_ladder_plan(Path(source).stem, target, rungs, rule, left_out))
    if lad:
        print(f"ladder written to {lad.root}/ (ladder.json, configs/); next: "
              f"moelab ladder run {lad.root}")
    return 0


def cmd_run(args) -> int:
    from moelab.ladder.folder import load_ladder
    from moelab.ladder.run import run_ladder

    require(math.isfinite(args.poll) and args.poll > 0, f"--poll {args.poll:g}",
            "seconds between progress lines, > 0")
    require(args.target or not args.guard, "--guard", "guards the target: add --target (or "
            "guard any run with `moelab ladder guard RUN`)")
    lad = load_ladder(args.ladder)
    guard = None
    if args.guard:
        from moelab.ladder.guard import GuardRules, guard_run

        rules = GuardRules()

        def guard(run_dir: Path) -> list:  # the trainer writes its log only once it has started
            return guard_run(run_dir, rules=rules) if (run_dir / "metrics.jsonl").exists() else []
    status = run_ladder(lad, jobs=args.jobs, names=args.rung or None, target=args.target,
                        guard=guard, poll_s=args.poll)
    for name, s in status.items():
        print(f"{name:<24} {s}")
    if any(s.startswith("failed") for s in status.values()):
        return 1
    if not args.target and not args.rung:  # every rung finished: what comes next
        print(f"every rung finished; next: moelab ladder fit {lad.root}")
    return 0


def check_fit_options(args) -> None:
    """Bootstrap options, checked before anything is read or fitted."""
    require(args.boot >= 20, f"--boot {args.boot}", "must be >= 20 resamples (fewer cannot "
            "place the ends of a central interval; the default is 200)")
    require(0 < args.level < 1, f"--level {args.level:g}",
            "the central interval's probability, in (0, 1), e.g. 0.9")


def cmd_fit(args) -> int:
    check_fit_options(args)
    if args.points:
        from moelab.ladder.points import fit_points, format_points, parse_predict, read_points

        require(not args.ladder, "--points", "give a LADDER folder or --points, not both")
        if args.predict_run:
            raise ValueError("--predict-run goes with a LADDER folder; with --points, --predict "
                             "N=...,D=...")
        res = fit_points(read_points(args.points), [parse_predict(p) for p in args.predict or []],
                         n_boot=args.boot, level=args.level, seed=args.seed)
        print(json.dumps(res) if args.json else format_points(res))
        return 0
    if not args.ladder:
        raise ValueError("give a LADDER folder (from `moelab ladder plan --out`) or --points "
                         "FILE.csv")
    if args.predict:
        raise ValueError("--predict goes with --points; a ladder predicts its own target (and, "
                         "with --predict-run RUN, other run folders)")
    if args.predict_run and args.target_run:
        raise ValueError("--predict-run leaves every file as it is, --target-run writes one: "
                         "give them in separate calls")
    from moelab.ladder.fit import (
        fit_ladder,
        format_report,
        format_runs,
        load_run_configs,
        predict_runs,
        target_outputs,
        write_outputs,
    )
    from moelab.ladder.folder import load_ladder

    require(not args.target_run or Path(args.target_run).is_dir(),  # else skipped silently
            f"--target-run {args.target_run}", "not a folder; give the target's run folder "
            "(create it first to place the prediction before training)")
    lad = load_ladder(args.ladder)
    runs = load_run_configs(args.predict_run or [], lad.target)  # refused before the fit
    fit = fit_ladder(lad, n_boot=args.boot, level=args.level, seed=args.seed)
    # predicting other runs leaves the ladder's files (and the guard's contract) as they are
    rep, pred = (target_outputs(lad, fit) if runs else
                 write_outputs(lad, fit, Path(args.target_run) if args.target_run else None))
    others = predict_runs(fit, runs)
    if others:
        rep["runs"] = others
    if not args.no_plots and not runs:
        from moelab.ladder.observe import run_records
        from moelab.ladder.plots import plot_ladder

        target_dir = Path(args.target_run) if args.target_run else lad.target_dir
        records = run_records(target_dir)[0] if (target_dir / "metrics.jsonl").exists() else None
        png = plot_ladder(fit, pred, lad.target, lad.root / "plots" / "ladder.png", records)
        rep["plot"] = str(png)
    print(json.dumps(rep) if args.json else format_report(rep))
    if others and not args.json:
        print(format_runs(others, fit.level))
    if not args.json and not runs:
        print(f"written: {lad.root}/fit.json, {lad.root}/prediction.json"
              + "".join(f", {p}" for p in rep["prediction_copies"])
              + (f", {rep['plot']}" if "plot" in rep else ""))
    return 0


def cmd_forecast(args) -> int:
    from moelab.ladder.fit import final_value
    from moelab.ladder.forecast import forecast, format_forecast, load_inputs
    from moelab.ladder.observe import EVAL_LOSS

    require(args.boot >= 20, f"--boot {args.boot}", "must be >= 20 resamples (the run's curve "
            "alone gets its band from them; the default is 100)")
    records, cfg, pred, path = load_inputs(args.run, args.ladder)
    res = forecast(records, cfg, pred, n_boot=args.boot, seed=args.seed)
    res["prediction"] = str(path)
    res["observed"] = final_value(records, EVAL_LOSS, cfg.train.steps)
    print(json.dumps(res) if args.json else format_forecast(args.run, res, res["observed"]))
    return 0


def cmd_compare(args) -> int:
    from moelab.ladder.compare import compare, format_compare, plot_compare, plot_path

    check_fit_options(args)
    for c in args.compute or []:
        require(math.isfinite(c) and c > 0, f"--compute {c:g}", "training FLOPs, > 0, e.g. 1e18")
    out = None if args.no_plots else plot_path(args.ladder_a, args.ladder_b, args.plot)
    rep, sides = compare(args.ladder_a, args.ladder_b, args.compute or (), n_boot=args.boot,
                         level=args.level, seed=args.seed)
    if out:
        rep["plot"] = str(plot_compare(rep, sides, out))
    print(json.dumps(rep) if args.json else format_compare(rep))
    if "plot" in rep and not args.json:
        print(f"plot: {rep['plot']}")
    return 0


def check_guard_options(args) -> None:
    require(math.isfinite(args.loss_tol) and args.loss_tol >= 0, f"--loss-tol {args.loss_tol:g}",
            "a relative tolerance >= 0, e.g. 0.02")
    require(math.isfinite(args.grad_norm_max) and args.grad_norm_max > 0,
            f"--grad-norm-max {args.grad_norm_max:g}", "must be a number > 0, e.g. 4")
    require(math.isfinite(args.interval) and args.interval > 0, f"--interval {args.interval:g}",
            "seconds between checks, > 0")
    require(args.patience >= 1, f"--patience {args.patience}", "must be >= 1 (logged points)")
    require(args.window >= 1, f"--window {args.window}", "must be >= 1 (logged points)")


def _predicts_another(run: str, pred: dict | None, pred_path: Path) -> list[str] | None:
    """How the run ``pred`` was made for differs from ``run`` (empty: alike); None when there
    is nothing to compare (no prediction, or a config that cannot be read: said)."""
    if pred is None or not (Path(run) / "config.yaml").is_file():
        return None
    from moelab.config import load_run_config
    from moelab.ladder.guard import prediction_mismatch

    try:  # the alerts are reported whatever the config says
        return prediction_mismatch(pred, load_run_config(run), run)
    except (OSError, ValueError) as e:  # ConfigError included
        print(f"  warning: {pred_path} not checked against the run's config ({e})")
        return None


def cmd_guard(args) -> int:
    from moelab.ladder.forecast import live_forecast
    from moelab.ladder.guard import (
        GuardRules,
        band_summary,
        follow,
        format_alert,
        guard_run,
        load_prediction,
        prediction_path,
    )

    check_guard_options(args)
    pred_path = prediction_path(args.run, args.prediction)
    if args.strict and not args.prediction:  # strict promises the bands were compared
        require(pred_path.exists(), str(pred_path), "not found, and --strict needs the bands; "
                "make it with `moelab ladder fit LADDER` or pass --prediction FILE")
    rules = GuardRules(loss_tol=args.loss_tol, grad_norm_max=args.grad_norm_max,
                       patience=args.patience, window=args.window)

    def forecast_now(run_dir):  # the live view: the final loss forecast at each new evaluation
        return live_forecast(run_dir, pred_path) if pred_path.exists() else None

    pred = load_prediction(pred_path) if pred_path.exists() else None
    diffs = _predicts_another(args.run, pred, pred_path)
    require(not diffs or args.other_run, str(pred_path), f"predicts another run "
            f"({'; '.join(diffs or [])}): its bands are not this run's, and the alerts they "
            "raised would stay in the run's log; guard a run of that prediction's config, or "
            "add --other-run to check against it anyway (a run replanned since the fit differs "
            "in its steps)")
    if args.follow:
        new = follow(args.run, args.prediction, rules, interval_s=args.interval,
                     on_eval=forecast_now)
    else:
        new = guard_run(args.run, args.prediction, rules)
    from moelab.ladder.observe import run_records

    records, events = run_records(Path(args.run))
    alerts = [e for e in events if e.get("event") == "alert"]
    print(f"{args.run}: {len(new)} new alert(s), {len(alerts)} in its log; "
          f"{band_summary(records, pred, pred_path)}")
    if diffs:
        print(f"  warning: {pred_path} predicts another run ({'; '.join(diffs)}): its bands "
              "may not be this run's (--other-run)")
    for a in alerts:
        print("  " + format_alert(a))
    if pred is not None:
        print(forecast_now(args.run))
    return 3 if alerts and args.strict else 0


def register(subparsers) -> None:
    """Add `moelab ladder ...` to the main parser's subcommands."""
    lp = subparsers.add_parser("ladder", help="scaling ladder: plan, run, fit, guard, "
                               "forecast, compare",
                               description="Plan small rungs from a target, train them, fit "
                               "scaling laws, predict the target, guard its live run and "
                               "forecast its final loss; compare two ladders' compute.",
                               epilog=EPILOG)
    sub = lp.add_subparsers(dest="ladder_command", required=True, metavar="SUBCOMMAND")
    for add in (_add_plan, _add_run, _add_fit, _add_guard, _add_forecast, _add_compare):
        add(sub)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="derive the rungs from a target config",
                       description="Derive K rungs from TARGET: width, depth and heads scale; "
                       "experts, top-k and head_dim stay; expert/latent/shared widths keep their "
                       "ratio to d_model; tokens per active parameter stay the target's. Prints "
                       "parameters, tokens, FLOPs and the ladder's cost share.",
                       epilog="Overrides (SECTION.FIELD=VALUE) after TARGET apply to the target.")
    # '-' and a digit start a value (`--token-multipliers -1,1`), as in Python 3.13's argparse
    p._negative_number_matcher = re.compile(r"^-\.?\d")
    p.add_argument("config", nargs="?", help="the target: preset or YAML, e.g. 535b-a23b")
    p.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides of the target")
    p.add_argument("--rungs", type=int, default=None,
                   help="number of rungs (default: one per --widths value, else 4)")
    p.add_argument("--top-share", type=float, default=1 / 400,
                   help="largest rung's FLOPs as a fraction of the target's (default 0.0025)")
    p.add_argument("--spacing", type=float, default=4.0,
                   help="FLOPs ratio between neighbouring rungs (default 4)")
    p.add_argument("--depth-exp", type=float, default=0.75,
                   help="n_layers = round(L_target * (d / d_target) ** depth_exp) (default 0.75)")
    p.add_argument("--widths", type=_ints, help="explicit rung widths, e.g. 768,1024,1536,2048")
    p.add_argument("--depths", type=_ints, help="explicit rung depths, e.g. 8,12,16,22")
    p.add_argument("--batch-size", type=int, default=0, help="rung batch size (default: target's)")
    p.add_argument("--evals", type=int, default=8,
                   help="held-out evaluations per rung, for the trajectory fit (default 8)")
    p.add_argument("--token-multipliers", type=_floats, metavar="M1,M2",
                   help="train every width once per multiplier of the target's tokens per "
                   "parameter, e.g. 0.5,1: N and D then move apart, so the fit can identify "
                   "both exponents (default: 1)")
    p.add_argument("--max-run-share", type=float, default=1.0, metavar="S",
                   help="leave out the (width, multiplier) runs that would cost more than S of "
                   "the target's FLOPs, e.g. 0.04: narrow widths train long, wide ones short, "
                   "so N and D spread at low cost (default 1: every run)")
    p.add_argument("--seeds", type=int, default=1,
                   help="train every rung this many times with different seeds (train.seed + "
                   "1000 r; rung names gain -s<r>): the fit sees their spread instead of one "
                   "draw of a small run's seed noise (default 1)")
    p.add_argument("--lr-exp", type=float, default=0.0,
                   help="rung peak LR = target LR x (d_target / d) ** LR_EXP: 0 keeps the "
                   "target's LR (default), 1 scales it as 1 / width (Marin's scaling recipe)")
    p.add_argument("--out", help="write the ladder folder here (ladder.json, configs/)")
    p.set_defaults(fn=cmd_plan)


def _add_run(sub) -> None:
    r = sub.add_parser("run", help="train the rungs (resumable; finished rungs are skipped)",
                       description="Train each rung of a planned ladder as an ordinary `moelab "
                       "train` run in LADDER/rungs/<name>/, --jobs at a time: finished rungs "
                       "are skipped, unfinished ones resume. Ctrl-C stops them all with a "
                       "checkpoint each. Then `moelab ladder fit LADDER`.")
    r.add_argument("ladder", help="ladder folder written by `moelab ladder plan --out`")
    r.add_argument("--jobs", type=int, default=1, help="rungs trained at once (default 1)")
    r.add_argument("--rung", action="append", help="train only this rung (repeatable)")
    r.add_argument("--target", action="store_true",
                   help="then train the target into LADDER/target (with the prediction copied "
                   "there when `moelab ladder fit` has made one)")
    r.add_argument("--guard", action="store_true",
                   help="guard the target live against LADDER/prediction.json")
    r.add_argument("--poll", type=float, default=10.0, help="seconds between progress lines")
    r.set_defaults(fn=cmd_run)


def _add_fit_options(p, boot_help: str = "bootstrap resamples (default %(default)s)",
                     boot: int = 200, level: bool = True) -> None:
    """--json, --boot, --level and --seed, as the fitting commands take them."""
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--boot", type=int, default=boot, help=boot_help)
    if level:
        p.add_argument("--level", type=float, default=0.9,
                       help="central interval of the bands (default 0.9)")
    p.add_argument("--seed", type=int, default=0)


def _add_fit(sub) -> None:
    f = sub.add_parser("fit", help="fit scaling laws to the rungs (or to a CSV of runs) and "
                       "predict", description="Candidate laws (Chinchilla, tied exponents, "
                       "Kaplan-style interaction; three objectives, two weightings) are scored by "
                       "leaving the largest compute budgets out; the three best are averaged and "
                       "the band is calibrated on their errors. With LADDER: on the rungs' loss "
                       "curves (schedule-aware features), plus L(C) and bands of grad norm and "
                       "drop fraction; writes fit.json, prediction.json and plots/ladder.png. "
                       "With --points: on a CSV with columns N, D, loss (optional C), predicting "
                       "at --predict points.")
    f.add_argument("ladder", nargs="?", help="ladder folder")
    f.add_argument("--points", help="CSV of external runs: columns N, D, loss[, C]")
    f.add_argument("--predict", action="append", metavar="N=...,D=...",
                   help="with --points: predict the loss here (repeatable)")
    _add_fit_options(f)
    f.add_argument("--target-run", help="also write prediction.json into this run folder")
    f.add_argument("--predict-run", action="append", metavar="RUN",
                   help="with LADDER: also predict this run folder's final held-out loss from "
                        "its config.yaml and compare with its last eval (repeatable); the "
                        "ladder's files are then left as they are")
    f.add_argument("--no-plots", action="store_true")
    f.set_defaults(fn=cmd_fit)


def _add_guard(sub) -> None:
    from moelab.ladder.guard import GuardRules  # its defaults are the options' defaults

    g = sub.add_parser("guard", help="compare a run's metrics with the prediction bands",
                       description="Read RUN/metrics.jsonl, compare loss, grad norm and drop "
                       "fraction with the prediction bands (RUN/prediction.json or --prediction) "
                       "and append alerts to the log as events. Rules: a metric (its deviation from "
                       "the predicted curve smoothed by a median of 20 logged values) outside its "
                       "band, widened by loss 2%, grad norm 50%, drops 2 points and 3 standard "
                       "errors of the run's own noise, for 3 points in a row, from 20% of the "
                       "run; grad norm above 4; a non-finite loss.")
    g.add_argument("run", help="run folder")
    g.add_argument("--prediction", help="prediction.json, or the ladder folder that holds it "
                   "(default: RUN/prediction.json)")
    g.add_argument("--follow", action="store_true", help="keep watching until the run ends")
    g.add_argument("--interval", type=float, default=30.0,
                   help="seconds between checks (default 30)")
    g.add_argument("--loss-tol", type=float, default=GuardRules.loss_tol,
                   help=f"relative loss tolerance beyond the band (default {GuardRules.loss_tol:g})")
    g.add_argument("--grad-norm-max", type=float, default=GuardRules.grad_norm_max,
                   help=f"grad norm ceiling (default {GuardRules.grad_norm_max:g})")
    g.add_argument("--patience", type=int, default=GuardRules.patience, help="consecutive "
                   f"out-of-band points before alerting (default {GuardRules.patience})")
    g.add_argument("--window", type=int, default=GuardRules.window,
                   help=f"trailing median window, in logged points (default {GuardRules.window})")
    g.add_argument("--strict", action="store_true", help="exit 3 when the log holds alerts")
    g.add_argument("--other-run", action="store_true", help="check against a prediction made "
                   "for another config (e.g. before a replan changed the steps); refused "
                   "otherwise, since its alerts are written to this run's log")
    g.set_defaults(fn=cmd_guard)


def _add_forecast(sub) -> None:
    f = sub.add_parser("forecast", help="forecast a run's final held-out loss from the ladder "
                       "and its curve so far",
                       description="Predict RUN's final held-out loss with a band that narrows "
                       "as the run advances: a Bayesian fit of its training and held-out loss so "
                       "far whose prior is the ladder's law (schedule included), next to the "
                       "ladder alone and the run's curve alone.")
    f.add_argument("run", help="run folder (metrics.jsonl, config.yaml), live or finished")
    f.add_argument("--ladder", help="ladder folder or prediction.json (default: "
                   "RUN/prediction.json)")
    _add_fit_options(f, "bootstrap resamples of the run's curve alone (default %(default)s)",
                     boot=100, level=False)
    f.set_defaults(fn=cmd_forecast)


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="compute multiplier of one ladder over another",
                       description="Fit L(C) = E + A C^-alpha to each ladder's final held-out "
                       "losses and report, at each compute C, the compute B needs to reach the "
                       "loss A reaches with C, over C (the efficiency leverage of an MoE A over "
                       "its dense twin B), with a bootstrap band, how it moves with compute, "
                       "and a plot of both laws. Multipliers outside the fitted compute are "
                       "flagged as extrapolations.")
    c.add_argument("ladder_a", help="ladder folder, or a CSV of runs (N, D, loss[, C])")
    c.add_argument("ladder_b", help="the ladder to compare against, same kinds")
    c.add_argument("--compute", type=float, action="append", metavar="C",
                   help="training FLOPs to report at (repeatable; default: the ladders' "
                   "targets, or the largest fitted budget)")
    _add_fit_options(c)
    c.add_argument("--plot", help="PNG to write (default: LADDER_A/plots/compare_<B>.png, or "
                   "beside a CSV A)")
    c.add_argument("--no-plots", action="store_true")
    c.set_defaults(fn=cmd_compare)
