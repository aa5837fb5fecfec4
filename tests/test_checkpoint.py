"""Tests for moelab.run.checkpoint: exact round trips, pruning, damage fallback, crash leftovers."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
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

from moelab.run.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    orbax_manager_options,
)
from moelab.run.ckpt_failures import quiet_closed_loop_reports

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------- helpers


_OPT = optax.adamw(1e-2, weight_decay=0.1)


@jax.jit
def _adamw_state_after_one_update(params):
    opt_state = _OPT.init(params)
    grads = jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32)) * 0.3).astype(p.dtype), params)
    _, opt_state = _OPT.update(grads, opt_state, params)
    return opt_state


def make_state(seed: int, *, d: int = 32, n_exp: int = 4) -> dict:
    """A small but realistic train state: params (f32 + bf16), adamw state after one update,
    router state, a raw uint32 rng key and a couple of numpy leaves.

    Values come from numpy (device_put compiles nothing); the optax step is one jitted call, so
    building states is fast even where eager op-by-op dispatch is slow.
    """
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=jnp.float32):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    params = {
        "embed": normal(64, d),
        "blocks": [
            {
                "attn": normal(d, d, dtype=jnp.bfloat16),
                "moe": {"router": normal(d, n_exp), "experts": normal(n_exp, d, 2 * d, dtype=jnp.bfloat16)},
            }
        ],
    }
    return {
        "params": params,
        "opt_state": _adamw_state_after_one_update(params),
        "router": {
            "expert_load": jnp.asarray(np.arange(n_exp, dtype=np.int32) * (seed + 1)),
            "bias": normal(n_exp),
        },
        "rng": jnp.asarray(rng.integers(0, 2**32, size=2, dtype=np.uint32)),  # raw uint32 key data
        "step": jnp.asarray(np.int32(seed * 10)),
        "np_tokens_seen": np.array([seed, 2**40 + seed], dtype=np.int64),
        "np_u32": np.array([2**32 - 1, 0, 12345 + seed], dtype=np.uint32),
    }


def fresh_target() -> dict:
    """Same structure as make_state, different values (as after re-initialisation)."""
    return jax.tree.map(
        lambda x: np.zeros_like(x) if isinstance(x, np.ndarray) else jnp.asarray(np.zeros(x.shape, x.dtype)),
        make_state(99),
    )


def leaf_bytes(x) -> tuple:
    a = np.asarray(x)
    return a.dtype, a.shape, a.tobytes()


def assert_tree_exact(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert leaf_bytes(g) == leaf_bytes(w), jax.tree_util.keystr(path)


def trees_differ(a, b) -> bool:
    return any(leaf_bytes(x) != leaf_bytes(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def largest_file(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def damage(step_dir: Path, mode: str) -> None:
    state = step_dir / "state"
    if mode == "flip":  # silent bit rot in an array chunk: only the checksum notices
        f = largest_file(state)
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x5A
        f.write_bytes(bytes(b))
    elif mode == "truncate":
        f = largest_file(state)
        os.truncate(f, f.stat().st_size // 2)
    elif mode == "delete":
        largest_file(state).unlink()
    elif mode == "orbax_metadata":
        (state / "_METADATA").unlink()
    elif mode == "meta_json":
        (step_dir / "meta.json").write_text("{not json")
    elif mode == "manifest":
        (step_dir / "manifest.json").write_text('{"format": "moelab-checkpoint/1", "ste')
    else:
        raise ValueError(mode)


META = {"data": {"shard": 3, "offset": 123456}, "config": {"model": {"d_model": 32}}, "loss": 2.5, "tags": ["a", None]}


# ----------------------------------------------------------------------------- tests


def test_round_trip_exact(tmp_path):
    state = make_state(1)
    ck = Checkpointer(tmp_path / "ckpt", keep=3)
    path = ck.save(7, state, META)
    assert path == tmp_path / "ckpt" / "step_00000007" and (path / "meta.json").is_file()
    assert ck.steps() == [7]

    target = fresh_target()
    assert trees_differ(target, state)  # the assertions below can fail

    step, restored, meta = ck.restore_latest(target)
    assert step == 7
    assert meta == META
    assert_tree_exact(restored, state)
    # optax namedtuples survive, leaf kinds follow the target
    adam = restored["opt_state"][0]
    assert isinstance(adam, optax.ScaleByAdamState) and type(adam) is type(state["opt_state"][0])
    assert adam.mu["blocks"][0]["attn"].dtype == jnp.bfloat16
    assert int(adam.count) == 1
    assert restored["rng"].dtype == jnp.uint32 and isinstance(restored["rng"], jax.Array)
    assert isinstance(restored["np_tokens_seen"], np.ndarray) and restored["np_tokens_seen"][1] == 2**40 + 1
    jax.random.wrap_key_data(restored["rng"])  # still a usable key

    # abstract target (jax.eval_shape) works too; leaf kinds follow the target, not what was saved
    abstract = jax.eval_shape(lambda: {k: v for k, v in make_state(1).items() if not k.startswith("np_")})
    abstract["np_u32"] = jax.ShapeDtypeStruct((3,), jnp.uint32)  # saved as numpy, wanted as jax
    abstract["np_tokens_seen"] = np.zeros(2, np.int64)
    abstract["rng"] = np.zeros(2, np.uint32)  # saved as jax, wanted as numpy
    state2, meta2 = ck.restore(7, abstract)
    assert meta2 == META
    assert_tree_exact(state2, state)
    assert isinstance(state2["params"]["embed"], jax.Array)
    assert isinstance(state2["np_u32"], jax.Array) and isinstance(state2["rng"], np.ndarray)


def test_a_plain_orbax_checkpoint_manager_reads_them(tmp_path):
    """orbax's own CheckpointManager, with the options docs/operations.md gives, lists the
    committed steps (not a save in progress) and restores the state moelab restores."""
    import orbax.checkpoint as ocp

    ck = Checkpointer(tmp_path, keep=2)
    for s in (1, 2, 3):
        ck.save(s, make_state(s), META)
    (tmp_path / ".tmp-step_00000004.1.ab").mkdir()  # a save in progress
    documented = ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=8,
                                              read_only=True)
    _, want, _ = ck.restore_latest(fresh_target())
    for options in (documented, orbax_manager_options()):
        with ocp.CheckpointManager(tmp_path, options=options) as mngr:
            assert mngr.all_steps() == ck.steps() == [2, 3] and mngr.latest_step() == 3
            got = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        assert_tree_exact(got["state"]["params"], want["params"])
        assert_tree_exact(got["state"]["router"], want["router"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-step_00000004.1.ab", "step_00000002", "step_00000003"]  # nothing written


def test_partial_restore_reads_only_the_named_entries(tmp_path):
    """A reader names the entries it needs (params, router) without the optimizer state's
    structure; they are checked against the saved ones like a whole state."""
    state = make_state(1)
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(7, state, META)
    names = ("params", "router")
    target = jax.eval_shape(lambda: {k: make_state(99)[k] for k in names})
    step, got, meta = ck.restore_latest(target, partial=True)
    assert step == 7 and meta == META and sorted(got) == sorted(names)
    assert_tree_exact(got, {k: state[k] for k in names})
    assert isinstance(got["params"]["embed"], jax.Array)

    wrong = {**target, "params": {**target["params"], "embed": jax.ShapeDtypeStruct((65, 32), jnp.float32)}}
    with pytest.raises(CheckpointError, match=r"embed: checkpoint has \(64, 32\)"):
        ck.restore(7, wrong, partial=True)
    with pytest.raises(CheckpointError, match="not in checkpoint: \\['model_state"):
        ck.restore(7, {**target, "model_state": jax.ShapeDtypeStruct((2,), jnp.float32)}, partial=True)
    with pytest.raises(CheckpointError, match="in checkpoint but not in this config.s state"):
        ck.restore(7, target)  # without partial, a target must be the whole state


def test_no_checkpoints_and_dir_created_on_save(tmp_path):
    d = tmp_path / "does" / "not" / "exist"
    ck = Checkpointer(d)
    assert ck.steps() == [] and ck.restore_latest(fresh_target()) is None
    assert not d.exists()  # reading never creates anything
    d.mkdir(parents=True)
    assert ck.restore_latest(fresh_target()) is None
    with pytest.raises(CheckpointError, match="step 5"):
        ck.restore(5, fresh_target())
    ck.save(0, make_state(0), {})
    assert ck.steps() == [0]


def test_keep_last_n_and_overwrite(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    states = {s: make_state(s) for s in range(1, 6)}
    for s, st in states.items():
        ck.save(s, st, {"step": s})
    assert ck.steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    with pytest.raises(CheckpointError):
        ck.restore(3, fresh_target())
    got, meta = ck.restore(4, fresh_target())
    assert meta == {"step": 4}
    assert_tree_exact(got, states[4])

    # saving the same step again replaces it cleanly
    ck.save(5, states[1], {"step": 5, "again": True})
    assert ck.steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    step, got, meta = ck.restore_latest(fresh_target())
    assert step == 5 and meta == {"step": 5, "again": True}
    assert_tree_exact(got, states[1])


@pytest.mark.parametrize("mode", ["flip", "truncate", "delete", "orbax_metadata", "meta_json", "manifest"])
def test_damaged_newest_falls_back(tmp_path, capsys, mode):
    ck = Checkpointer(tmp_path, keep=3)
    s1, s2 = make_state(1), make_state(2)
    ck.save(10, s1, {"step": 10})
    ck.save(20, s2, {"step": 20})
    damage(tmp_path / "step_00000020", mode)
    capsys.readouterr()

    with pytest.warns(CheckpointWarning, match=r"step 20\b") as rec:
        res = ck.restore_latest(fresh_target())
    assert res is not None
    step, got, meta = res
    assert step == 10 and meta == {"step": 10}
    assert_tree_exact(got, s1)
    assert len(rec) == 1
    err = capsys.readouterr().err
    assert "step 20" in err and "unusable" in err


def test_target_mismatch_falls_back(tmp_path):
    """A newer checkpoint whose shapes do not fit the target (changed config) is skipped."""
    ck = Checkpointer(tmp_path)
    s1 = make_state(1)
    ck.save(1, s1, {})
    s2 = make_state(2)
    s2["params"]["embed"] = jnp.asarray(np.ones((64, 16), np.float32))  # e.g. d_model changed
    ck.save(2, s2, {})
    with pytest.warns(CheckpointWarning, match=r"step 2\b.*embed"):
        step, got, _ = ck.restore_latest(fresh_target())
    assert step == 1
    assert_tree_exact(got, s1)

    # a dtype change is a mismatch too (no silent casting)
    bad = fresh_target()
    bad["params"]["embed"] = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    with pytest.raises(CheckpointError, match="embed"):
        ck.restore(1, bad)


def test_all_damaged_raises(tmp_path):
    ck = Checkpointer(tmp_path)
    for s in (3, 4):
        ck.save(s, make_state(s), {})
    damage(tmp_path / "step_00000003", "truncate")
    damage(tmp_path / "step_00000004", "flip")
    with pytest.warns(CheckpointWarning), pytest.raises(RuntimeError, match=r"all 2 checkpoints") as exc:
        ck.restore_latest(fresh_target())
    assert "step 3" in str(exc.value) and "step 4" in str(exc.value)


def test_intact_checkpoints_of_another_config_are_named_not_called_unusable(tmp_path):
    """Files that pass their manifest but do not fit the state come from another config: the
    error says so, names the array and both shapes, and advises restoring the config -- never
    setting intact checkpoints aside. "Damaged" only when every one fails its manifest."""
    ck = Checkpointer(tmp_path)
    for s in (3, 4):
        ck.save(s, make_state(s, d=16), {})
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as exc:
        ck.restore_latest(fresh_target())
    msg = str(exc.value)
    assert "intact" in msg and "different config" in msg and "config.yaml" in msg, msg
    assert "params/embed: checkpoint has (64, 16) float32, this config's state has (64, 32)" in msg
    assert "unusable" not in msg and "move them away" not in msg and "damaged" not in msg

    damage(tmp_path / "step_00000003", "truncate")  # one damaged, one intact: still intact advice
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="intact") as exc:
        ck.restore_latest(fresh_target())
    assert "move them away" not in str(exc.value)

    damage(tmp_path / "step_00000004", "flip")  # every one damaged: a copy, or a new folder
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as exc:
        ck.restore_latest(fresh_target())
    msg = str(exc.value)
    assert "all 2 checkpoints" in msg and "damaged" in msg and "restore them from a copy" in msg
    assert "move them away" not in msg and "new --run-dir" in msg


def test_lease_rule_kills_and_age():
    """A lease holds while young and, on its own host, while its reader runs; prune skips it."""
    from moelab.run.ckpt_lease import LEASE_SECONDS, lease_live, prunable

    now, alive = 1000.0, {7}.__contains__
    lease = {"pid": 7, "host": "here", "time": now - 1}
    assert lease_live(lease, now, "here", alive)
    assert not lease_live({**lease, "pid": 8}, now, "here", alive)  # killed with kill -9
    assert lease_live({**lease, "pid": 8}, now, "there", alive)  # another host: by age alone
    assert not lease_live({**lease, "time": now - LEASE_SECONDS - 1}, now, "there", alive)
    assert not lease_live({**lease, "time": now + LEASE_SECONDS + 1}, now, "here", alive)
    assert not lease_live({"pid": "x"}, now, "here", alive)  # unreadable: no lease
    assert prunable([1, 2, 3, 4], 1, set()) == [1, 2, 3]
    assert prunable([1, 2, 3, 4], 1, {2, 4}) == [1, 3]
    assert prunable([1, 2], 3, {1}) == []
    # with the save interval: a stop's checkpoint (21) goes before the periodic ones once a
    # newer one exists; the newest always stays, whatever its step
    assert prunable([10, 20, 21, 30], 3, set(), every=10) == [21]
    assert prunable([10, 20, 21], 2, set(), every=10) == [10]
    assert prunable([10, 20, 30, 31], 2, set(), every=10) == [10, 20]
    assert prunable([10, 20, 21, 30], 3, set()) == [10]  # no interval: the oldest


def test_a_checkpoint_being_read_is_not_pruned_under_its_reader(tmp_path):
    """keep=1: the trainer saves (and prunes) while a reader reads the only checkpoint. The read
    succeeds, and the next save prunes what the reader held."""
    trainer, reader = Checkpointer(tmp_path, keep=1), Checkpointer(tmp_path, keep=1)
    trainer.save(1, make_state(1), {"step": 1})
    check = reader.check_folder

    def save_meanwhile(path, step):
        trainer.save(2, make_state(2), {"step": 2})  # the trainer's next checkpoint
        check(path, step)

    reader.check_folder = save_meanwhile
    step, got, meta = reader.restore_latest(fresh_target())
    assert step == 1 and meta == {"step": 1}
    assert_tree_exact(got, make_state(1))
    assert trainer.steps() == [1, 2]  # kept over keep=1 while read
    assert not list(tmp_path.glob(".read-*"))  # the lease ended with the read
    trainer.save(3, make_state(3), {"step": 3})
    assert trainer.steps() == [3]


def test_a_reader_that_loses_the_race_reads_the_newest(tmp_path):
    """The checkpoint vanishes under a reader anyway (pruned before its lease was seen): that
    is no damage, and the reader lists again and reads the newest."""
    trainer, reader = Checkpointer(tmp_path, keep=1), Checkpointer(tmp_path, keep=1)
    trainer.save(1, make_state(1), {"step": 1})
    check, calls = reader.check_folder, []

    def pruned_meanwhile(path, step):
        calls.append(step)
        if step == 1:
            os.rename(path, tmp_path / ".trash-step_00000001.x")  # as _prune does
            trainer.save(2, make_state(2), {"step": 2})
        check(path, step)

    reader.check_folder = pruned_meanwhile
    step, got, meta = reader.restore_latest(fresh_target())
    assert (step, meta, calls) == (2, {"step": 2}, [1, 2])
    assert_tree_exact(got, make_state(2))


def test_a_failed_read_silences_only_the_closed_loop_reports(tmp_path, monkeypatch):
    """Orbax's reads still in flight when one fails (a checkpoint removed under its reader)
    report "Event loop is closed" through sys.unraisablehook, dozens of tracebacks at exit of
    `moelab export`: after a failed read those are dropped, and every other report passes."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    ck = Checkpointer(tmp_path)
    ck.save(1, make_state(1), {})
    ck.check_folder = lambda path, step: os.rename(path, tmp_path / ".trash-x")
    with pytest.raises(CheckpointError, match="is gone"):
        ck.restore(1, fresh_target())
    sys.unraisablehook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    sys.unraisablehook(SimpleNamespace(exc_value=ValueError("a real problem")))
    assert [str(r.exc_value) for r in seen] == ["a real problem"]


