"""A small trained MoE whose router gives real routings for the transport benchmarks.

    .venv/bin/python bench/trained_router.py [--steps 180]     # train (or resume) it, then stop
    .venv/bin/python bench/trained_router.py --quick           # the --quick modes' small one

``trained_run()`` trains, once, the ``tiny`` preset reshaped like the reference's routed path
(64 experts top-8, latent width = expert width = d_model / 2, sigmoid-bias router with combine
weights summing to 2.5) on the built-in corpus, in bench/results/router_run/ (resumable: a cut
run continues where it stopped; a finished one is reused as it is).

With ``quick`` the same model trains 8 steps of 2 x 256 tokens (checkpoints every 2 steps) in
bench/results/router_run_quick/: the router every script's ``--quick`` mode uses, to check its
code path in well under a minute; its routings are not the benchmarks' figures.

``routing_for(run_dir, tokens_BT, layer)`` runs that model on real text and returns one layer's
routing as the transports see it: the latent inputs z [N, H], expert ids and combine weights
[N, k] and the layer's expert weights. The forward is the model's own code
(``moelab.parallel.routing.layer_routings``: the model's embedding, attention and mixture branches,
one block at a time) with a hook in the ``experts_fn`` slot that records what reaches the
routed experts and computes them dropless, so later layers see exactly what a single-device
forward computes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import RESULTS, count, parser, run_main  # noqa: E402  (also puts src/ on sys.path)

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = RESULTS / "router_run"
STEPS = 180
QUICK_STEPS = 8
# --quick: 2 x 256 tokens per step, a checkpoint every 2 steps (branches start at one), and
# 2,048 held-out tokens per domain for every evaluation, the final one included
QUICK = {"data.batch_size": 2, "train.ckpt_every": 2, "train.log_every": 2,
         "train.eval_tokens": 2048}


def run_overrides(steps: int = STEPS, experts: int = 64, seed: int = 0,
                  quick: bool = False) -> list[str]:
    """The ``tiny`` preset with the reference's routed-path shape scaled to d_model 128;
    ``seed`` sets the initialisation and the batch order (another router); ``quick`` the
    small batches of the --quick modes (``QUICK``)."""
    full = _overrides(steps, experts, seed)
    if not quick:
        return full
    return ([o for o in full if o.split("=")[0] not in QUICK]
            + [f"{k}={v}" for k, v in QUICK.items()])


def _overrides(steps: int, experts: int, seed: int) -> list[str]:
    d_model = 128
    return [f"train.seed={seed}", f"data.seed={seed}",
        f"model.d_model={d_model}",
        f"model.n_experts={experts}", "model.top_k=8",
        f"model.latent_dim={d_model // 2}", f"model.expert_dim={d_model // 2}",
        "model.router=sigmoid_bias", "model.combine_sum=2.5",
        # The bias moves by at most rate x steps: at the default 1e-3, 200 steps leave the load
        # ~5x max/mean (far from the balanced routers of long runs), 1e-2 still ~3x: 5e-2 here.
        "model.bias_update_rate=0.05",
        "model.moe_block=128",  # less padding with 64 experts (a layout choice, same maths)
        "data.batch_size=16",  # 16 x 256 tokens/step: ~1.5 s/step on 2 cores, 180 steps ~6 min
        f"data.data_dir={REPO / 'data' / 'builtin'}",  # independent of the working directory
        f"train.steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={max(steps // 4, 1)}",
        "train.log_every=20", "train.eval_tokens=16384",
        "train.peak_flops=1e11",  # only scales the logged MFU; skips the peak measurement
    ]


def _finished(run_dir: Path, steps: int) -> bool:
    p = run_dir / "summary.json"
    if not p.exists():
        return False
    s = json.loads(p.read_text())
    return s.get("step", 0) >= steps and not s.get("interrupted")


def router_dir(experts: int = 64, seed: int = 0, steps: int | None = None,
               quick: bool = False) -> Path:
    """The default model's folder is router_run (router_run_quick with ``quick``); another
    expert count, seed or number of steps gets its own (router_run_e<N>, router_run_s<SEED>,
    router_run_n<STEPS>): a shorter trial run is never extended into the default model, nor
    the default model reused as it."""
    default = QUICK_STEPS if quick else STEPS
    steps = default if steps is None else steps
    return Path(f"{RUN_DIR}" + ("_quick" if quick else "")
                + (f"_e{experts}" if experts != 64 else "")
                + (f"_s{seed}" if seed else "") + (f"_n{steps}" if steps != default else ""))


@contextlib.contextmanager
def short_final_eval(quick: bool):
    """With ``quick``, a run's end-of-run evaluation reads ``train.eval_tokens`` per domain,
    not the whole held-out split (which takes longer than the quick run itself)."""
    from moelab.train import heldout

    cap = heldout.FINAL_EVAL_CAP
    if quick:
        heldout.FINAL_EVAL_CAP = QUICK["train.eval_tokens"]
    try:
        yield
    finally:
        heldout.FINAL_EVAL_CAP = cap


def trained_run(steps: int | None = None, run_dir: Path | str | None = None, experts: int = 64,
                seed: int = 0, quick: bool = False) -> Path:
    """The run folder of the trained router model (``router_dir``), training (or resuming) it
    if needed; ``quick``: the small one of the --quick modes (``QUICK_STEPS`` by default)."""
    from moelab.config import load_config
    from moelab.train.loop import train
    from moelab.train.resume import resolve_run_config
    from moelab.train.tracker import format_summary

    steps = (QUICK_STEPS if quick else STEPS) if steps is None else steps
    run_dir = Path(run_dir or router_dir(experts, seed, steps, quick))
    cfg = load_config("tiny", run_overrides(steps, experts, seed, quick))
    resolve_run_config(cfg, run_dir)  # a folder trained with another config: ConfigError
    if _finished(run_dir, steps):
        return run_dir
    t = time.time()
    print(f"training the router model in {run_dir} ({steps} steps of "
          f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens; one time, resumable) ...", flush=True)
    with short_final_eval(quick):
        summary = train(cfg, run_dir, sample_prompt=None)
    print(format_summary(summary), flush=True)
    print(f"router model ready in {time.time() - t:.0f}s", flush=True)
    if summary.get("interrupted"):
        raise SystemExit("router training interrupted; run again to resume")
    return run_dir


# ----------------------------------------------------------------------------- the model

@functools.lru_cache(maxsize=4)
def load(run_dir: Path | str):
    """(RunConfig, params, model_state) of the newest checkpoint."""
    from moelab.run.load import load_run

    r = load_run(Path(run_dir))
    return r.cfg, r.params, r.model_state


@functools.lru_cache(maxsize=4)
def _routing_pass(run_dir: str):
    """jit(params, state, tokens_BT) -> per-layer [(z_NH, expert_NK, weight_NK)] for the run's
    model (``moelab.parallel.routing.layer_routings``: the model's own blocks)."""
    from moelab.parallel.routing import layer_routings

    cfg, _, _ = load(run_dir)
    return jax.jit(functools.partial(layer_routings, cfg=cfg.model))


def routing_all(run_dir: Path | str, tokens_BT) -> list[tuple]:
    """[(z_NH, expert_NK, weight_NK, expert weights)] for every layer, tokens flattened N = B*T
    in row-major order (row b's tokens are N[b*T:(b+1)*T])."""
    cfg, params, state = load(str(run_dir))
    got = _routing_pass(str(run_dir))(params, state, jnp.asarray(tokens_BT, jnp.int32))
    dt = jnp.dtype(cfg.model.compute_dtype)
    out = []
    for layer, (z, e, w) in enumerate(got):
        ew = {k: params["blocks"][k][layer].astype(dt) for k in ("w_gate", "w_up", "w_down")}
        out.append((z, e, w, ew))
    return out


def routing_for(run_dir: Path | str, tokens_BT, layer: int):
    """(z_NH latent inputs, expert_NK, weight_NK, expert weights {w_gate, w_up, w_down}) of
    ``layer`` on ``tokens_BT`` (N = B*T tokens, row-major)."""
    return routing_all(run_dir, tokens_BT)[layer]


# ----------------------------------------------------------------------------- held-out text

def heldout_batch(run_dir: Path | str, n_seqs: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """``n_seqs`` held-out windows of ``seq_len`` tokens drawn without replacement from all
    domains (shuffled with ``seed``): int32 [n_seqs, seq_len]."""
    from moelab.parallel.routing import heldout_spans

    cfg, _, _ = load(str(run_dir))
    blocks = heldout_spans(cfg, seq_len)
    if n_seqs > len(blocks):
        raise ValueError(f"held-out text has only {len(blocks)} windows of {seq_len} tokens")
    return blocks[np.random.default_rng(seed).permutation(len(blocks))[:n_seqs]]


def main() -> None:
    ap = parser(__doc__, "router_run[_quick][_e<EXPERTS>][_s<SEED>][_n<STEPS>]/, the run "
                "folder the transport benchmarks reuse; prints each layer's expert load")
    ap.add_argument("--steps", type=count, help=f"training steps (default: {STEPS}; "
                    f"{QUICK_STEPS} with --quick)")
    ap.add_argument("--experts", type=count, default=64, help="routed experts (top-8)")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    ap.add_argument("--quick", action="store_true", help=f"the small router of the --quick "
                    f"modes: {QUICK_STEPS} steps of 2 x 256 tokens, in router_run_quick/")
    args = ap.parse_args()
    run = trained_run(args.steps, experts=args.experts, seed=args.seed, quick=args.quick)
    cfg, _, state = load(str(run))
    toks = heldout_batch(run, 2 if args.quick else 8, cfg.data.seq_len)
    for layer, (z, e, w, _) in enumerate(routing_all(run, toks)):
        load_E = np.bincount(np.asarray(e).reshape(-1), minlength=cfg.model.n_experts)
        print(f"layer {layer}: z {tuple(z.shape)}, max/mean expert load "
              f"{load_E.max() / load_E.mean():.2f}, combine-weight sum "
              f"{float(jnp.mean(jnp.sum(w, -1))):.2f}")


if __name__ == "__main__":
    run_main(main)
