"""The training loop: run folder, resume, metrics, evaluation, checkpoints, signals, summary.

A run folder holds::

    config.yaml        the resolved config (what this run is)
    tokenizer.json     a copy of the tokenizer, so the folder alone can generate text
    provenance.json    git commit and diff hash, config hash, data fingerprint, library versions
    metrics.jsonl      append-only metrics and events (the source of truth for every report)
    checkpoints/       orbax checkpoints (params, optimizer and router state, step, data position)
    summary.json       the final summary (written atomically at the end of each invocation)

Running ``train`` again on the same folder resumes from the newest valid checkpoint. SIGINT or
SIGTERM finish the current step, save a checkpoint and return (a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from moelab.config import ConfigError, RunConfig, config_from_dict, save_config
from moelab.data.prepare import PreparedData, prepare_data
from moelab.data.sampler import SteppedSampler, eval_windows, heldout_text
from moelab.data.store import TokenStore
from moelab.data.tokenizer import decode, encode_batch, eos_id, load_tokenizer
from moelab.flops import param_counts, train_flops_per_token
from moelab.generate import make_sampler
from moelab.ops.replan import commit_pending, resume_config
from moelab.ops.schedule import OPERATION_FIELDS
from moelab.provenance import provenance
from moelab.train.checkpoint import Checkpointer
from moelab.train.peak import measure_peak_flops
from moelab.parallel.distributed import agree_any, barrier, is_main
from moelab.parallel.mesh import mesh_from_config, shard_batch, state_shardings
from moelab.train.step import init_train_state, make_eval_step, make_train_step, transport_fns
from moelab.train.tracker import (HardwareMonitor, JsonlTracker, Trackers, WandbTracker,
                                  process_identity)
from moelab.util import atomic_write_bytes, atomic_write_json, info

# Fields that may change when a run is resumed: they do not change what is being trained.
RESUMABLE_CHANGES = {"train.steps", "train.log_every", "train.eval_every", "train.ckpt_every",
                     "train.keep_ckpts", "train.eval_tokens", "train.peak_flops", "train.wandb",
                     "train.wandb_project", "parallel.devices", "parallel.expert",
                     "parallel.ragged_impl", "model.remat", "model.moe_impl", "model.moe_block"}


FINAL_EVAL_CAP = 1_000_000  # held-out tokens per domain read by the end-of-run evaluation


def flatten_config(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "mixture":
            out.update(flatten_config(v, key + "."))
        else:
            out[key] = v
    return out


def resolve_run_config(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """The config to use in ``run_dir``: the saved one, updated only where a resume allows.
    A folder without checkpoints has trained nothing yet, so any config may (re)start it."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists() or not Checkpointer(run_dir / "checkpoints").steps():
        return cfg.with_frozen_schedule()
    saved = config_from_dict(yaml.safe_load(saved_path.read_text()))
    if cfg.optim.schedule_steps == 0:  # "follow train.steps" means the length it started with
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, schedule_steps=saved.optim.schedule_steps,
            warmup_steps=cfg.optim.warmup_steps or saved.optim.warmup_steps))
    # operations (replan, branch) are kept, a pending replan applied, the past left as it was
    cfg = resume_config(saved, cfg.with_frozen_schedule(), run_dir)
    old, new = flatten_config(saved.to_dict()), flatten_config(cfg.to_dict())
    diff = [k for k in new if old.get(k) != new[k]]
    bad = [k for k in diff if k not in RESUMABLE_CHANGES and k not in OPERATION_FIELDS]
    if bad:
        k = bad[0]
        raise ConfigError(f"{k}: {run_dir} was started with {old.get(k)!r}, now {new[k]!r}. A run "
                          "folder trains one model: use a new --run-dir (or drop the override "
                          "to resume this run as it was configured)")
    return cfg


def _domain_eval(eval_fn, params, model_state, windows: np.ndarray, batch: int,
                 put=jnp.asarray) -> float:
    """Mean next-token loss (nats) over all windows, in fixed-size batches (one compilation)."""
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        valid = np.zeros(batch, bool)
        valid[: len(chunk)] = True
        if len(chunk) < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
        total += float(eval_fn(params, model_state, put(chunk), put(valid)))
        n += int(valid.sum()) * (windows.shape[1] - 1)
    return total / max(n, 1)


