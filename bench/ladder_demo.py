"""The scaling ladder end to end on a CPU, and the fitting code on published-law data.

    .venv/bin/python bench/ladder_demo.py [--part all|points|ladder] [--seed 0] [--dir DIR]

Part "points" (seconds): ladders of IsoFLOP points generated from a published fitted law,
Chinchilla's approach-3 L(N, D) = 1.69 + 406.4/N^0.34 + 410.7/D^0.28 (Hoffmann et al. 2022),
with 1% log-normal noise, 6 budgets from 6e18 to 1e21 FLOPs x 8 model sizes. `moelab ladder fit
--points` predicts the law's compute-optimal loss at 10x and 100x the largest budget and at
Chinchilla itself (70B, 1.4T tokens); 20 noise draws give the error spread. The points are
generated, not measured: this checks the fitting and extrapolation machinery, not the law.

Part "ladder" (about 20 minutes of two CPU cores at the default 2,000 steps, 42 at 6,000): the
tiny preset family on the built-in corpus (vocab 512, seq 128, batch 16). Target: tiny (d128, 4
layers, 8 heads of 16) for ``--steps`` (default 2,000: 4.1M tokens, 5.6 per active parameter; the
rungs keep the ratio), warming up over ``--warmup`` of its steps (default 10%; every rung keeps the
fraction), each rung's peak LR scaled by (128 / d) ** ``--lr-exp`` (default 1: LR ~ 1 / width,
`moelab ladder plan --lr-exp`); ``--warmup 0.01 --lr-exp 0`` (the reference's 1% warmup, one LR
for all) gave the earliest tables. `moelab ladder plan` derives the rungs by a design of DESIGNS
(``--design``; a, the default: 4 widths at 0.5x and 1x the target's tokens per parameter, 8
rungs at 51% of the target's FLOPs; b: widths 48, 64 and 80 at 0.5x, 1x and 2x, 9 rungs at 52%;
c: a's 4 widths at 1x and 2.5x, 8 rungs at 120%, the largest reaching the target's tokens; d:
the same widths at the target's 4 layers, at 0.5x and 2x, 8 rungs at 150%; e: widths 32, 48
and 64 at 4 layers, 0.5x, 2x and 6x where a run costs at most 4%, 5 rungs at 9.9%; f: widths
16 and 32 at 4 layers, 1x, 3x and 9x where a run costs at most 1.2%, 4 rungs at 1.3%),
`moelab ladder run` trains them, `moelab ladder fit` predicts the target before it trains and
reports its own holdout (refitted without the largest model, predicting it), then the target
trains under `--guard`. ``--seed`` sets train.seed of every run; ``--rung-seeds R`` trains every
rung R times with seeds train.seed + 1000 r. Finished runs of any earlier demo ladder with the
same name and config (seed included) are linked in, not retrained. Then a deviation check: the
target's config with 3x the learning rate for 30% of the run, guarded against the same
prediction. Every stage is resumable: run the script again and finished runs are reused.

Saves bench/results/TAG.json, TAG_prediction.json and TAG.png (a copy of
LADDER/plots/ladder.png), TAG = ladder_demo[_b|...|_f][_wu<P>][_lr<E>][_s<S>][_seed<N>][_r<R>]
(P: the warmup in % where not 10, E: the LR exponent where not 1, S: the target's steps where not 2,000;
also the ladder folder under runs/), and ladder_points.json and ladder_points.csv.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from common import RESULTS, copy_result, count, parser, print_table, save
from moelab.config import config_from_dict
from moelab.ladder.fit import final_value
from moelab.ladder.folder import load_ladder
from moelab.ladder.guard import GuardRules, check, format_alert
from moelab.ladder.observe import EVAL_LOSS, run_records
from moelab.ladder.points import fit_points
from moelab.ladder.run import is_finished
from moelab.util import atomic_write_text

CHINCHILLA = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}
TARGET_STEPS = 2000
TARGET = ["model.vocab_size=512", "model.head_dim=16", "model.n_heads=8", "model.n_kv_heads=8",
          "data.seq_len=128", "data.batch_size=16", "train.log_every=5",
          "train.eval_tokens=131072"]


def target_overrides(steps: int, warmup: float) -> list[str]:
    """The target's config: TARGET for ``steps`` steps, 5 evaluations, 4 checkpoints."""
    return [*TARGET, f"train.steps={steps}", f"train.eval_every={steps // 5}",
            f"train.ckpt_every={steps // 4}",
            f"optim.warmup_steps={max(1, round(warmup * steps))}"]


