"""MoE's compute multiplier over its dense twin, measured with two ladders on the CPU.

    .venv/bin/python bench/moe_vs_dense.py [--widths 32,48,64] [--seeds 2] [--dir runs/moe_vs_dense]

Two ladders of the same widths, depths, tokens and seeds, planned from two targets of equal
active parameters per token:

- MoE: the CPU ladder demo's target (the `tiny` recipe: 8 routed experts top-2 of width d,
  a shared expert of width d, latent width d/2; bench/ladder_demo.py's target config);
- dense: its twin, one expert of width 2d always chosen with weight 1 (`model.n_experts=1
  model.top_k=1 model.expert_dim=256 model.combine_sum=1 model.moe_impl=dense`; the shared
  expert and the latent projection stay), so the active parameters and FLOPs per token are
  the MoE's, and only the routing differs.

Each width trains at the target's tokens per active parameter (5.6) at 4 layers, every rung
``--seeds`` times (`moelab ladder plan --seeds`). Then `moelab ladder compare MOE DENSE`
fits L(C) to each and reports the compute the dense ladder needs to match the MoE's loss, over
the MoE's compute, at the target's compute and along the fitted range, with a paired
bootstrap band; the plot shows both laws. Resumable: finished rungs are kept.

About 15 minutes on two idle cores at the defaults (12 rungs of 127-503 steps, two at a time).
Saves bench/results/moe_vs_dense.json and moe_vs_dense.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import RESULTS, count, parser, print_table, save
from ladder_demo import TARGET_STEPS, WARMUP, moelab, run_script, target_overrides
from moelab.config import load_config

# the dense twin of the demo's target: one expert of top_k x expert_dim, weight 1
TINY = load_config("tiny").model
DENSE = ["model.moe_impl=dense", "model.n_experts=1", "model.top_k=1",
         f"model.expert_dim={TINY.top_k * TINY.expert_dim}", "model.combine_sum=1.0"]


def plan(root: Path, overrides: list[str], widths: str, seeds: int) -> None:
    n = len(widths.split(","))
    moelab("ladder", "plan", "tiny", *target_overrides(TARGET_STEPS, WARMUP), *overrides,
           "--widths", widths, "--depths", ",".join(["4"] * n), "--rungs", str(n),
           "--seeds", str(seeds), "--evals", "5", "--lr-exp", "0", "--out", str(root))


def main() -> None:
    ap = parser(__doc__, "moe_vs_dense.{json,png}")
    ap.add_argument("--widths", default="32,48,64", help="rung widths, at least 3 (default "
                    "%(default)s: multiples of the head dimension 16)")
    ap.add_argument("--seeds", type=count, default=2, help="seeds per rung (default %(default)s)")
    ap.add_argument("--dir", default="runs/moe_vs_dense", help="where the two ladders go")
    args = ap.parse_args()
    if len(args.widths.split(",")) < 3:
        ap.error(f"--widths {args.widths}: at least 3 widths (a law of compute needs 3 budgets)")
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: at least 1")
    root = Path(args.dir)
    sides = {"moe": [], "dense": DENSE}
    for name, overrides in sides.items():
        plan(root / name, overrides, args.widths, args.seeds)
    for name in sides:
        moelab("ladder", "run", str(root / name), "--jobs", "2", "--poll", "30")
    plot = RESULTS / "moe_vs_dense.png"
    rep = json.loads(moelab("ladder", "compare", str(root / "moe"), str(root / "dense"),
                            "--json", "--plot", str(plot), capture=True).stdout)
    for key, title in (("A", "MoE"), ("B", "dense twin")):
        s = rep[key]
        c = s["coefficients"]
        print(f"{title}: {s['runs']} runs, C {s['compute_range'][0]:.3g} to "
              f"{s['compute_range'][1]:.3g}: L(C) = {c['E']:.4f} + {c['A']:.4g} C^-{c['alpha']:.4f}"
              + "".join(f"\n  warning: {w}" for w in s["warnings"]))
    columns = [("compute", "C (FLOPs)", ".3g"), ("loss_A", "MoE loss", ".4f"),
               ("compute_B", "dense needs", ".3g"), ("multiplier", "multiplier", ".3g"),
               ("lo", "lo", ".3g"), ("hi", "hi", ".3g"), ("extrapolated", "extrapolated", "s")]
    print("\ncompute multiplier of the MoE over its dense twin (at the target's compute):")
    print_table(rep["at"], columns)
    print("\nhow it moves with compute:")
    print_table(rep["trend"], columns)
    save("moe_vs_dense", rep["trend"], device_info=False, at=rep["at"], moe=rep["A"],
         dense=rep["B"], widths=args.widths, seeds=args.seeds, dense_overrides=DENSE)
    print(f"plot: {plot}")


if __name__ == "__main__":
    run_script(main, "moe_vs_dense", "finished rungs are kept")