def evaluate(cfg: RunConfig, eval_fn, state: dict, store: TokenStore, max_tokens: int,
             put=jnp.asarray) -> dict:
    """Held-out loss and bits per byte per domain."""
    out = {}
    for domain in store.domains("heldout"):
        if store.n_tokens("heldout", domain) < cfg.data.seq_len + 1:
            continue  # too short for one window at this sequence length
        windows, bytes_per_token = eval_windows(store, domain, cfg.data.seq_len, max_tokens)
        loss = _domain_eval(eval_fn, state["params"], state["model_state"], windows,
                            cfg.data.batch_size, put)
        out[f"eval/{domain}/loss"] = loss
        out[f"eval/{domain}/bpb"] = loss / math.log(2) / bytes_per_token
    return out


def gzip_bpb(text: str) -> float:
    """Bits per byte that ``gzip -9`` achieves on ``text`` (the baseline a model must beat)."""
    raw = text.encode("utf-8")
    return 8.0 * len(gzip.compress(raw, compresslevel=9)) / max(len(raw), 1)


class _StopFlag:
    """Turns SIGINT/SIGTERM into a polite stop request; a second SIGINT aborts at once."""

    def __init__(self):
        self.signal: str | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        info(f"\n{self.signal} received: finishing this step and saving a checkpoint "
             "(Ctrl-C again to abort without saving)")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def init_sharded_state(cfg: RunConfig, mesh) -> dict:
    """A fresh train state, created directly in its shardings (routed experts split over the
    "expert" axis) so no process ever holds another's shards, and restores land there too."""
    init = functools.partial(init_train_state, cfg)
    key = jax.random.PRNGKey(cfg.train.seed)
    if mesh is None:
        return jax.jit(init)(key)
    shardings = state_shardings(mesh, jax.eval_shape(init, key))
    return jax.jit(init, out_shardings=shardings)(key)


