"""Training: LR schedule, weight-decay mask, learning, exact resume, signals, damaged checkpoints,
config changes on resume, the metrics log, the router bias, and W&B offline logging.

Everything trains a micro MoE (d_model 32, 2 layers, 4 experts, seq_len 32, batch 4) on a small
synthetic three-domain corpus built once per session (tests/helpers.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import (
    DOMAINS,
    MICRO,
    SHARED_RUN_TRAIN,
    micro_config,
    micro_dict,
    shared_run,
    subprocess_env,
    tb_events,
    write_config_yaml,
)
from moelab.config import ConfigError, OptimConfig, config_from_dict
from moelab.model import transformer as tr
from moelab.run.checkpoint import Checkpointer, CheckpointWarning
from moelab.run.logs import read_metrics
from moelab.train.loop import train
from moelab.train.optim import decay_mask, lr_at, make_optimizer
from moelab.train.resume import resolve_run_config
from moelab.train.step import init_train_state

# ---------------------------------------------------------------------------------------------
# helpers


def expected_lr(step: int, peak: float, warmup: int, total: int, floor: float) -> float:
    """The documented schedule, written independently: linear warmup reaching the peak at step
    warmup-1, then linear decay reaching floor*peak at step ``total``, flat afterwards."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if step >= total:
        return floor * peak
    return peak - (peak - floor * peak) * (step - warmup) / (total - warmup)


OPT = MICRO["optim"]
SCHED = (OPT["lr"], OPT["warmup_steps"], OPT["schedule_steps"], OPT["floor"])  # of every run


def losses(run_dir: Path) -> dict[int, float]:
    recs, _ = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}


def events(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")[1]


def load_state(run_dir: Path, cfg, step: int | None = None) -> tuple[int, dict]:
    """(step, full train state) from a run's checkpoints (newest valid one by default)."""
    target = jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))
    ck = Checkpointer(run_dir / "checkpoints")
    if step is None:
        step, state, _ = ck.restore_latest(target)
    else:
        state, _ = ck.restore(step, target)
    return step, state


def assert_trees_equal(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                      err_msg=jax.tree_util.keystr(path))


def quiet_train(cfg, run_dir: Path) -> dict:
    return train(cfg, run_dir, verbose=False, sample_prompt=None)


# ---------------------------------------------------------------------------------------------
# LR schedule and weight-decay mask (no training)

SCHEDULES = [  # (peak, warmup, total, floor)
    (3e-3, 10, 100, 0.05),
    (1e-3, 1, 12, 0.1),
    (5e-4, 7, 50, 0.0),
    (2e-3, 4, 5, 1.0),  # floor 1 = constant after warmup
]