def test_a_failed_save_silences_only_orbax_s_unretrieved_failures(tmp_path, caplog):
    """The writes a full disk fails after the first (whose failure is reported) are logged by
    asyncio as each of their futures is collected, a traceback apiece: those are dropped, by the
    tensorstore error's status code or orbax's frames; anyone else's unretrieved failure, and
    asyncio's other reports, pass."""
    def orbax_write():
        raise OSError("disk full inside orbax")  # its frames: this file, then orbax's below

    orbax_write.__code__ = orbax_write.__code__.replace(
        co_filename="/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
    errors = [ValueError('OUT_OF_RANGE: Error writing "w1/0.0" in OCDBT database'),
              ValueError("a real problem"), RuntimeError("someone else's task")]
    try:
        orbax_write()
    except OSError as e:
        errors.append(e)
    Checkpointer(tmp_path).save(1, make_state(1), {})  # any save sets the filter up
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for e in errors:
            log.error("Future exception was never retrieved\nfuture: <Future finished>",
                      exc_info=(type(e), e, e.__traceback__))
        log.error("Task was destroyed but it is pending!")
    kept = [(r.getMessage().split("\n")[0], r.exc_info and str(r.exc_info[1]))
            for r in caplog.records]
    assert kept == [("Future exception was never retrieved", "a real problem"),
                    ("Future exception was never retrieved", "someone else's task"),
                    ("Task was destroyed but it is pending!", None)]


def test_the_filter_of_a_failed_save_s_unstarted_writes_outlives_the_command(monkeypatch,
                                                                              capsys):
    """Orbax's writes a full disk left unstarted are collected after `moelab train` returned,
    each warned of ("coroutine ... was never awaited"): the filter the save set up stays, while
    the command's own ignoring of CheckpointWarning ends with it."""
    import moelab.config.cli as config_cli
    from test_cli import run_main

    def command(_args):
        quiet_closed_loop_reports()
        warnings.warn("a passed-over checkpoint", CheckpointWarning)  # said by its WARNING line
        return 0

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # put back after
    monkeypatch.setattr(config_cli, "cmd_presets", command)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always", CheckpointWarning)
        assert run_main(["presets"], capsys)[0] == 0
        warnings.warn("coroutine 'async_serialize_from_host.<locals>.write_fragment' was never "
                      "awaited", RuntimeWarning)
        warnings.warn("another checkpoint passed over", CheckpointWarning)
    assert [str(w.message) for w in shown] == ["another checkpoint passed over"]


def test_a_killed_readers_lease_stops_counting(tmp_path):
    """A lease of a reader killed with kill -9 (its pid gone) or an old one from another host
    no longer keeps a checkpoint, and the next save removes its file."""
    ck = Checkpointer(tmp_path, keep=1)
    ck.save(1, make_state(1), {})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    (tmp_path / f".read-1.{dead.pid}.a").write_text(
        json.dumps({"pid": dead.pid, "host": host, "time": time.time()}))
    (tmp_path / ".read-1.1.b").write_text(
        json.dumps({"pid": 1, "host": "elsewhere", "time": 0.0}))
    ck.save(2, make_state(2), {})
    assert ck.steps() == [2] and not list(tmp_path.glob(".read-*"))
    live = tmp_path / f".read-2.{os.getpid()}.c"  # this process: a reader still reading
    live.write_text(json.dumps({"pid": os.getpid(), "host": host, "time": time.time()}))
    ck.save(3, make_state(3), {})
    assert ck.steps() == [2, 3] and live.exists()


CRASH_SCRIPT = """
import os, sys
sys.path.insert(0, {src!r})
import numpy as np
import moelab.run.checkpoint as C

real = C.atomic_write_json
def crash(path, obj):
    if str(path).endswith("manifest.json"):
        os._exit(17)  # killed after orbax and meta.json are written, before the commit
    real(path, obj)
C.atomic_write_json = crash
C.Checkpointer({d!r}).save(2, {{"w": np.arange(10, dtype=np.float32)}}, {{"x": 1}})
"""


def test_interrupted_save_is_not_a_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path)
    s1 = {"w": np.arange(10, dtype=np.float32) * 3}
    ck.save(1, s1, {"x": 0})

    r = subprocess.run([sys.executable, "-c", CRASH_SCRIPT.format(src=SRC, d=str(tmp_path))], capture_output=True)
    assert r.returncode == 17, r.stderr.decode()[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "state").is_dir() and (leftovers[0] / "meta.json").is_file()
    # also: an orbax-style tmp dir (ignored) and a step dir without a manifest: commits rename
    # whole folders, so that one was damaged after its commit and is named when skipped
    (tmp_path / "step_00000003.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "step_00000004").mkdir()

    assert ck.steps() == [1]
    target = {"w": np.zeros(10, np.float32)}
    with pytest.warns(CheckpointWarning) as caught:
        step, got, meta = ck.restore_latest(target)
    assert len(caught) == 1 and "step_00000004" in str(caught[0].message)
    assert "manifest.json" in str(caught[0].message)
    assert step == 1 and meta == {"x": 0}
    assert_tree_exact(got, s1)

    ck.save(5, {"w": np.ones(10, np.float32)}, {"x": 5})  # the next save cleans up crash leftovers
    assert not any(p.name.startswith(".tmp-") or "orbax-checkpoint-tmp" in p.name
                   for p in tmp_path.iterdir())
    assert ck.steps() == [1, 5]


def test_a_re_save_of_a_step_killed_before_its_commit_keeps_the_old_checkpoint(tmp_path):
    """Re-saving a step moves its checkpoint aside, then commits the new one: killed between
    the two renames, neither is a checkpoint. The old one was removed with the leftovers; it
    is put back (the new one, never committed, goes). One moved aside whose step was
    committed again is removed."""
    ck = Checkpointer(tmp_path)
    ck.save(4, {"w": np.arange(10, dtype=np.float32)}, {"x": 4})
    ck.save(6, {"w": np.ones(10, np.float32)}, {"x": 6})
    os.rename(tmp_path / "step_00000004", tmp_path / ".replaced-step_00000004.0a1b2c3d")
    (tmp_path / ".tmp-step_00000004.1.0a1b2c3d").mkdir()  # the new one, not committed
    shutil.copytree(tmp_path / "step_00000006", tmp_path / ".replaced-step_00000006.9f8e7d6c")
    assert ck.steps() == [6]
    ck.remove_leftovers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]
    state, meta = ck.restore(4, {"w": np.zeros(10, np.float32)})
    assert meta == {"x": 4}
    np.testing.assert_array_equal(state["w"], np.arange(10, dtype=np.float32))
    ck.save(4, {"w": np.full(10, 2, np.float32)}, {"x": 44})  # a re-save leaves nothing aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, {src!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from moelab.run.checkpoint import Checkpointer
assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "expert"))
w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 7
e = (np.arange(4 * 8 * 16) % 251).astype(jnp.bfloat16).reshape(4, 8, 16)
state = {{"w": jax.device_put(w, NamedSharding(mesh, P("data", None))),
          "e": jax.device_put(e, NamedSharding(mesh, P("expert", None, "data")))}}
ck = Checkpointer({d!r})
ck.save(1, state, {{}})
# restore with different shardings (abstract target) ...
sh = {{"w": NamedSharding(mesh, P(None, "expert")), "e": NamedSharding(mesh, P())}}
tgt = {{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in state.items()}}
_, got, _ = ck.restore_latest(tgt)
for k in state:
    assert got[k].sharding == sh[k], (k, got[k].sharding)
    assert got[k].dtype == state[k].dtype
    assert np.asarray(got[k]).tobytes() == np.asarray(state[k]).tobytes(), k
# ... and onto a single device
one = SingleDeviceSharding(jax.devices()[1])
got, _ = ck.restore(1, {{k: jax.device_put(np.zeros(v.shape, v.dtype), one) for k, v in state.items()}})
for k in state:
    assert got[k].sharding == one
    assert np.asarray(got[k]).tobytes() == np.asarray(state[k]).tobytes(), k
print("MESH_OK")
"""


def test_sharded_save_and_restore_on_mesh(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT.format(src=SRC, d=str(tmp_path))],
        capture_output=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0 and b"MESH_OK" in r.stdout, r.stderr.decode()[-3000:]


def test_rejects_bad_meta_without_writing(tmp_path):
    ck = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="JSON"):
        ck.save(1, make_state(1), {"obj": object()})
    assert ck.steps() == [] and not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        Checkpointer(tmp_path, keep=0)


def test_manifest_records_every_file(tmp_path):
    ck = Checkpointer(tmp_path)
    path = ck.save(3, make_state(3), {"a": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert "meta.json" in on_disk and any(f.startswith("state/") for f in on_disk)


def test_typed_prng_key_round_trip(tmp_path):
    """New-style typed keys (jax.random.key) also survive, besides raw uint32 key data."""
    key = jax.random.wrap_key_data(jnp.asarray(np.array([123456789, 4000000000], np.uint32)))
    ck = Checkpointer(tmp_path)
    ck.save(1, {"key": key}, {})
    target = {"key": jax.random.wrap_key_data(jnp.asarray(np.zeros(2, np.uint32)))}
    got, _ = ck.restore(1, target)
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    assert leaf_bytes(jax.random.key_data(got["key"])) == leaf_bytes(jax.random.key_data(key))


def test_failed_overwrite_keeps_previous(tmp_path, monkeypatch):
    """If re-saving an existing step fails at the commit, the previous checkpoint is kept."""
    import moelab.run.checkpoint as C

    ck = Checkpointer(tmp_path)
    s1 = {"w": np.arange(6, dtype=np.float32)}
    ck.save(1, s1, {"v": 1})
    real_rename = os.rename

    def failing_rename(src, dst, *a, **k):
        if Path(src).name.startswith(".tmp-"):
            raise OSError("disk full (simulated)")
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(C.os, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        ck.save(1, {"w": np.zeros(6, np.float32)}, {"v": 2})
    monkeypatch.undo()
    assert ck.steps() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    got, meta = ck.restore(1, {"w": np.ones(6, np.float32)})
    assert meta == {"v": 1}
    assert_tree_exact(got, s1)


def test_relative_checkpoint_dir_works(tmp_path, monkeypatch):
    """`moelab train --run-dir runs/x` passes a relative path; orbax needs absolute ones."""
    monkeypatch.chdir(tmp_path)
    ck = Checkpointer("runs/x/checkpoints", keep=2)
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    ck.save(3, state, {"step": 3})
    step, got, meta = ck.restore_latest(state)
    assert step == 3 and meta == {"step": 3}
    np.testing.assert_array_equal(got["w"], state["w"])


# ---------------------------------------------------------------------------------------------
# asynchronous saves


def test_async_save_is_complete_after_the_caller_reuses_the_arrays(tmp_path):
    """save(wait=False) returns once the state is on the host: deleting the device arrays (what
    a donating train step does) cannot change what is written, and the commit is atomic."""
    ck = Checkpointer(tmp_path, keep=2, asynchronous=True)
    state = {"w": jnp.arange(4096, dtype=jnp.float32) / 7, "n": jnp.int32(3)}
    want = jax.tree.map(np.asarray, state)
    ck.save(1, state, {"step": 1}, wait=False)
    for leaf in jax.tree.leaves(state):
        leaf.delete()
    ck.save(2, {"w": jnp.zeros(4096, jnp.float32), "n": jnp.int32(0)}, {"step": 2}, wait=False)
    ck.close()  # waits for the second one
    assert ck.steps() == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    got, meta = ck.restore(1, jax.tree.map(np.zeros_like, want))
    assert meta == {"step": 1}
    assert_tree_exact(got, want)


def test_async_save_failure_is_raised_with_its_step_and_leaves_nothing(tmp_path, monkeypatch):
    import errno as _errno

    import moelab.run.checkpoint as C

    def full_disk_commit(*_args):
        raise OSError(_errno.ENOSPC, "No space left on device")

    ck = Checkpointer(tmp_path, asynchronous=True)
    monkeypatch.setattr(C.Checkpointer, "_commit", full_disk_commit)
    ck.save(3, {"w": np.ones(8, np.float32)}, {}, wait=False)  # returns: the failure comes later
    with pytest.raises(CheckpointError, match=r"checkpoint of step 3 not saved .*no space left"):
        ck.wait()  # what the next save does first
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # nothing of step 3 is left
    ck.save(4, {"w": np.ones(8, np.float32)}, {})  # the failure was reported once
    assert ck.steps() == [4]