def train(cfg: RunConfig, run_dir: Path | str, *, verbose: bool = True,
          sample_prompt: str | None = "The ") -> dict:
    """Train (or resume) the run in ``run_dir``. Returns the summary dict."""
    run_dir = Path(run_dir)
    cfg = resolve_run_config(cfg, run_dir)
    main = is_main()  # with several processes, process 0 alone writes the run folder
    say = info if verbose and main else (lambda _m: None)
    if main:  # builds the corpus/tokenizer/token store once; the others then find it built
        data: PreparedData = prepare_data(cfg.data, cfg.model.vocab_size, verbose=verbose)
    barrier("data-prepared")
    if not main:
        data = prepare_data(cfg.data, cfg.model.vocab_size, verbose=False)
    store = TokenStore(data.store_dir)
    tok = load_tokenizer(data.tokenizer_path)
    prov = provenance(cfg, store.fingerprint)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        # A copy of the tokenizer makes the run folder self-contained for `moelab generate`.
        atomic_write_bytes(run_dir / "tokenizer.json", data.tokenizer_path.read_bytes())
        atomic_write_json(run_dir / "provenance.json", prov)
        commit_pending(run_dir, cfg)  # a replan applied by this resume: log it, drop the request

    sampler = SteppedSampler(store, cfg.data)  # mixture changes and context stages by step
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_ckpts)
    mesh = mesh_from_config(cfg.parallel)
    state = init_sharded_state(cfg, mesh)
    put_batch = (lambda b: jnp.asarray(b)) if mesh is None else (lambda b: shard_batch(b, mesh))
    restored = ckpt.restore_latest(state)
    start = 0
    if restored is not None:
        start, state, _meta = restored
        say(f"resuming {run_dir} from step {start}")

    trackers = Trackers(JsonlTracker(run_dir / "metrics.jsonl") if main else None,
                        WandbTracker(cfg.train.wandb_project, run_dir, cfg.to_dict(), run_dir.name)
                        if cfg.train.wandb and main else None)
    trackers.event("resume" if start else "start", start, config_hash=cfg.hash(),
                   git_commit=prov.get("git_commit"), **process_identity())
    hardware = HardwareMonitor()
    counts = param_counts(cfg.model)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
    n_dev = 1 if mesh is None else mesh.devices.size
    peak = cfg.train.peak_flops or n_dev * measure_peak_flops(dtype=cfg.model.compute_dtype)
    say(f"model: {counts['total'] / 1e6:.2f}M parameters, {counts['active'] / 1e6:.2f}M active "
        f"per token; {tokens_per_step} tokens/step; {flops_per_token / 1e6:.1f} MFLOP/token; "
        f"peak {peak / 1e9:.0f} GFLOP/s ({cfg.model.compute_dtype} matmul x {n_dev} device(s))")

    train_experts, eval_experts = transport_fns(cfg, mesh)
    step_fn = make_train_step(cfg, train_experts)
    eval_fn = make_eval_step(cfg, eval_experts)
    if mesh is not None:
        say(f"mesh: {dict(mesh.shape)}; transport {cfg.parallel.transport} (evaluation: dropless)")
    steps = cfg.train.steps
    metrics: dict = {}
    evals: dict = {}
    timing = {"t_first": None, "step_first": None, "paused": 0.0}
    t_run = time.time()
    stop_signal = None

    def save(step: int) -> None:
        ckpt.save(step, state, {"step": step, "data": sampler.state(), "config": cfg.to_dict(),
                                "metrics": {k: float(v) for k, v in metrics.items()}})

    def paused(fn, *args):
        """Run evaluation or a save outside the throughput clock."""
        t0 = time.time()
        out = fn(*args)
        timing["paused"] += time.time() - t0
        return out

    with _StopFlag() as flag:
        try:
            step = start
            while step < steps:
                change = sampler.change_at(step)
                if change:  # new mixture or context; a new shape recompiles: restart the clock
                    trackers.event("data_stage", step, **change)
                    timing.update(t_first=None, paused=0.0)
                state, m = step_fn(state, put_batch(sampler.batch(step)))
                step += 1
                stop = agree_any(flag.signal is not None)  # all processes stop at the same step
                if timing["t_first"] is None:  # exclude compilation from throughput
                    jax.block_until_ready(m)
                    timing["t_first"], timing["step_first"] = time.time(), step
                if step % cfg.train.log_every == 0 or step == steps or stop:
                    metrics = {k: float(v) for k, v in jax.device_get(m).items()}
                    busy = time.time() - timing["t_first"] - timing["paused"]
                    done = step - timing["step_first"]
                    tokens = cfg.data.tokens_before(step)
                    rate = ((tokens - cfg.data.tokens_before(timing["step_first"]))
                            / max(busy, 1e-9) if done else 0.0)
                    seq_len = sampler.at(step - 1).seq_len  # metrics tagged with the context
                    metrics["throughput/tokens_per_s"] = rate
                    metrics["throughput/mfu"] = (rate * train_flops_per_token(cfg.model, seq_len)
                                                 / peak)
                    metrics["train/tokens"] = tokens
                    metrics["data/seq_len"] = seq_len
                    trackers.log(step, {**metrics, **hardware.sample()})
                    if not math.isfinite(metrics["train/loss"]):
                        trackers.event("diverged", step, loss=str(metrics["train/loss"]))
                        raise FloatingPointError(f"loss is {metrics['train/loss']} at step {step};"
                                                 " lower optim.lr or enable optim.clip_norm")
                    eta = (cfg.data.tokens_before(steps) - tokens) / rate if rate else float("nan")
                    say(f"step {step:>6}/{steps} | loss {metrics['train/loss']:.4f} | "
                        f"lr {metrics['train/lr']:.2e} | gnorm {metrics['train/grad_norm']:.2f} | "
                        f"{rate:,.0f} tok/s | MFU {100 * metrics['throughput/mfu']:.1f}% | "
                        f"ETA {_fmt_time(eta) if rate else '?'}")
                if step % cfg.train.eval_every == 0 and step < steps and not stop:
                    evals = paused(evaluate, cfg, eval_fn, state, store, cfg.train.eval_tokens,
                                   put_batch)
                    trackers.log(step, evals)
                    say("  eval " + "  ".join(f"{k.split('/')[1]} {v:.3f}"
                                              for k, v in evals.items() if k.endswith("/bpb"))
                        + " bits/byte")
                if stop:
                    stop_signal = flag.signal or "SIGTERM"  # another process received it
                    break
                if step % cfg.train.ckpt_every == 0 and step < steps:
                    paused(save, step)
            if step > start or restored is None:
                save(step)

            summary = {"run_dir": str(run_dir), "step": step, "steps": steps,
                       "interrupted": stop_signal, "config_hash": cfg.hash(),
                       "params_total": counts["total"], "params_active": counts["active"],
                       "tokens_trained": cfg.data.tokens_before(step),
                       "wall_time_s": time.time() - t_run, "peak_flops": peak}
            summary.update({k: metrics.get(k) for k in ("train/loss", "throughput/tokens_per_s",
                                                         "throughput/mfu")})
            if stop_signal is None:
                # The final evaluation reads the whole held-out split (up to a cap), so the
                # gzip baseline below is computed on the same text.
                whole = max(store.n_tokens("heldout", d) for d in store.domains("heldout"))
                evals = evaluate(cfg, eval_fn, state, store,
                                 min(whole, max(cfg.train.eval_tokens, FINAL_EVAL_CAP)), put_batch)
                trackers.log(step, evals)
                summary.update(evals)
                if "prose" in store.domains("heldout") and main:
                    summary["baseline/prose/gzip9_bpb"] = gzip_bpb(
                        heldout_text(data.corpus_dir, "prose"))
                if sample_prompt is not None and jax.process_count() == 1:
                    sample = make_sampler(cfg.model, cfg.data.seq_len)
                    ids = encode_batch(tok, [sample_prompt])[0]
                    out = sample(state["params"], state["model_state"], ids, 60,
                                 seed=cfg.train.seed, stop_id=eos_id(tok))
                    summary["sample"] = sample_prompt + decode(tok, out)
                trackers.event("finished", step)
            else:
                trackers.event("interrupted", step, signal=stop_signal)
        except BaseException as e:  # the record says why the run stopped (reports list it)
            trackers.event("aborted" if isinstance(e, KeyboardInterrupt) else "failed", step,
                           error=f"{type(e).__name__}: {e}")
            raise
        finally:
            trackers.close()
    if main:
        atomic_write_json(run_dir / "summary.json", summary)
    return summary