@pytest.mark.parametrize("peak, warmup, total, floor", SCHEDULES)
def test_lr_at_matches_the_formula_at_every_step(peak, warmup, total, floor):
    steps = np.arange(0, total + 30)
    want = np.array([expected_lr(int(s), peak, warmup, total, floor) for s in steps])
    got_scalar = np.array([float(lr_at(int(s), peak, warmup, total, floor)) for s in steps])
    np.testing.assert_allclose(got_scalar, want, rtol=1e-6, atol=1e-12)
    # the same schedule on a traced array (as inside optax / the jitted step)
    got_traced = np.asarray(jax.jit(lambda s: lr_at(s, peak, warmup, total, floor))(
        jnp.asarray(steps, jnp.int32)))
    np.testing.assert_allclose(got_traced, want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("peak, warmup, total, floor", SCHEDULES)
def test_lr_schedule_shape(peak, warmup, total, floor):
    lr = lambda s: float(lr_at(s, peak, warmup, total, floor))  # noqa: E731
    assert lr(warmup - 1) == pytest.approx(peak, rel=1e-6)  # peak reached at the end of warmup
    assert lr(0) == pytest.approx(peak / warmup, rel=1e-6)
    warm = [lr(s) for s in range(warmup)]
    assert all(b > a for a, b in zip(warm, warm[1:]))  # strictly rising during warmup
    decay = [lr(s) for s in range(warmup, total + 1)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # never rising after warmup
    assert lr(total) == pytest.approx(floor * peak, rel=1e-6, abs=1e-12)  # exactly the floor
    for s in (total + 1, total + 10, 10 * total):
        assert lr(s) == pytest.approx(floor * peak, rel=1e-6, abs=1e-12)  # flat afterwards
    if floor < 1 and total - warmup >= 2:
        assert lr(total - 1) > floor * peak * (1 + 1e-6)  # not reached early


def test_optimizer_uses_the_schedule():
    """One adamw step with a unit gradient moves a parameter by about lr_at(0)."""
    peak, warmup, total = 1e-2, 4, 20
    opt = make_optimizer(OptimConfig(lr=peak, weight_decay=0.0), warmup, total)
    params = {"blocks": {"w": jnp.zeros((2, 3))}}
    state = opt.init(params)
    moved = []
    for _ in range(6):
        updates, state = opt.update({"blocks": {"w": jnp.ones((2, 3))}}, state, params)
        moved.append(-float(updates["blocks"]["w"][0, 0]))
    want = [expected_lr(s, peak, warmup, total, 0.05) for s in range(6)]
    np.testing.assert_allclose(moved, want, rtol=1e-4)


def test_bf16_moments_are_stored_in_bf16_and_updated_in_fp32():
    """optim.moment_dtype=bfloat16: AdamW's moments are kept in bfloat16 (the step counter
    stays an integer); each update is computed in float32 from them, so the first step equals
    the float32 optimizer's exactly and later ones stay within bfloat16's rounding of it."""
    f32 = make_optimizer(OptimConfig(lr=1e-2), 2, 50)
    bf16 = make_optimizer(OptimConfig(lr=1e-2, moment_dtype="bfloat16"), 2, 50)
    params = {"head": jnp.ones((8, 16)), "blocks": {"attn_norm": jnp.ones((2, 8))}}
    s32, s16 = f32.init(params), bf16.init(params)
    leaves = jax.tree.leaves(s16)
    floating = {a.dtype for a in leaves if jnp.issubdtype(a.dtype, jnp.floating)}
    assert floating == {jnp.dtype(jnp.bfloat16)}
    assert {a.dtype for a in leaves} - floating == {jnp.dtype(jnp.int32)}  # the step counters
    p32 = p16 = params
    for i, key in enumerate(jax.random.split(jax.random.PRNGKey(0), 20)):
        g = jax.tree.map(lambda a, k=key: jax.random.normal(k, a.shape), params)
        u32, s32 = f32.update(g, s32, p32)
        u16, s16 = bf16.update(g, s16, p16)
        if i == 0:
            for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(u16)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        p32, p16 = optax.apply_updates(p32, u32), optax.apply_updates(p16, u16)
    assert {a.dtype for a in jax.tree.leaves(s16) if a.ndim} == {jnp.dtype(jnp.bfloat16)}
    moved = np.abs(np.asarray(p32["head"]) - 1.0)  # 20 steps of up to lr each
    gap = np.abs(np.asarray(p32["head"]) - np.asarray(p16["head"]))
    # rounded (not float32 under another name), within 3% of the distance travelled
    assert moved.mean() > 0.02 and 0 < gap.max() < 0.03 * moved.mean(), (moved.mean(), gap.max())


@pytest.mark.parametrize("field,value,named", [("optim.moment_dtype", "float16", "moment_dtype"),
                                               ("optim.b2", 0.999, "optim.b2"),
                                               ("optim.b2", 0.96, "optim.b2"),
                                               ("optim.b1", 0.99, "optim.b1")])
def test_bf16_moments_refuse_what_they_cannot_track(field, value, named):
    """bfloat16 moments need decays of at most 0.95 (the tested one): above, a stored moment can
    stall further from its target, 39% at 0.99."""
    over = {"moment_dtype": "bfloat16", field.split(".")[1]: value}
    with pytest.raises(ConfigError, match=named):
        OptimConfig(**over).validate()
    if field != "optim.moment_dtype":  # the same decay is fine with float32 moments
        OptimConfig(**{**over, "moment_dtype": "float32"}).validate()


def test_decay_mask_excludes_norms_and_embedding():
    cfg = micro_config(Path("/nonexistent"), model={"latent_dim": 16})  # adds lat_norm too
    params = jax.eval_shape(lambda: tr.init_params(cfg.model, jax.random.PRNGKey(0)))
    mask = decay_mask(params)
    assert mask["embed"] is False
    assert mask["final_norm"] is False
    for name in ("attn_norm", "moe_norm", "lat_norm"):  # 2-D (stacked) but still norms
        assert params["blocks"][name].ndim == 2
        assert mask["blocks"][name] is False, name
    assert mask["head"] is True
    for name in ("wq", "wk", "wv", "wo", "router", "w_gate", "w_up", "w_down", "sh_gate",
                 "sh_up", "sh_down", "lat_down", "lat_up"):
        assert mask["blocks"][name] is True, name


def test_weight_decay_applies_only_to_masked_leaves():
    cfg = micro_config(Path("/nonexistent"), optim={"weight_decay": 0.5, "lr": 0.1})
    opt = make_optimizer(cfg.optim, warmup=1, total=10)
    params = {"embed": jnp.ones((4, 3)), "final_norm": jnp.ones(3), "head": jnp.ones((3, 4)),
              "blocks": {"attn_norm": jnp.ones((2, 3)), "wq": jnp.ones((2, 3, 3))}}
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    for leaf in (new["embed"], new["final_norm"], new["blocks"]["attn_norm"]):
        np.testing.assert_array_equal(np.asarray(leaf), 1.0)
    for leaf in (new["head"], new["blocks"]["wq"]):
        np.testing.assert_allclose(np.asarray(leaf), 1.0 - 0.1 * 0.5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# a shared 30-step run: learning, metrics log, summary


@pytest.fixture(scope="module")
def run30(tmp_path_factory, data_dir):  # noqa: F811
    return shared_run(tmp_path_factory, data_dir)


def test_training_reduces_the_loss(run30, data_dir):  # noqa: F811
    run, summary = run30
    loss = losses(run)
    assert sorted(loss) == list(range(1, 31))
    first, last = np.mean([loss[s] for s in range(1, 6)]), np.mean([loss[s] for s in range(26, 31)])
    assert first == pytest.approx(math.log(512), abs=0.5)  # starts near uniform over the vocab
    assert last < first - 0.5, (first, last)
    # held-out loss fell as well, in every domain, between the step-10 and the final evaluation
    recs = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")[0]}
    for d in DOMAINS:
        assert recs[30][f"eval/{d}/loss"] < recs[10][f"eval/{d}/loss"]
        assert summary[f"eval/{d}/loss"] < math.log(512) - 0.5


def test_metrics_log_has_the_expected_keys(run30):
    run, _ = run30
    recs, evs = read_metrics(run / "metrics.jsonl")
    train_keys = ["train/loss", "train/z_loss", "train/grad_norm", "train/lr",
                  "throughput/tokens_per_s", "throughput/mfu", "train/tokens",
                  "moe/drop_fraction", "moe/load_max_over_mean", "moe/routing_entropy",
                  "moe/layer_0/load_max_over_mean", "moe/layer_1/load_max_over_mean",
                  "moe/layer_0/routing_entropy"]
    by_step = {r["step"]: r for r in recs}
    # step 1 ends the compile that the clock leaves out: no rate yet, so none is logged (a 0
    # would chart as a dip); every later step has one
    assert not any(k.startswith("throughput/") for k in by_step[1])
    for step in range(1, 31):  # log_every=1
        r = by_step[step]
        for k in train_keys if step > 1 else [k for k in train_keys if "throughput" not in k]:
            assert k in r, (step, k)
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (step, k, r[k])
        assert r["train/tokens"] == step * 4 * 32
        assert r["moe/load_max_over_mean"] >= 1.0
        assert 0.0 <= r["moe/routing_entropy"] <= math.log(4) + 1e-5
        assert r["moe/drop_fraction"] == 0.0
        assert r["train/grad_norm"] > 0
    assert by_step[30]["throughput/tokens_per_s"] > 0 and by_step[30]["throughput/mfu"] > 0
    # evaluations: at eval_every=10 (not at the last step: the final one covers it) and at the end
    for step in (10, 20, 30):
        for d in DOMAINS:
            for kind in ("loss", "bpb"):
                v = by_step[step][f"eval/{d}/{kind}"]
                assert math.isfinite(v) and v > 0
    assert not any(k.startswith("eval/") for k in by_step[15])
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "start" and kinds[-1] == "finished"
    assert evs[-1]["step"] == 30
    assert (evs[0]["devices"], evs[0]["processes"]) == (1, 1)  # what it trained on


def documented_metrics() -> set[str]:
    """The keys the README's list of metric keys names (with their <i>, <domain>, ...)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    para = text[text.index("Metric keys follow"):]  # up to W&B's own x-axis, train/step
    return set(re.findall(r"`((?:train|data|throughput|moe|eval|hw)/[^`]+)`",
                          para[:para.index("`train.wandb=true`")]))


def test_every_logged_metric_is_documented_and_every_documented_one_logged(run30):
    """`train/total_loss` and `train/tokens` were logged in every record and named nowhere."""
    run, _ = run30
    named = documented_metrics()
    logged = {k for r in read_metrics(run / "metrics.jsonl")[0] for k in r} - {"step", "time"}

    def is_named(key: str) -> bool:
        if key.startswith("hw/"):
            return "hw/..." in named  # listed one by one in docs/lab.md
        if m := re.fullmatch(r"moe/layer_\d+/(.+)", key):
            return "moe/layer_<i>/..." in named and f"moe/{m[1]}" in named
        return re.sub(r"^eval/[^/]+/", "eval/<domain>/", key) in named

    assert not sorted(k for k in logged if not is_named(k))
    # the share of the measured peak: none here, where train.peak_flops is given
    plain = {k for k in named if "<" not in k and "..." not in k}
    assert plain - logged == {"throughput/share_of_measured_peak"}


def test_logged_lr_follows_the_schedule(run30):
    run, _ = run30
    recs, _ = read_metrics(run / "metrics.jsonl")
    assert SHARED_RUN_TRAIN["steps"] > OPT["schedule_steps"]  # runs on past the schedule's end
    lr = {r["step"]: r["train/lr"] for r in recs}
    for step, got in lr.items():
        # the LR logged at step s is the one used by the s-th update (schedule index s-1)
        assert got == pytest.approx(expected_lr(step - 1, *SCHED), rel=1e-6)
    peak, warmup, total, floor = SCHED
    assert lr[1] == pytest.approx(peak / warmup, rel=1e-6)
    assert lr[warmup] == pytest.approx(peak, rel=1e-6)
    for step in range(total + 1, 31):  # flat at the floor after schedule_steps
        assert lr[step] == pytest.approx(floor * peak, rel=1e-6)


def test_run_folder_and_summary(run30):
    run, summary = run30
    for name in ("config.yaml", "tokenizer.json", "provenance.json", "metrics.jsonl",
                 "summary.json"):
        assert (run / name).is_file(), name
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["step"] == on_disk["steps"] == 30
    assert on_disk["interrupted"] is None
    assert on_disk["tokens_trained"] == 30 * 128
    assert on_disk["params_active"] < on_disk["params_total"]
    for d in DOMAINS:
        assert math.isfinite(on_disk[f"eval/{d}/bpb"])
    assert on_disk["sample"].startswith("The ") and len(on_disk["sample"]) > len("The ")
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["config_hash"] == on_disk["config_hash"]
    assert Checkpointer(run / "checkpoints").steps() == [10, 20, 30]


def test_sigmoid_router_bias_moves_during_training(run30, data_dir):  # noqa: F811
    run, _ = run30
    cfg = micro_config(data_dir, train=SHARED_RUN_TRAIN)
    biases = [np.asarray(load_state(run, cfg, s)[1]["model_state"]["router_bias"])
              for s in (10, 20, 30)]
    for b in biases:
        assert b.shape == (2, 4)
        assert np.abs(b).max() > 0  # moved away from its zero init
        np.testing.assert_allclose(b.mean(axis=-1), 0.0, atol=1e-6)  # mean-centred per layer
    assert not np.array_equal(biases[0], biases[1])
    assert not np.array_equal(biases[1], biases[2])


# ---------------------------------------------------------------------------------------------
# exact resume

RESUME = {"optim": {"schedule_steps": 12}, "train": {"steps": 12, "ckpt_every": 4}}


def resume_cfg(data_dir: Path, steps: int = 12, **train_extra):  # noqa: F811
    return micro_config(data_dir, optim=RESUME["optim"],
                        train={**RESUME["train"], "steps": steps, **train_extra})


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, data_dir):  # noqa: F811
    """Run A: 12 steps at once. Run B: 6 steps, then again to 12 in the same folder."""
    root = tmp_path_factory.mktemp("resume")
    a, b = root / "A", root / "B"
    summary_a = quiet_train(resume_cfg(data_dir), a)
    summary_b1 = quiet_train(resume_cfg(data_dir, steps=6), b)
    b_after_6 = {"losses": losses(b), "events": events(b),
                 "ckpts": Checkpointer(b / "checkpoints").steps(),
                 # read now: the resume's pruning keeps the periodic 4 and 8 before the stop's 6
                 "router_bias": np.asarray(load_state(b, resume_cfg(data_dir, steps=6), 6)[1][
                     "model_state"]["router_bias"])}
    summary_b2 = quiet_train(resume_cfg(data_dir), b)
    return {"A": a, "B": b, "summary_a": summary_a, "summary_b1": summary_b1,
            "summary_b2": summary_b2, "b_after_6": b_after_6}


def test_resume_gives_identical_losses_and_params(resume_runs, data_dir):  # noqa: F811
    a, b = resume_runs["A"], resume_runs["B"]
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, 13))
    assert sorted(lb) == list(range(1, 13))
    for s in range(1, 13):
        assert lb[s] == la[s], (s, la[s], lb[s])  # exact float equality
    assert resume_runs["b_after_6"]["ckpts"] == [4, 6]
    assert Checkpointer(a / "checkpoints").steps() == [4, 8, 12]
    cfg = resume_cfg(data_dir)
    sa, state_a = load_state(a, cfg)
    sb, state_b = load_state(b, cfg)
    assert sa == sb == 12
    assert_trees_equal(state_a, state_b)  # params, optimizer state, router bias, step
    assert int(state_a["step"]) == 12
    kinds = [(e["event"], e["step"]) for e in events(b)]
    assert ("resume", 6) in kinds and kinds[-1] == ("finished", 12)
    assert resume_runs["summary_b2"]["step"] == 12
    assert resume_runs["summary_b2"]["train/loss"] == resume_runs["summary_a"]["train/loss"]


def test_resume_with_bf16_moments_is_exact(tmp_path, data_dir):  # noqa: F811
    """bfloat16 moments (optim.moment_dtype) go through a checkpoint as they are: a run stopped
    at step 4 and resumed ends bit for bit where an uninterrupted one does, its moments still
    bfloat16."""
    def cfg(steps):
        return micro_config(data_dir, optim={**RESUME["optim"], "moment_dtype": "bfloat16"},
                            train={**RESUME["train"], "steps": steps})

    a, b = tmp_path / "A", tmp_path / "B"
    quiet_train(cfg(8), a)
    quiet_train(cfg(4), b)
    quiet_train(cfg(8), b)
    assert sorted(losses(b)) == list(range(1, 9)) and losses(b) == losses(a)  # exact
    (sa, state_a), (sb, state_b) = load_state(a, cfg(8)), load_state(b, cfg(8))
    assert sa == sb == 8
    assert_trees_equal(state_a, state_b)
    moments = {x.dtype for x in jax.tree.leaves(state_b["opt_state"]) if x.ndim}
    assert moments == {jnp.dtype(jnp.bfloat16)}


def test_stopping_before_the_schedule_end_keeps_the_lr_above_floor(resume_runs):
    """train.steps=6 < optim.schedule_steps=12: the run stops mid-schedule."""
    b6 = resume_runs["b_after_6"]
    assert resume_runs["summary_b1"]["step"] == 6
    recs, _ = read_metrics(resume_runs["A"] / "metrics.jsonl")
    lr_a = {r["step"]: r["train/lr"] for r in recs}
    recs_b, _ = read_metrics(resume_runs["B"] / "metrics.jsonl")
    lr_b = {r["step"]: r["train/lr"] for r in recs_b}
    peak, _, total, floor = SCHED
    assert total == 12
    assert lr_b[6] == pytest.approx(expected_lr(5, *SCHED), rel=1e-6)
    assert lr_b[6] > floor * peak * 1.5
    assert lr_b[6] == lr_a[6]  # the same schedule as the run that went on to step 12
    assert lr_a[12] == pytest.approx(expected_lr(11, *SCHED), rel=1e-6)
    assert max(b6["losses"]) == 6


def test_router_bias_is_restored_on_resume(resume_runs, data_dir):  # noqa: F811
    cfg = resume_cfg(data_dir)
    bias6 = resume_runs["b_after_6"]["router_bias"]
    assert np.abs(bias6).max() > 0  # the bias moved in the first invocation
    _, a12 = load_state(resume_runs["A"], cfg, 12)
    _, b12 = load_state(resume_runs["B"], cfg, 12)
    bias_a, bias_b = (np.asarray(s["model_state"]["router_bias"]) for s in (a12, b12))
    assert not np.array_equal(bias_a, bias6)
    # B continued from its step-6 bias: were it reset to zero on resume, six more sign steps of
    # +-0.01 from zero could not land on A's twelve-step bias.
    np.testing.assert_array_equal(bias_b, bias_a)
    # and the bias change from 6 to 12 is a sum of six mean-centred sign steps of size 0.01
    assert np.abs(bias_b - bias6).max() <= 6 * 0.01 * 2 + 1e-6


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(resume_runs, data_dir,  # noqa: F811
                                                                  tmp_path, capsys):
    run = tmp_path / "damaged"
    shutil.copytree(resume_runs["A"], run)
    newest = run / "checkpoints" / "step_00000012"
    files = sorted((p for p in (newest / "state").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
    victim = files[-1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    n_events = len(events(run))

    with pytest.warns(CheckpointWarning, match="step 12"):
        summary = quiet_train(resume_cfg(data_dir, tensorboard=True), run)
    err = capsys.readouterr().err
    assert "WARNING" in err and "step_00000012" in err

    new_events = events(run)[n_events:]
    assert (new_events[0]["event"], new_events[0]["step"]) == ("resume", 8)
    # TensorBoard hides an earlier start's steps from 9, the first trained again (not from 13)
    assert [e.step for e in tb_events(run / "tensorboard") if e.HasField("session_log")] == [9]
    assert summary["step"] == 12
    la, lr = losses(resume_runs["A"]), losses(run)
    for s in range(9, 13):  # retrained from step 8: the same losses as the original run
        assert lr[s] == la[s], s
    # the damaged step-12 checkpoint was replaced by a good one, equal to the original run's
    cfg = resume_cfg(data_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        step, state = load_state(run, cfg)
    assert step == 12
    assert_trees_equal(state, load_state(resume_runs["A"], cfg, 12)[1])


def test_changing_a_non_resumable_field_is_refused(resume_runs, data_dir):  # noqa: F811
    a = resume_runs["A"]
    saved = (a / "config.yaml").read_text()
    n_lines = len((a / "metrics.jsonl").read_text().splitlines())
    bad = micro_config(data_dir, optim=RESUME["optim"], train=RESUME["train"],
                       model={"d_model": 64})
    with pytest.raises(ConfigError) as e:
        train(bad, a, verbose=False, sample_prompt=None)
    msg = str(e.value)
    assert msg.startswith("model.d_model:")
    assert "32" in msg and "64" in msg and str(a) in msg
    # nothing in the run folder was touched
    assert (a / "config.yaml").read_text() == saved
    assert len((a / "metrics.jsonl").read_text().splitlines()) == n_lines

    for section, field, value in (("optim", "lr", 0.02), ("data", "seed", 3),
                                  ("optim", "schedule_steps", 24), ("train", "seed", 1),
                                  ("data", "mixture", {"prose": 1.0})):
        d = micro_dict(data_dir, optim=RESUME["optim"], train=RESUME["train"])
        d[section][field] = value
        with pytest.raises(ConfigError, match=rf"^{section}\.{field}:"):
            resolve_run_config(config_from_dict(d), a)
    # the moments' dtype is no new model: its refusal says why it is kept
    d = micro_dict(data_dir, optim={**RESUME["optim"], "moment_dtype": "bfloat16"},
                   train=RESUME["train"])
    with pytest.raises(ConfigError, match=r"^optim\.moment_dtype: .* hold the optimizer's "
                       r"moments in the dtype it started with, .* in a new --run-dir"):
        resolve_run_config(config_from_dict(d), a)


def test_resumable_fields_may_change(resume_runs, data_dir):  # noqa: F811
    cfg = resume_cfg(data_dir, steps=40, log_every=5, eval_every=7, ckpt_every=9, keep_ckpts=2,
                     eval_tokens=128, peak_flops=2e12, wandb=True, wandb_project="other")
    own = dataclasses.replace(cfg.data, sampler="epoch")  # not given: the run's own, written out
    assert resolve_run_config(cfg, resume_runs["A"]) == dataclasses.replace(cfg, data=own)
    # how the layer scan is compiled: the same parameters and values
    unrolled = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_unroll=2))
    assert resolve_run_config(unrolled, resume_runs["A"]).model.scan_unroll == 2


def test_the_transport_and_its_capacities_may_change_on_resume(resume_runs, data_dir):  # noqa: F811
    """A move to EP 8 that needs waves=1 was refused (parallel.waves "trains one model"), and so
    was a higher receiver_cf against drops: they set drops, as parallel.expert does, not the
    model."""
    cfg = resume_cfg(data_dir, steps=40)
    par = dataclasses.replace(cfg.parallel, transport="pooled_global", receiver_cf=1.5, waves=1,
                              sender_cf=1.3, global_sender_cf=1.75, capacity_factor=2.0,
                              budget_group=1, fair_blocks=2)
    moved = dataclasses.replace(cfg, parallel=par)
    assert resolve_run_config(moved, resume_runs["A"]).parallel == par


# ---------------------------------------------------------------------------------------------
# SIGTERM in a `moelab train` subprocess, then resume


def test_sigterm_saves_a_checkpoint_and_resume_matches_a_reference(data_dir, tmp_path):  # noqa: F811
    cfg_dict = micro_dict(data_dir, optim=RESUME["optim"],
                          train={"steps": 100_000, "ckpt_every": 1000})
    cfg_yaml = write_config_yaml(tmp_path / "sigterm.yaml", cfg_dict)
    run = tmp_path / "runs" / "interrupted"
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moelab.cli", "train", str(cfg_yaml), "--run-dir", str(run)],
        cwd=tmp_path, env=subprocess_env(), stdout=out, stderr=err)
    try:
        deadline = time.time() + 240
        while True:
            recs, _ = read_metrics(run / "metrics.jsonl")
            if recs and recs[-1]["step"] >= 3:
                break
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.time() < deadline, "the training subprocess never reached step 3"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == 143, stderr[-3000:]
    assert "SIGTERM received" in stderr

    summary = json.loads((run / "summary.json").read_text())
    stop = summary["step"]
    assert summary["interrupted"] == "SIGTERM"
    assert 3 <= stop < 100_000
    ckpts = Checkpointer(run / "checkpoints").steps()
    assert ckpts[-1] == stop and all(c % 1000 == 0 for c in ckpts[:-1])  # ckpt_every=1000
    evs = events(run)
    assert (evs[-1]["event"], evs[-1]["step"], evs[-1]["signal"]) == ("interrupted", stop,
                                                                     "SIGTERM")
    assert not any(e["event"] == "finished" for e in evs)
    assert max(losses(run)) == stop  # the step it stopped at was logged
    assert "stopped by SIGTERM" in (tmp_path / "stdout.txt").read_text()

    # resume in-process to stop+3 (train.steps may change on resume) and compare with a
    # reference run of the same config that was never interrupted
    end = stop + 3
    cfg = resume_cfg(data_dir, steps=end, ckpt_every=1000)
    resumed = quiet_train(cfg, run)
    assert resumed["step"] == end and resumed["interrupted"] is None
    assert [(e["event"], e["step"]) for e in events(run)][-2:] == [("resume", stop),
                                                                   ("finished", end)]
    ref = tmp_path / "reference"
    quiet_train(cfg, ref)
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, end + 1))
    for s in range(stop + 1, end + 1):
        assert got[s] == want[s], (s, got[s], want[s])
    for s in range(1, stop + 1):  # the interrupted process trained the same steps, too
        assert got[s] == want[s], (s, got[s], want[s])
    assert_trees_equal(load_state(run, cfg)[1], load_state(ref, cfg)[1])


# ---------------------------------------------------------------------------------------------
# W&B (offline)


def test_wandb_offline_run_is_written_inside_the_run_dir(data_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    run = tmp_path / "wb_run"
    summary = quiet_train(resume_cfg(data_dir, steps=2, wandb=True), run)
    assert summary["step"] == 2
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert offline, sorted(p.name for p in run.rglob("*"))[:50]
    assert list(offline[0].glob("*.wandb")), sorted(p.name for p in offline[0].iterdir())
    assert sorted(losses(run)) == [1, 2]  # the JSONL log is still written


def test_extending_train_steps_does_not_silently_change_the_schedule(data_dir, tmp_path):  # noqa: F811
    """With optim.schedule_steps=0 the LR schedule length *is* train.steps. train.steps counts
    as resumable ("does not change what is being trained"), so resuming a 6-step run with
    train.steps=12 keeps the 6-step schedule the run was trained with: silently re-timing the
    schedule makes the LR jump back up mid-run."""
    first = micro_config(data_dir, optim={"schedule_steps": 0, "warmup_steps": 0},
                         train={"steps": 6})
    assert first.optim.schedule_steps == 0 and first.schedule_steps == 6
    quiet_train(first, tmp_path)  # leaves config.yaml and checkpoints in the run folder
    longer = micro_config(data_dir, optim={"schedule_steps": 0, "warmup_steps": 0},
                          train={"steps": 12})
    resolved = resolve_run_config(longer, tmp_path)
    assert resolved.schedule_steps == 6 and resolved.train.steps == 12, (
        f"resume re-timed the LR schedule from 6 to {resolved.schedule_steps} steps")


def test_a_resume_says_what_it_changes(data_dir, tmp_path, capsys):  # noqa: F811
    """Settings a resume may change (here the stop step and the log interval, as re-running a
    preset with its own defaults would) are said in the resuming line and kept in the log's
    resume event; steps past the LR schedule's end are said to train at the floor LR."""
    from moelab.run.logs import read_metrics
    from moelab.train.loop import train

    optim = {"schedule_steps": 0, "warmup_steps": 0}  # the schedule follows train.steps: 2
    quiet_train(micro_config(data_dir, optim=optim, train={"steps": 2, "log_every": 1}), tmp_path)
    capsys.readouterr()
    summary = train(micro_config(data_dir, optim=optim, train={"steps": 4, "log_every": 2}),
                    tmp_path, sample_prompt=None)
    err = capsys.readouterr().err
    from moelab.train.tracker import format_summary

    per_step = summary["tokens_trained"] // 4  # the summary tells this start's share apart
    assert f"tokens trained   {4 * per_step:,} in all; {2 * per_step:,} from step 2 in " in \
        format_summary(summary)
    changed = ["train.log_every 1 -> 2", "train.steps 2 -> 4"]
    assert (f"resuming {tmp_path} from step 2, with 2 setting(s) changed from its config.yaml: "
            + "; ".join(changed)) in err
    assert "note: its LR schedule ends at step 2, so steps 3-4 train at the floor LR" in err
    _, events = read_metrics(tmp_path / "metrics.jsonl")
    assert [e.get("changed") for e in events if e["event"] == "resume"] == [changed]
    # a replan's decay moves the floor's step: no note while it decays, then its end and floor
    from moelab.cli import main

    assert main(["replan", str(tmp_path), "--end-steps", "6", "--floor", "0.1", "--apply"]) == 0
    capsys.readouterr()
    assert main(["resume", str(tmp_path)]) == 0
    assert "note: its LR schedule" not in capsys.readouterr().err
    assert main(["resume", str(tmp_path), "train.steps=7"]) == 0
    assert ("note: its LR schedule ends at step 6, so step 7 trains at the floor LR (0.1 x "
            "peak)") in capsys.readouterr().err


def test_a_run_folder_without_checkpoints_may_restart_with_another_config(data_dir, tmp_path):  # noqa: F811
    """A first attempt that failed before any checkpoint trained nothing: a corrected config
    (here another width) may reuse the folder instead of being refused."""
    from moelab.config import save_config

    save_config(micro_config(data_dir), tmp_path / "config.yaml")
    wider = micro_config(data_dir, model={"d_model": 48})
    assert resolve_run_config(wider, tmp_path).model.d_model == 48


def test_drops_are_on_the_progress_line_and_in_the_summary_where_routes_can_drop():
    """Half of all routes dropped showed only in metrics.jsonl: the progress line and the
    summary now say the dropped share where the training transport can drop."""
    from moelab.config import load_config
    from moelab.train.step import drops_text
    from moelab.train.tracker import format_summary

    m = {"moe/drop_fraction": 0.5194, "moe/sender_drop_fraction": 0.2823,
         "moe/receiver_drop_fraction": 0.2371}
    ep4 = load_config("tiny", ["parallel.devices=8", "parallel.expert=4",
                              "parallel.transport=pooled_wave"])
    assert drops_text(ep4, m) == "51.9% (sender 28.2%, receiver 23.7%)"
    assert drops_text(load_config("tiny"), m) == ""  # EP 1: dropless, nothing to say
    # the dropless ragged exchange drops none; rows carried by its later rounds are said
    ragged = load_config("tiny", ["parallel.devices=8", "parallel.expert=4",
                                 "parallel.transport=ragged"])
    assert drops_text(ragged, {**m, "moe/late_fraction": 0.0}) == ""
    assert drops_text(ragged, {"moe/late_fraction": 0.031}) == "none (3.1% of rows in later rounds)"
    s = {"run_dir": "r", "step": 3, "steps": 3, "interrupted": None, "params_total": 1e6,
         "params_active": 5e5, "tokens_trained": 10, "wall_time_s": 1.0,
         "drops": drops_text(ep4, m)}
    assert ("  routes dropped   51.9% (sender 28.2%, receiver 23.7%) at the last logged step"
            in format_summary(s))
    # the gzip line reads as model vs gzip (it read "gzip -9 model 3.206 vs gzip 3.195")
    s.update({"eval/prose/loss": 2.0, "eval/prose/bpb": 3.2056,
              "baseline/prose/gzip9_bpb": 3.1947})
    assert format_summary(s).endswith("\n  prose vs gzip   model 3.206, gzip -9 3.195 bits/byte: "
                                      "the model does NOT beat gzip")


def test_rows_of_later_ragged_rounds_are_a_metric_overall_not_per_layer():
    import jax.numpy as jnp

    from moelab.model.experts import DropCounts
    from moelab.train.step import router_metrics

    zero = jnp.zeros(2, jnp.int32)
    drops = DropCounts.of(jnp.array([400, 400]), zero, zero, jnp.array([0, 100]))  # 2 layers
    m = router_metrics({"load_LE": jnp.ones((2, 4)), "entropy_L": jnp.ones(2), "drops_L": drops})
    assert float(m["moe/late_fraction"]) == 0.125 and float(m["moe/drop_fraction"]) == 0.0
    assert not [k for k in m if k.startswith("moe/layer_") and "late" in k]


def _held_up(monkeypatch) -> None:
    """Each train step held up on the device by a second (a callback), so the loop runs ahead
    of it and the steps are surely queued."""
    import time

    import moelab.train.loop as loop

    delay = jax.jit(lambda s: {**s, "step": jax.pure_callback(
        lambda x: (time.sleep(1.0), x)[1], jax.ShapeDtypeStruct((), s["step"].dtype),
        s["step"])})
    step_at = loop.train_step_at
    monkeypatch.setattr(loop, "train_step_at", lambda run, step: (
        lambda state, batch: (lambda out: (delay(out[0]), out[1]))(
            step_at(run, step)(state, batch))))


def test_a_save_between_logged_steps_starts_its_pause_once_the_steps_are_done(
        tmp_path, data_dir, monkeypatch):  # noqa: F811
    """Throughput is tokens over the time off pauses. A save at a step that logs nothing began
    its pause while the steps before it were still queued on the device, so their compute
    counted as paused (38,585 tok/s and 122% MFU shown for 3,100 on a CPU, with
    train.ckpt_every=4): the state a save reads is ready before its pause starts. The device
    is held up here by a second per step, in a callback, so the steps are surely queued."""
    import moelab.train.loop as loop

    _held_up(monkeypatch)
    ready, save = [], loop._save
    monkeypatch.setattr(loop, "_save", lambda run, p, wait=True: (
        ready.append(all(x.is_ready() for x in jax.tree.leaves(p.state))), save(run, p, wait)))
    quiet_train(resume_cfg(data_dir, steps=5, ckpt_every=2, log_every=5), tmp_path / "run")
    assert ready[:2] == [True, True], ready  # steps 2 and 4 (then the final save at 5)


def test_a_trace_starts_and_stops_once_the_steps_are_done(tmp_path, data_dir,  # noqa: F811
                                                         monkeypatch):
    """Starting a trace waits for the steps before it, stopping it for the traced ones: both
    waits counted as paused, so the traced steps' compute was off the clock (tiny,
    train.profile_steps=10:14: 14,165 tok/s shown for 9,022). They wait on the clock now."""
    from moelab.train.profile import StepTracer

    _held_up(monkeypatch)
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **kw: None)  # nothing written
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    seen = []
    for name, acts in (("before", StepTracer.starts_at), ("after", StepTracer.stops_at)):
        def watched(self, step, state, real=getattr(StepTracer, name), acts=acts, name=name):
            if acts(self, step):
                seen.append((name, step, all(x.is_ready() for x in jax.tree.leaves(state))))
            return real(self, step, state)
        monkeypatch.setattr(StepTracer, name, watched)
    quiet_train(resume_cfg(data_dir, steps=5, ckpt_every=10, log_every=5,
                           profile_steps="3:5"), tmp_path / "run")
    assert seen == [("before", 3, True), ("after", 4, True)], seen
