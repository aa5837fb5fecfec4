"""Drop rates of the capacity-limited transports on a skewed synthetic routing.

    .venv/bin/python bench/skewed_drops.py [--zipf 0.6] [--source-pref 0.8]

The routing (``moelab.parallel.transport.simulate.skewed_routing``) mimics long documents: a
global Zipf-like expert popularity, plus a per-source preference shared by all tokens of that
source (correlated load), plus per-token noise. EP 8, 48 experts top-4, 256 tokens per source,
8 sources; each transport's drop rule runs on one device (``simulate_drops``).
"""

from __future__ import annotations

from collections import Counter

from common import parser, print_table, run_main, save  # also puts src/ on sys.path
from moelab.config import ParallelConfig
from moelab.parallel.transport.simulate import simulate_drops, skewed_routing


def measure_drops(cfgs: dict, ep: int = 8, T: int = 256, E: int = 48, k: int = 4,
                  seed: int = 0, zipf: float = 0.6, source_pref: float = 0.8,
                  sources: int = 8) -> dict:
    """{name: drop_totals} for each ParallelConfig in ``cfgs`` on the same skewed routing:
    ``sources`` sources of T tokens, in EP groups of ``ep`` (each simulated on one device)."""
    groups = skewed_routing(sources, T, E, k, seed, zipf, source_pref).reshape(-1, ep * T, k)
    out = {}
    for name, cfg in cfgs.items():
        tot = Counter()
        for expert in groups:
            tot.update(simulate_drops(expert, E, cfg, ep))
        out[name] = dict(tot)
    return out


def main() -> None:
    ap = parser(__doc__, "skewed_drops.json")
    ap.add_argument("--zipf", type=float, default=0.6, help="global expert popularity skew")
    ap.add_argument("--source-pref", type=float, default=0.8,
                    help="per-source preference (correlated load); 0.2/0.3 = mild skew")
    args = ap.parse_args()
    rows = []
    for cf in (1.05, 1.10, 1.25):
        cfgs = {"pooled_wave": ParallelConfig(transport="pooled_wave", sender_cf=cf,
                                              receiver_cf=cf),
                "waterfill": ParallelConfig(transport="waterfill", capacity_factor=cf),
                "expert_cells": ParallelConfig(transport="expert_cells", capacity_factor=cf)}
        drops = measure_drops(cfgs, zipf=args.zipf, source_pref=args.source_pref)
        for name, t in drops.items():
            n = t["assignments"]
            rows.append({"cf": cf, "transport": name, "sender": t["sender_dropped"] / n,
                         "receiver": t["receiver_dropped"] / n, "total": t["dropped"] / n})
    print_table(rows, [("cf", "cf", ".2f"), ("transport", "transport", "s"),
                       ("sender", "sender", ".2%"), ("receiver", "receiver", ".2%"),
                       ("total", "total", ".2%")])
    save("skewed_drops", rows, device_info=False, zipf=args.zipf, source_pref=args.source_pref,
         ep=8, experts=48, top_k=4, tokens_per_source=256, sources=8)

if __name__ == "__main__":
    run_main(main)
