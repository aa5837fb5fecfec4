"""Drop rates of the capacity-limited transports on a skewed synthetic routing (prints a table).

    .venv/bin/python bench/skewed_drops.py [--zipf 0.6] [--source-pref 0.8]

The routing (``moelab.parallel.transport.simulate.skewed_routing``) mimics long documents: a
global Zipf-like expert popularity, plus a per-source preference shared by all tokens of that
source (correlated load), plus per-token noise. EP 8, 48 experts top-4, 256 tokens per source,
8 sources; each transport's drop rule runs on one device (``simulate_drops``).
"""

from __future__ import annotations

import argparse
from collections import Counter

import common  # noqa: F401  (puts src/ on sys.path)
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
    ap = argparse.ArgumentParser(description="drop rates of the capacity-limited transports")
    ap.add_argument("--zipf", type=float, default=0.6, help="global expert popularity skew")
    ap.add_argument("--source-pref", type=float, default=0.8,
                    help="per-source preference (correlated load); 0.2/0.3 = mild skew")
    args = ap.parse_args()
    print(f"{'cf':>5} {'transport':>12} {'sender':>8} {'receiver':>9} {'total':>8}")
    for cf in (1.05, 1.10, 1.25):
        cfgs = {"pooled_wave": ParallelConfig(transport="pooled_wave", sender_cf=cf,
                                              receiver_cf=cf),
                "waterfill": ParallelConfig(transport="waterfill", capacity_factor=cf),
                "expert_cells": ParallelConfig(transport="expert_cells", capacity_factor=cf)}
        drops = measure_drops(cfgs, zipf=args.zipf, source_pref=args.source_pref)
        for name, t in drops.items():
            n = t["assignments"]
            print(f"{cf:5.2f} {name:>12} {t['sender_dropped'] / n:8.2%} "
                  f"{t['receiver_dropped'] / n:9.2%} {t['dropped'] / n:8.2%}")


if __name__ == "__main__":
    main()