# Rung designs for the same target. "a" (51% of its FLOPs): 4 widths at 0.5x and 1x the target's
# tokens per parameter, so N and D move together. "b" (52%): 3 widths at 0.5x, 1x and 2x, so runs
# of different widths meet at near-equal D (d48 at 2x ~ d80 at 0.5x) and the largest run reaches
# 59% of the target's D (a: 42%). "c" (120%): a's widths at 1x and 2.5x, so the largest run
# (d96-L3-t2.5, 4.33M tokens) reaches the target's D (4.1M) and the fit interpolates D: with a,
# extrapolating D alone predicted 2.2-3.4% low (examples/lab/0007). "d" (150%): c's widths at the
# target's depth (4 layers), at 0.5x and 2x, so the fit meets no depth the target does not have
# (d96-L4-t2: 4.62M tokens); with c, the law predicted the 4-layer target 0.9-1.1% high.
DESIGNS = {"a": ["--top-share", "0.25", "--spacing", "2.5", "--token-multipliers", "0.5,1"],
           "b": ["--widths", "48,64,80", "--rungs", "3", "--token-multipliers", "0.5,1,2"],
           "c": ["--widths", "48,64,80,96", "--rungs", "4", "--token-multipliers", "1,2.5"],
           "d": ["--widths", "48,64,80,96", "--depths", "4,4,4,4", "--rungs", "4",
                 "--token-multipliers", "0.5,2"],
           # e (9.9%) and f (1.3%): the economical designs. Narrow widths train long, wide ones
           # short (--max-run-share), so N and D both spread at a tenth and a hundredth of the
           # target's compute (examples/lab/0009, 0010).
           "e": ["--widths", "32,48,64", "--depths", "4,4,4", "--rungs", "3",
                 "--token-multipliers", "0.5,2,6", "--max-run-share", "0.04"],
           "f": ["--widths", "16,32", "--depths", "4,4", "--rungs", "2",
                 "--token-multipliers", "1,3,9", "--max-run-share", "0.012"]}
PLAN = ["--depth-exp", "0.5", "--evals", "5"]
# 10% warmup: at the reference's 1% the rungs warm up over 1-8 steps, fewer than Adam's
# second-moment horizon (1 / (1 - b2) = 20 steps), and the early full-LR steps leave seed
# noise: d64-L3, 6 init seeds, 1.13% sd of the final held-out loss at 4 warmup steps, 0.37%
# (and 1.2% lower) at 40; the target 3.5% lower at 10%.
WARMUP = 0.1
# LR ~ 1 / width (Marin's scaling recipe): with the target's LR for all, the narrow rungs train
# below their best LR (d48-L2 6.3% and d64-L3 3.1% lower held-out loss at 6e-3 than at the
# target's 3e-3, while the target is as good at 2e-3), so the law overstates what size buys.
LR_EXP = 1.0
DEVIATION = {"lr_factor": 3.0, "share": 0.3}  # 3x the LR for 30% of the target's steps


# ------------------------------------------------------------------------- published-law points

def chinchilla(N, D):
    c = CHINCHILLA
    return c["E"] + c["A"] / np.asarray(N) ** c["alpha"] + c["B"] / np.asarray(D) ** c["beta"]


def optimal(C: float) -> tuple[float, float]:
    """The true law's compute-optimal (N, D) at C = 6 N D (closed form, Chinchilla eq. 4)."""
    c = CHINCHILLA
    G = (c["alpha"] * c["A"] / (c["beta"] * c["B"])) ** (1 / (c["alpha"] + c["beta"]))
    n = G * (C / 6) ** (c["beta"] / (c["alpha"] + c["beta"]))
    return n, C / (6 * n)