def format_summary(s: dict) -> str:
    lines = [f"run {s['run_dir']}: step {s['step']}/{s['steps']}"
             + (f" (stopped by {s['interrupted']}; run again to resume)" if s["interrupted"] else ""),
             f"  parameters       {s['params_total'] / 1e6:.2f}M total, "
             f"{s['params_active'] / 1e6:.2f}M active per token",
             f"  tokens trained   {s['tokens_trained']:,} in {_fmt_time(s['wall_time_s'])}"]
    if s.get("train/loss") is not None:
        lines.append(f"  train loss       {s['train/loss']:.4f} nats/token")
    if s.get("throughput/tokens_per_s"):
        lines.append(f"  throughput       {s['throughput/tokens_per_s']:,.0f} tokens/s, "
                     f"MFU {100 * s['throughput/mfu']:.1f}% of {s['peak_flops'] / 1e9:.0f} GFLOP/s")
    domains = sorted({k.split("/")[1] for k in s if k.startswith("eval/")})
    for d in domains:
        lines.append(f"  held-out {d:<11} loss {s[f'eval/{d}/loss']:.4f}, "
                     f"{s[f'eval/{d}/bpb']:.3f} bits/byte")
    if "baseline/prose/gzip9_bpb" in s:
        model = s.get("eval/prose/bpb", float("nan"))
        verdict = "beats" if model < s["baseline/prose/gzip9_bpb"] else "does NOT beat"
        lines.append(f"  prose vs gzip -9 model {model:.3f} vs gzip {s['baseline/prose/gzip9_bpb']:.3f}"
                     f" bits/byte: the model {verdict} gzip")
    if s.get("sample"):
        lines.append("  sample: " + s["sample"].replace("\n", " ")[:300])
    return "\n".join(lines)
