"""Shared test helpers: a small deterministic synthetic corpus, a prepared data dir, micro configs.

The data dir (user corpus + 512-token BPE + token store) is built once per test session and
cached in this module, so every test module that asks for it gets the same folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from moelab.config import config_from_dict
from moelab.data.corpus import build_user_corpus
from moelab.data.prepare import prepare_data

VOCAB = 512

# A micro model: 2 layers, 4 experts, d_model 32, seq_len 32, batch 4. peak_flops > 0 skips the
# matmul-peak measurement; eval_tokens is small so evaluation is quick.
MICRO = {
    "model": {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
              "head_dim": 16, "n_experts": 4, "top_k": 2, "expert_dim": 32, "latent_dim": 0,
              "n_shared": 1, "shared_dim": 32, "router": "sigmoid_bias", "combine_sum": 2.0,
              "bias_update_rate": 0.01, "moe_block": 32},
    "data": {"seq_len": 32, "batch_size": 4},
    # every test run shares this optimizer (so one compiled train step serves them all): the
    # schedule is 12 steps long, runs may stop before it ends or go on at the floor
    "optim": {"lr": 1e-2, "warmup_steps": 2, "schedule_steps": 12, "floor": 0.2},
    "train": {"steps": 10, "log_every": 1, "eval_every": 1000, "eval_tokens": 256,
              "ckpt_every": 1000, "keep_ckpts": 3, "peak_flops": 1e12},
}

DOMAINS = ("prose", "code", "logs")

_NOUNS = "cat dog bird fox king queen ship river stone tree house garden lamp road child".split()
_ADJS = "red quiet old small bright dark happy tall green cold swift lazy".split()
_VERBS = "sees finds likes follows watches carries paints hears builds keeps".split()


def _prose(rng: random.Random) -> str:
    sents = []
    for _ in range(rng.randint(25, 40)):
        sents.append(f"The {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
                     f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}.")
    return " ".join(sents) + "\n"


def _code(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(10, 16)):
        name = rng.choice(_NOUNS)
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(f"def get_{name}_{a}(x, y):\n    if x > {b}:\n        return x + y * {a}\n"
                   f"    return [x, y, {b}]\n")
    return "\n".join(out)


def _logs(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(30, 50)):
        lvl = rng.choice(["INFO", "WARN", "ERROR", "DEBUG"])
        lines.append(f"2024-03-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
                     f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {lvl} "
                     f"user{rng.randint(0, 999)} {rng.choice(_VERBS)} item {rng.randint(0, 9999)}")
    return "\n".join(lines) + "\n"


def write_synthetic_sources(root: Path, n_docs: int = 50) -> Path:
    """Three folders (= three domains) of deterministic text files; about 250 KB in total."""
    rng = random.Random(1234)
    gens = {"prose": _prose, "code": _code, "logs": _logs}
    for domain in DOMAINS:
        d = root / domain
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n_docs):
            (d / f"doc{i:03d}.txt").write_text(gens[domain](rng), encoding="utf-8")
    return root


_CACHE: dict[str, Any] = {}

# Compiling the micro model's steps dominates test time on CPU (tens of seconds per distinct
# function). A persistent compilation cache in the session's temp folder lets repeated train()
# calls with the same shapes, and the `moelab` subprocesses, reuse compiled executables. It only
# caches XLA's output for identical programs; it never changes what is computed.
_JAX_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _enable_compilation_cache(path: Path) -> None:
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _CACHE["jax_cache"] = path


def multiprocess_env(devices: int) -> dict:
    """os.environ for one of several JAX processes on this machine, each owning ``devices``
    fake CPU devices: the suite's XLA_FLAGS (tests/conftest.py) with that count, the CPU
    backend, and this checkout's src/ first on PYTHONPATH."""
    import os

    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"]),
            "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def subprocess_env(**extra: str) -> dict:
    """os.environ for a `moelab` child process, sharing the session's compilation cache."""
    import os

    env = dict(os.environ)
    if "jax_cache" in _CACHE:
        env.update(_JAX_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=str(_CACHE["jax_cache"]))
    env.update(extra)
    return env


def build_data_dir(base: Path) -> Path:
    """data_dir with corpus/ (3 domains), tokenizer-512.json and the token store."""
    data_dir = base / "data"
    src = write_synthetic_sources(base / "src")
    build_user_corpus([src / d for d in DOMAINS], data_dir / "corpus", heldout_fraction=0.1)
    prepare_data(config_from_dict({"data": {"data_dir": str(data_dir)}}).data, VOCAB,
                 verbose=False)
    return data_dir


def shared_data_dir(tmp_path_factory) -> Path:
    """The session's data dir, built on first use (cached across test modules)."""
    if "data" not in _CACHE:
        _enable_compilation_cache(tmp_path_factory.mktemp("jax_cache"))
        _CACHE["data"] = build_data_dir(tmp_path_factory.mktemp("moelab_data")).resolve()
    return _CACHE["data"]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return shared_data_dir(tmp_path_factory)