def isoflop_points(seed: int, noise: float = 0.01) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for C in np.geomspace(6e18, 1e21, 6):
        n_opt, _ = optimal(C)
        for N in n_opt * np.geomspace(1 / 4, 4, 8):  # sizes around the optimum, as IsoFLOPs do
            D = C / (6 * N)
            rows.append((N, D, float(chinchilla(N, D)) * math.exp(rng.normal(0, noise)), C))
    return rows


def part_points(draws: int = 20) -> dict:
    largest = 1e21
    queries = {"10x": optimal(10 * largest), "100x": optimal(100 * largest),
               "Chinchilla 70B/1.4T": (70e9, 1.4e12)}
    csv = RESULTS / "ladder_points.csv"
    rows = isoflop_points(0)
    atomic_write_text(csv, "N,D,loss,C\n" + "".join(f"{n:.6g},{d:.6g},{y:.6g},{c:.6g}\n"
                                                     for n, d, y, c in rows))
    predict = [a for n, d in queries.values() for a in ("--predict", f"N={n:.6g},D={d:.6g}")]
    res = json.loads(moelab("ladder", "fit", "--points", str(csv), "--json", *predict,
                            capture=True).stdout)
    out_rows = []
    for (name, (n, d)), p in zip(queries.items(), res["predictions"]):
        truth = float(chinchilla(n, d))
        errs, covered = [], []
        for seed in range(draws):  # the same fit on independent noise draws
            pts = {k: np.array(v) for k, v in zip(("N", "D", "loss", "C"), zip(*isoflop_points(seed)))}
            q = fit_points(pts, [(n, d)], n_boot=100, seed=seed)["predictions"][0]
            errs.append(q["loss"] / truth - 1)
            covered.append(q["lo"] <= truth <= q["hi"])
        out_rows.append({"point": name, "N": n, "D": d, "C": 6 * n * d,
                         "x_largest_budget": 6 * n * d / largest, "true_loss": truth,
                         "predicted": p["loss"], "lo": p["lo"], "hi": p["hi"],
                         "rel_error": p["loss"] / truth - 1,
                         "mean_abs_rel_error_draws": float(np.mean(np.abs(errs))),
                         "max_abs_rel_error_draws": float(np.max(np.abs(errs))),
                         "coverage_90_draws": float(np.mean(covered))})
    print("\npublished-law points (Chinchilla approach 3 + 1% noise), fitted by `moelab ladder "
          "fit --points`:")
    print(json.dumps({k: round(v, 4) for k, v in res["coefficients"].items()}))
    print_table(out_rows, [("point", "predict at", "s"), ("x_largest_budget", "x compute", ".0f"),
                           ("true_loss", "true", ".4f"), ("predicted", "predicted", ".4f"),
                           ("rel_error", "error", "+.2%"),
                           ("mean_abs_rel_error_draws", f"mean |err| ({draws})", ".2%"),
                           ("max_abs_rel_error_draws", "max |err|", ".2%"),
                           ("coverage_90_draws", "90% covers", ".0%")])
    save("ladder_points", out_rows, coefficients=res["coefficients"], truth=CHINCHILLA,
         noise=0.01, budgets="6 from 6e18 to 1e21 FLOPs, 8 sizes each (N_opt/4 .. 4 N_opt)")
    return {"rows": out_rows, "coefficients": res["coefficients"]}


# ------------------------------------------------------------------------------- the CPU ladder

