"""Sampling speed: new tokens/s of ``moelab generate`` with the KV cache vs without.

    .venv/bin/python bench/generate_speed.py [--presets tiny,small] [--prompt 64] [--new 128]

For each preset (freshly initialised parameters: speed does not depend on training), one
greedy generation of ``--new`` tokens after a ``--prompt``-token prompt, through
``moelab.generate.make_sampler`` with ``cache=True`` (prefill + one position per token) and
``cache=False`` (a full forward over the ``seq_len`` window per token), each after a short
warm-up that compiles its programs. Time covers the whole call, prefill included. Both paths
must give the same tokens ("same" column). Saves bench/results/generate_speed.json.
"""

from __future__ import annotations

import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

from common import count, parser, print_table, run_main, save
from moelab.config import load_config  # noqa: E402
from moelab.generate import make_sampler  # noqa: E402
from moelab.model import transformer as tr  # noqa: E402


def measure(preset: str, n_prompt: int, n_new: int) -> list[dict]:
    cfg = load_config(preset)
    m, seq_len = cfg.model, cfg.data.seq_len
    params = jax.jit(tr.init_params, static_argnums=0)(m, jax.random.PRNGKey(0))
    state = tr.init_state(m)
    prompt = np.random.default_rng(0).integers(1, m.vocab_size, n_prompt).tolist()
    rows, outputs = [], {}
    for cached in (True, False):
        sample = make_sampler(m, seq_len, cache=cached)
        sample(params, state, prompt, 2, temperature=0.0)  # compiles prefill/step or the window
        t = time.perf_counter()
        outputs[cached] = sample(params, state, prompt, n_new, temperature=0.0)
        dt = time.perf_counter() - t
        rows.append({"preset": preset, "path": "cached" if cached else "uncached",
                     "seq_len": seq_len, "prompt": n_prompt, "new": len(outputs[cached]),
                     "seconds": dt, "tokens_per_s": len(outputs[cached]) / dt})
    rows[0]["speedup"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    for r in rows:
        r["same"] = "yes" if outputs[True] == outputs[False] else "NO"
    return rows


def main() -> None:
    ap = parser(__doc__, "generate_speed.json")
    ap.add_argument("--presets", default="tiny,small", help="comma list of presets")
    ap.add_argument("--prompt", type=count, default=64, help="prompt tokens")
    ap.add_argument("--new", type=count, default=128, help="new tokens generated")
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        rows += measure(preset.strip(), args.prompt, args.new)
    print_table(rows, [("preset", "preset", "s"), ("path", "path", "s"),
                       ("seq_len", "seq_len", "d"), ("prompt", "prompt", "d"), ("new", "new", "d"),
                       ("seconds", "s", ".2f"), ("tokens_per_s", "new tok/s", ".1f"),
                       ("speedup", "speedup", ".1f"), ("same", "same", "s")])
    save("generate_speed", rows, prompt=args.prompt, new=args.new)


if __name__ == "__main__":
    run_main(main)