def micro_dict(data_dir: Path, **sections) -> dict:
    """The micro config as a dict; ``sections`` update it, e.g. train={"steps": 5}."""
    d = json.loads(json.dumps(MICRO))
    d["data"]["data_dir"] = str(data_dir)
    for sec, upd in sections.items():
        d.setdefault(sec, {}).update(upd)
    return d


def micro_config(data_dir: Path, **sections):
    return config_from_dict(micro_dict(data_dir, **sections))


def write_config_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# The session's shared run: 30 steps, evaluation every 10 steps, checkpoints every 10.
SHARED_RUN_TRAIN = {"steps": 30, "eval_every": 10, "ckpt_every": 10}


def shared_run(tmp_path_factory, data_dir: Path) -> tuple[Path, dict]:
    """(run_dir, summary) of a micro run trained once per session (30 steps, with a sample)."""
    if "run" not in _CACHE:
        from moelab.train.loop import train

        run = tmp_path_factory.mktemp("moelab_run") / "run"
        summary = train(micro_config(data_dir, train=SHARED_RUN_TRAIN), run, verbose=False,
                        sample_prompt="The ")
        _CACHE["run"] = (run, summary)
    return _CACHE["run"]


def small_model(**kw):
    """A two-layer MoE small enough to compile in seconds (widths 16-32, vocabulary 64)."""
    from moelab.config import ModelConfig

    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                n_experts=8, top_k=2, expert_dim=32, latent_dim=16, shared_dim=32, moe_block=8)
    return ModelConfig(**{**base, **kw})


# A model with every architecture option on (the large presets' options, small shapes).
ALL_OPTIONS = dict(
    vocab_size=300, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
    rope_fraction=0.5, sliding_window=4, global_every=2, global_kv_heads=1, global_rope=False,
    qk_norm=True, qk_norm_scale=1.3, xsa=True, attn_gate=True, conv_sites="q,k,v,attn,moe",
    conv_kernel=3, gated_norm_rank=4, embed_norm=True, n_experts=6, top_k=2, expert_dim=16,
    latent_dim=16, n_shared=2, shared_dim=16, router="quantile", combine_sum=2.5, moe_block=8)


def random_train_state(cfg, seed: int) -> dict:
    """A train state of ``cfg``'s shapes with random values everywhere, norms near one and the
    balancing bias included: an untrained model's zero gates, identity convolutions and unit
    norms would hide mistakes in those paths. Made with numpy (eager JAX ops on every leaf
    would dominate the test's time)."""
    import jax
    import numpy as np

    from moelab.train.step import init_train_state

    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))

    def fill(path, s):
        if not np.issubdtype(s.dtype, np.floating):
            return np.zeros(s.shape, s.dtype)
        x = 0.1 * rng.standard_normal(s.shape)
        return (x + 1.0 if str(path[-1].key).endswith("norm") else x).astype(s.dtype)

    state = jax.tree_util.tree_map_with_path(fill, shapes)
    state["model_state"]["router_bias"] *= 3.0
    return state


def signals_after_step(monkeypatch, k: int, *signals) -> None:
    """The next run's step function sends this process ``signals`` after its k-th step (two
    SIGINTs: Ctrl-C twice, the second aborting)."""
    import itertools
    import os

    import moelab.train.setup as train_setup

    real = train_setup._step_functions

    def step_functions(*args, **kw):
        step_fn, eval_fn = real(*args, **kw)
        calls = itertools.count(1)

        def step(state, batch):
            out = step_fn(state, batch)
            if next(calls) == k:
                for sig in signals:
                    os.kill(os.getpid(), sig)
            return out
        return step, eval_fn

    monkeypatch.setattr(train_setup, "_step_functions", step_functions)


def tb_events(folder: Path) -> list:
    """The events of every TensorBoard event file in ``folder`` (TFRecord framing: length,
    its CRC, the record, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.iterdir()):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
    return out


def collective_results(compiled) -> list[tuple[str, str]]:
    """(collective, result shape) of each all-gather, all-reduce, reduce-scatter and all-to-all
    in a compiled step's HLO (a tuple result: its parts)."""
    import re

    ops = r"(all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?"
    out = []
    for m in re.finditer(rf"= (\(.*?\)|\S+) {ops}\(", compiled.as_text()):
        out += [(m.group(2), s) for s in re.findall(r"[a-z]+\d*\[[\d,]*\]", m.group(1))]
    return out


def batch_shaped(results: list[tuple[str, str]], B: int, T: int) -> list[tuple[str, str]]:
    """The collectives among ``results`` that move a batch's activations: shaped [B, T, ...]."""
    return [r for r in results if r[1].split("[")[1].startswith(f"{B},{T},")]