class Stage:
    """Wall and CPU seconds (this script's children) of one stage."""

    def __init__(self, name: str, log: dict):
        self.name, self.log = name, log

    def __enter__(self):
        self.t = time.time()
        self.cpu = _child_cpu()
        print(f"\n== {self.name}", flush=True)

    def __exit__(self, *exc):
        self.log[self.name] = {"wall_s": time.time() - self.t, "cpu_s": _child_cpu() - self.cpu}


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def moelab(*args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moelab.cli", *args]
    print("$ moelab " + " ".join(args), flush=True)
    return subprocess.run(cmd, check=check, text=True, capture_output=capture)


def alerts_of(run_dir: Path, prediction: dict) -> dict:
    """What the guard's rules raise on a run (recomputed, pure), and the alert events its log
    holds (written live, by the guard version of the time)."""
    records, events = run_records(run_dir)
    return {"alerts": check(records, prediction, GuardRules()),
            "logged": [e for e in events if e.get("event") == "alert"]}


def _config(path: Path):
    """The run config in a YAML file (fields added since it was written: their defaults)."""
    return config_from_dict(yaml.safe_load(path.read_text()))


def reuse_runs(root: Path, earlier: list[Path]) -> None:
    """Link into ladder ``root`` the finished runs of the ``earlier`` ladders (other designs,
    fewer replicates) that have the same name and the same config (seed included), and their
    3x-LR deviation run where the targets are the same."""
    new = load_ladder(root)
    folder = lambda lad, n: lad.target_dir if n == "target" else lad.run_dir(n)
    done = lambda d: is_finished(d, deviation_steps(new.target))
    for e in earlier:
        if not (e / "ladder.json").exists() or e.resolve() == root.resolve():
            continue
        old = load_ladder(e)
        for n in [r.name for r in new.rungs] + ["target"]:
            src, dst = folder(old, n), folder(new, n)
            same = old.config_path(n).is_file() and _config(old.config_path(n)) == \
                _config(new.config_path(n))
            if same and (src / "summary.json").exists() and not (dst / "summary.json").exists():
                _link(src, dst)
            if n == "target" and same:  # the deviation run is the target's config at 3x LR
                src, dst = old.root / "deviation_lr3x", new.root / "deviation_lr3x"
                if done(src) and not done(dst):
                    _link(src, dst)


def _link(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, copy_function=os.link)
    print(f"reusing {src}")


def part_ladder(root: Path, seed: int, tag: str, design: str = "a", rung_seeds: int = 1,
                earlier: list[Path] = (), warmup: float = WARMUP, lr_exp: float = LR_EXP,
                steps: int = TARGET_STEPS) -> dict:
    stages: dict = {}
    with Stage("plan", stages):
        # planned again on a rerun: the planner refuses a folder that holds another plan
        moelab("ladder", "plan", "tiny", *target_overrides(steps, warmup), f"train.seed={seed}",
               *DESIGNS[design], *PLAN, "--lr-exp", repr(lr_exp), "--seeds", str(rung_seeds),
               "--out", str(root))
        reuse_runs(root, list(earlier))
    with Stage("rungs", stages):
        moelab("ladder", "run", str(root), "--jobs", "2", "--poll", "60")
    with Stage("fit (before the target trains)", stages):
        fit = json.loads(moelab("ladder", "fit", str(root), "--json", capture=True).stdout)
    lad = load_ladder(root)
    # the fit sees the rungs only, so this is the prediction before the target (even a linked one)
    copy_result(root / "prediction.json", f"{tag}_prediction.json")
    with Stage("target (guarded live)", stages):
        moelab("ladder", "run", str(root), "--target", "--guard", "--poll", "60")
    if seed == 0:  # the guard's check needs one deviating run, not one per seed
        with Stage("deviation: 3x learning rate (guarded)", stages):
            deviation_run(root, lad)
    with Stage("fit + plot with the observed target", stages):
        moelab("ladder", "fit", str(root), "--json", capture=True)
    copy_result(root / "plots" / "ladder.png", f"{tag}.png")
    return summarize(lad, fit, stages)


def deviation_steps(target) -> int:
    return round(DEVIATION["share"] * target.train.steps)


def deviation_run(root: Path, lad) -> None:
    """The target's config with 3x the learning rate for 30% of the run, guarded against the
    same prediction."""
    dev = root / "deviation_lr3x"
    lr = lad.target.optim.lr * DEVIATION["lr_factor"]
    dev.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(root / "prediction.json", dev / "prediction.json")
    steps = deviation_steps(lad.target)
    if not is_finished(dev, steps):
        moelab("train", str(lad.config_path("target")), f"optim.lr={lr}",
               f"train.steps={steps}", "--run-dir", str(dev), check=False)
    moelab("ladder", "guard", str(dev))


def holdout_rows(h: dict) -> list[dict]:
    """The ladder's own check, known before the target trains: refitted without the largest
    model's rungs, each predictor predicts that model's final held-out loss."""
    rows = []
    for name, v in (h.get("predicted") or {}).items():
        band = h.get("band", {}) if name == "chosen law" else {}
        rows.append({"predictor": f"{h['rung']}: {name}", "predicted": v, "lo": band.get("lo"),
                     "hi": band.get("hi"), "observed": h["observed"],
                     "rel_error": h["rel_error"][name],
                     "covered": "lo" in band and band["lo"] <= h["observed"] <= band["hi"]})
    return rows


def summarize(lad, fit: dict, stages: dict) -> dict:
    pred = json.loads((lad.root / "prediction.json").read_text())
    records = run_records(lad.target_dir)[0]
    steps = lad.target.train.steps
    observed = final_value(records, EVAL_LOSS, steps)
    rows = []
    for name, p in fit["final"].items():
        if not name.startswith(EVAL_LOSS):
            continue
        rows.append({"predictor": name, "predicted": p["mid"], "lo": p.get("lo"),
                     "hi": p.get("hi"), "observed": observed,
                     "rel_error": p["mid"] / observed - 1,
                     "covered": p.get("lo") is not None and p["lo"] <= observed <= p["hi"]})
    # the training loss is noisy per batch: compare means over the last 5% of the steps
    m = pred["metrics"]["train/loss"]
    late = np.array(m["step"]) > 0.95 * steps
    tr = {k: float(np.mean(np.array(m[k])[late])) for k in ("lo", "mid", "hi")}
    obs_train = float(np.mean([r["train/loss"] for r in records
                               if r.get("train/loss") is not None and r["step"] > 0.95 * steps]))
    rows.append({"predictor": "train/loss (mean over the last 5% of steps)", "predicted": tr["mid"],
                 "lo": tr["lo"], "hi": tr["hi"], "observed": obs_train,
                 "rel_error": tr["mid"] / obs_train - 1, "covered": tr["lo"] <= obs_train <= tr["hi"]})
    runs = {r["name"]: r for r in fit["rungs"]}
    for r in lad.rungs:
        s = json.loads((lad.run_dir(r.name) / "summary.json").read_text())
        runs[r.name]["wall_time_s"] = s["wall_time_s"]
    target_summary = json.loads((lad.target_dir / "summary.json").read_text())
    dev = lad.root / "deviation_lr3x"
    out = {"cost_share": fit["cost"]["share"], "rungs": list(runs.values()),
           "target": {**fit["target"], "final_eval_loss": observed,
                      "wall_time_s": target_summary["wall_time_s"]},
           "final_predictions": rows, "holdout": holdout_rows(fit.get("holdout") or {}),
           "laws": fit["laws"], "stages": stages,
           "guard": {"rules": dataclasses.asdict(GuardRules()), "deviation": DEVIATION,
                     "target": alerts_of(lad.target_dir, pred),
                     "deviation_run": alerts_of(dev, pred) if dev.exists() else None}}
    print(f"\nladder cost: {100 * out['cost_share']:.1f}% of the target's FLOPs; rungs:")
    print_table(out["rungs"], [("name", "rung", "s"), ("params_active", "N", ",d"),
                               ("tokens", "D", ",d"), ("flops", "FLOPs", ".3g"),
                               ("final_eval_loss", "held-out", ".4f"),
                               ("wall_time_s", "wall s", ".0f")])
    print(f"\ntarget: N {fit['target']['params_active']:,}, D {fit['target']['tokens']:,}, "
          f"{fit['target']['flops']:.3g} FLOPs, observed final held-out loss {observed:.4f}")
    columns = [("predictor", "predictor", "s"), ("predicted", "predicted", ".4f"),
               ("lo", "lo", ".4f"), ("hi", "hi", ".4f"), ("observed", "observed", ".4f"),
               ("rel_error", "error", "+.2%"), ("covered", "in band", "")]
    print_table(rows, columns)
    print("\nthe ladder's own holdout (refitted without the largest model, before the target "
          "trained):")
    print_table(out["holdout"], columns)
    g = out["guard"]
    for name, key in (("healthy target", "target"), ("3x-LR run", "deviation_run")):
        if g[key] is None:
            continue
        alerts = g[key]["alerts"]
        print(f"\nguard on the {name}: {len(alerts)} alert(s)")
        for a in alerts:
            print("  " + format_alert(a))
    for name, s in stages.items():
        print(f"  stage {name:<40} wall {s['wall_s'] / 60:6.1f} min, CPU {s['cpu_s'] / 60:6.1f} min")
    return out


def main() -> None:
    ap = parser(__doc__, "TAG.json, TAG_prediction.json and TAG.png (TAG: see --dir); "
                "--part points: ladder_points.{json,csv}")
    ap.add_argument("--part", choices=("all", "points", "ladder"), default="all")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of the rungs and target")
    ap.add_argument("--design", choices=sorted(DESIGNS), default="a",
                    help="the rung design (see DESIGNS)")
    ap.add_argument("--warmup", type=float, default=WARMUP, help="the target's warmup as a "
                    "fraction of its steps in (0, 0.5], kept by every rung (default %(default)s)")
    ap.add_argument("--lr-exp", type=float, default=LR_EXP, help="rung peak LR = target LR x "
                    "(128 / d) ** LR_EXP, in [0, 2] (`ladder plan --lr-exp`, whose default is 0: "
                    "one LR; here default %(default)s)")
    ap.add_argument("--steps", type=int, default=TARGET_STEPS, help="the target's steps, >= 100 "
                    "(default %(default)s; the rungs keep its tokens per parameter)")
    ap.add_argument("--rung-seeds", type=count, default=1, help="replicates of every rung "
                    "(`ladder plan --seeds`; folder and results gain _r<N>)")
    ap.add_argument("--dir", help="the ladder folder (default runs/TAG, TAG = ladder_demo"
                    "[_b|_c|_d|_e|_f][_wu<P>][_lr<E>][_s<S>][_seed<N>][_r<R>])")
    args = ap.parse_args()
    if not 0 < args.warmup <= 0.5:
        ap.error(f"--warmup {args.warmup}: a fraction of the target's steps in (0, 0.5]")
    if args.steps < 100:
        ap.error(f"--steps {args.steps}: the target needs at least 100 steps")
    if not 0 <= args.lr_exp <= 2:
        ap.error(f"--lr-exp {args.lr_exp}: an exponent in [0, 2] (0: one LR for all rungs)")
    out = {}
    if args.part in ("all", "points"):
        out["points"] = part_points()
    if args.part in ("all", "ladder"):
        tag = ("ladder_demo" + (f"_{args.design}" if args.design != "a" else "")
               + (f"_wu{100 * args.warmup:g}" if args.warmup != WARMUP else "")
               + (f"_lr{args.lr_exp:g}" if args.lr_exp != LR_EXP else "")
               + (f"_s{args.steps}" if args.steps != TARGET_STEPS else "")
               + (f"_seed{args.seed}" if args.seed else "")
               + (f"_r{args.rung_seeds}" if args.rung_seeds > 1 else ""))
        # any earlier demo ladder: runs are linked only where name and config (seed) match
        earlier = sorted(p.parent for p in Path("runs").glob("ladder_demo*/ladder.json"))
        out["ladder"] = part_ladder(Path(args.dir or f"runs/{tag}"), args.seed, tag,
                                    args.design, args.rung_seeds, earlier, args.warmup,
                                    args.lr_exp, args.steps)
        save(tag, out["ladder"]["final_predictions"], **{
            k: v for k, v in out["ladder"].items() if k != "final_predictions"})
        print(f"plot: {RESULTS / (tag + '.png')}")


def run_script(main, script: str, kept: str) -> None:
    """Run ``main``; a failed moelab command ends the script with its own message (it says what
    to fix) and no traceback on top of it."""
    try:
        main()
    except subprocess.CalledProcessError as e:
        sys.stderr.write(e.stderr or "")
        sys.exit(f"{script}: `moelab {' '.join(e.cmd[3:5])}` failed (exit {e.returncode}); "
                 f"{kept}: fix and rerun to resume")


if __name__ == "__main__":
    run_script(main, "ladder_demo", "finished stages are kept")
