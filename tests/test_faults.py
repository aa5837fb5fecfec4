"""Trust under faults: the run folder's lock, non-finite steps, held-out gaps, stop signals in
and before evaluations, full disks and damaged checkpoints. Each test reproduces one fault on the
micro model (tests/helpers.py) and checks that it is reported clearly and that nothing is lost.
Killing a trainer at random points is tests/test_fault_injection.py.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import (
    VOCAB,
    micro_config,
    micro_dict,
    signals_after_step,
    subprocess_env,
    write_config_yaml,
)
from moelab.cli import main
from moelab.data import corpus
from moelab.data.corpus import build_user_corpus, iter_documents
from moelab.data.errors import DataError
from moelab.data.prepare import prepare_data
from moelab.data.sampler import SteppedSampler
from moelab.data.store import TokenStore
from moelab.model import transformer as tr
from moelab.run import logs as runlog
from moelab.run.checkpoint import Checkpointer, CheckpointError, CheckpointWarning
from moelab.run.lock import LOCK_FILE, RunLocked, acquire, release
from moelab.run.logs import JsonlTracker, read_metrics
from moelab.train import loop
from moelab.train.tracker import format_summary
from test_train import events, load_state, losses, quiet_train

SMALL = {"steps": 4, "ckpt_every": 2}  # the small run: checkpoints at steps 2 and 4


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, data_dir):  # noqa: F811
    """A 4-step micro run with checkpoints at 2 and 4; tests that damage it work on a copy."""
    run = tmp_path_factory.mktemp("faults") / "run"
    quiet_train(micro_config(data_dir, train=SMALL), run)
    return run


def copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def eval_steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl")[0]
            if any(k.startswith("eval/") for k in r)}


# ---------------------------------------------------------------------------------------------
# one writer per run folder

HOLDER = """
import sys, time
from moelab.run.lock import acquire
acquire(sys.argv[1], "holder --for-the-test")
print("held", flush=True)
time.sleep(120)
"""


def test_resume_of_a_run_still_starting_names_its_holder(tmp_path, capsys):
    """A first `moelab train` that has not written config.yaml yet (it prepares data): a
    resume names that live start, not a missing config.yaml; without a holder, the file."""
    run = tmp_path / "new"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE,
                              text=True, env=subprocess_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["resume", str(run)]) == 2
        assert f"moelab: error: {run} is in use by pid {holder.pid} " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    (run / LOCK_FILE).unlink()
    assert main(["resume", str(run)]) == 2
    assert f"{run / 'config.yaml'}: not found" in capsys.readouterr().err
    assert list(run.iterdir()) == []  # the check left no lock behind


def test_a_locked_run_folder_refuses_writers_and_a_dead_holder_is_taken_over(
        small_run, data_dir, tmp_path, capsys):  # noqa: F811
    run = copy_run(small_run, tmp_path)
    n_lines = len((run / "metrics.jsonl").read_text().splitlines())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE,
                              text=True, env=subprocess_env())
    cfg = micro_config(data_dir, train={**SMALL, "steps": 6})
    try:
        assert holder.stdout.readline().strip() == "held"
        who = rf"pid {holder.pid} on {re.escape(socket.gethostname())} since \S+ \(holder"
        with pytest.raises(RunLocked, match=who):
            quiet_train(cfg, run)
        yaml_path = write_config_yaml(tmp_path / "c.yaml", micro_dict(data_dir, train=SMALL))
        assert main(["train", str(yaml_path), "--run-dir", str(run)]) == 2
        assert main(["replan", str(run), "--end-steps", "8", "--apply"]) == 2
        err = capsys.readouterr().err
        assert len(re.findall(f"moelab: error: {re.escape(str(run))} is in use by {who}", err)) == 2
        assert not (run / "plan_pending.json").exists()
        assert len((run / "metrics.jsonl").read_text().splitlines()) == n_lines
    finally:
        holder.kill()  # kill -9: the lock file still names it
        holder.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid
    assert quiet_train(cfg, run)["step"] == 6
    assert f"taking over the lock left by pid {holder.pid}" in capsys.readouterr().err
    assert (run / LOCK_FILE).read_text() == ""  # released at the end


def test_a_command_that_writes_nothing_leaves_no_new_run_folder(tmp_path):
    from moelab.run.lock import run_lock

    new = tmp_path / "runs" / "new"
    with pytest.raises(ValueError):
        with run_lock(new):
            assert (new / LOCK_FILE).is_file()
            raise ValueError("refused before anything was written")
    assert not (tmp_path / "runs").exists()  # the folders it made above the run's too
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError):
        with run_lock(new):
            raise ValueError("refused before anything was written")
    assert not new.exists() and (tmp_path / "runs").is_dir()  # one that was there stays
    with run_lock(new):
        (new / "config.yaml").write_text("x: 1\n")
    assert (new / LOCK_FILE).read_text() == "" and (new / "config.yaml").is_file()
    with run_lock(new):  # an existing folder is never removed
        pass
    assert sorted(p.name for p in new.iterdir()) == [LOCK_FILE, "config.yaml"]


def test_a_lock_naming_another_host_is_refused_with_how_to_remove_it(tmp_path):
    holder = {"pid": 1, "host": "elsewhere", "since": "2025-01-01T00:00:00", "command": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(RunLocked, match=r"pid 1 on elsewhere since 2025-01-01T00:00:00 \(x\); "
                       rf".* delete {re.escape(str(tmp_path / LOCK_FILE))} and run this again"):
        acquire(tmp_path)
    (tmp_path / LOCK_FILE).unlink()
    release(acquire(tmp_path))


# ---------------------------------------------------------------------------------------------
# non-finite steps


def test_a_nonfinite_step_is_never_saved_and_the_run_stops_naming_it(data_dir, tmp_path):  # noqa: F811
    """The reproduction: lr 1e6, logged every 7 steps, saved every 5 (a NaN checkpoint was saved
    at step 5 when only logged steps were checked)."""
    run = tmp_path / "run"
    cfg = micro_config(data_dir, optim={"lr": 1e6},
                       train={"steps": 10, "log_every": 7, "ckpt_every": 5})
    with pytest.raises(FloatingPointError) as e:
        quiet_train(cfg, run)
    evs = events(run)
    assert [x["event"] for x in evs[-2:]] == ["diverged", "failed"]
    bad = evs[-2]["step"]
    assert re.match(rf"train/\w+ is (nan|inf) at step {bad} .*Fix: lower optim.lr", str(e.value))
    ckpts = Checkpointer(run / "checkpoints").steps()
    assert all(s < bad for s in ckpts)
    for s in ckpts:
        params = load_state(run, cfg, s)[1]["params"]
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


SPIKE_MOD = 3  # a batch whose token sum is a multiple of this gets a NaN loss (injected)


def spiky(real_lm_loss):
    def lm_loss(params, model_state, tokens_B1T, cfg, **kw):
        loss, stats = real_lm_loss(params, model_state, tokens_B1T, cfg, **kw)
        return loss + jnp.where(jnp.sum(tokens_B1T) % SPIKE_MOD == 0, jnp.nan, 0.0), stats
    return lm_loss


def expected_skips(bad: list[bool], limit: int) -> tuple[list[int], int | None]:
    """(steps skipped, step the run stops at or None) under train.on_nonfinite=skip."""
    skipped, in_a_row = [], 0
    for step, b in enumerate(bad, 1):
        in_a_row = in_a_row + 1 if b else 0
        if in_a_row > limit:
            return skipped, step
        if b:
            skipped.append(step)
    return skipped, None


def test_skip_mode_does_not_apply_nonfinite_steps_and_stops_after_too_many_in_a_row(
        data_dir, tmp_path, monkeypatch):  # noqa: F811
    steps = 12
    random = {"sampler": "random"}  # its batches spike alone and twice in a row (checked below)
    cfg = micro_config(data_dir, data=random, train={"steps": steps, "ckpt_every": 1,
                                                     "keep_ckpts": 20, "on_nonfinite": "skip",
                                                     "skip_limit": 2})
    sampler = SteppedSampler(TokenStore(prepare_data(cfg.data, VOCAB, verbose=False).store_dir),
                             cfg.data)
    bad = [int(sampler.batch(i).astype(np.int64).sum()) % SPIKE_MOD == 0 for i in range(steps)]
    skipped, stop = expected_skips(bad, 2)
    assert stop is None and len(skipped) >= 3  # isolated spikes and a pair in a row: skipped
    monkeypatch.setattr(tr, "lm_loss", spiky(tr.lm_loss))

    run = tmp_path / "skip"
    assert quiet_train(cfg, run)["step"] == steps
    got = [(e["step"], e["consecutive"]) for e in events(run) if e["event"] == "skipped"]
    assert [s for s, _ in got] == skipped and max(n for _, n in got) == 2
    assert sorted(losses(run)) == [s for s in range(1, steps + 1) if s not in skipped]
    params = {s: load_state(run, cfg, s)[1]["params"] for s in range(1, steps + 1)}
    for s in range(2, steps + 1):  # a skipped step left the weights exactly as they were
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params[s - 1]),
                                                         jax.tree.leaves(params[s])))
        assert same == (s in skipped), s

    skipped, stop = expected_skips(bad, 1)
    assert stop is not None
    strict = micro_config(data_dir, data=random, train={"steps": steps, "ckpt_every": 1,
                                                        "keep_ckpts": 20, "on_nonfinite": "skip",
                                                        "skip_limit": 1})
    with pytest.raises(FloatingPointError, match=rf"2 steps in a row .* at step {stop} "):
        quiet_train(strict, tmp_path / "strict")
    assert Checkpointer(tmp_path / "strict" / "checkpoints").steps() == list(range(1, stop))


def test_generate_refuses_a_checkpoint_with_nan_weights(small_run, data_dir, tmp_path,  # noqa: F811
                                                        capsys):
    run = copy_run(small_run, tmp_path)
    step, state = load_state(run, micro_config(data_dir, train=SMALL))
    state["params"] = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state["params"])
    Checkpointer(run / "checkpoints").save(step + 1, state, {})  # as older versions saved them
    assert main(["generate", str(run), "--max-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint of step 5 has" in err and "non-finite parameters" in err
    assert "choose an earlier --step (2, 4)" in err


# ---------------------------------------------------------------------------------------------
# held-out text


def test_data_build_holds_out_the_end_of_a_domain_s_only_document(tmp_path, capsys):
    words = " ".join(f"word{i}" for i in range(3000))
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "one_line.txt").write_text(words)  # one huge single-line document
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "t.txt").write_text("hello")
    m = build_user_corpus([tmp_path / "big", tmp_path / "tiny"], tmp_path / "c", 0.02)
    assert m["domains"]["big"]["train"]["docs"] == m["domains"]["big"]["heldout"]["docs"] == 1
    part = {s: [d["text"] for d in iter_documents(tmp_path / "c", s) if d["domain"] == "big"][0]
            for s in ("train", "heldout")}
    assert part["train"] + " " + part["heldout"] == words
    assert 0.019 * len(words) < len(part["heldout"]) < 0.021 * len(words)  # cut at a space
    assert m["domains"]["tiny"]["heldout"]["docs"] == 0
    assert "domain 'tiny' gets no held-out text" in capsys.readouterr().err


def test_training_refuses_held_out_text_shorter_than_one_window(data_dir, tmp_path):  # noqa: F811
    """Named by its shortest domain, with the longest context every domain can evaluate (it
    named the first short one: lowering data.seq_len below it could fail on the next)."""
    from moelab.data.store import TokenStore

    store = TokenStore(next(data_dir.glob("tokens-*")))
    n, d = min((store.n_tokens("heldout", d), d) for d in store.domains("heldout"))
    with pytest.raises(DataError, match=rf"held-out text of domain '{d}' .* has {n} tokens, "
                       r"shorter than one evaluation window \(data.seq_len \+ 1 = 4097\)"
                       rf".*; lower data.seq_len to at most {n - 1}, or"):
        quiet_train(micro_config(data_dir, data={"seq_len": 4096}), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_corpus_without_held_out_text_is_refused_at_the_start(data_dir, tmp_path,  # noqa: F811
                                                                monkeypatch):
    # as built before each domain got a held-out share: one huge single-line document
    monkeypatch.setattr(corpus, "split_lone_document", lambda doc, fraction: None)
    src = tmp_path / "src" / "prose"
    src.mkdir(parents=True)
    (src / "all.txt").write_text(" ".join(f"The cat {i} sees the dog." for i in range(3000)))
    m = build_user_corpus([src], tmp_path / "data" / "corpus", heldout_fraction=0.02)
    assert m["total"]["heldout"]["docs"] == 0
    cfg = micro_config(data_dir, data={"data_dir": str(tmp_path / "data"),
                                       "tokenizer": str(data_dir / f"tokenizer-{VOCAB}.json")})
    with pytest.raises(DataError, match="has no held-out documents, so nothing could be "):
        quiet_train(cfg, tmp_path / "run")


# ---------------------------------------------------------------------------------------------
# stop signals before and during evaluations


def test_a_stop_just_before_a_scheduled_evaluation_leaves_it_to_the_resume(
        data_dir, tmp_path, monkeypatch):  # noqa: F811
    cfg = micro_config(data_dir, train={"steps": 6, "eval_every": 3})
    run, ref = tmp_path / "run", tmp_path / "ref"
    signals_after_step(monkeypatch, 3, signal.SIGTERM)
    s = quiet_train(cfg, run)
    assert (s["interrupted"], s["step"]) == ("SIGTERM", 3) and 3 not in eval_steps(run)
    monkeypatch.undo()
    assert quiet_train(cfg, run)["interrupted"] is None
    quiet_train(cfg, ref)
    got, want = eval_steps(run), eval_steps(ref)
    assert sorted(got) == sorted(want) == [3, 6]
    assert {k: v for k, v in got[3].items() if k.startswith("eval/")} == \
        {k: v for k, v in want[3].items() if k.startswith("eval/")}


def test_sigterm_during_the_final_evaluation_stops_it_and_a_rerun_does_it(
        small_run, data_dir, tmp_path, monkeypatch):  # noqa: F811
    run = copy_run(small_run, tmp_path)
    real = loop.evaluate

    def evaluate(cfg, eval_fn, state, store, max_tokens, put, stop):
        calls = itertools.count(1)

        def put_and_signal(x):  # SIGTERM arrives in the second batch
            if next(calls) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return put(x)
        return real(cfg, eval_fn, state, store, max_tokens, put_and_signal, stop)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    cfg = micro_config(data_dir, train={**SMALL, "steps": 5})
    s = quiet_train(cfg, run)
    assert s["interrupted"] == "SIGTERM" and not any(k.startswith("eval/") for k in s)
    assert events(run)[-1]["event"] == "interrupted" and 5 not in eval_steps(run)
    monkeypatch.undo()
    s = quiet_train(cfg, run)
    assert s["interrupted"] is None and 5 in eval_steps(run)
    assert [(e["event"], e["step"]) for e in events(run)][-2:] == [("resume", 5), ("finished", 5)]
    # the rerun trains no step: its summary has the step's loss all the same
    assert s["train/loss"] == losses(run)[5]


def test_a_rerun_that_trains_no_step_reports_no_throughput_of_its_own(
        data_dir, tmp_path, monkeypatch):  # noqa: F811
    """A stop in the final evaluation leaves the rerun nothing to train: its summary showed the
    tokens/s and MFU the checkpoint kept from the start before (beside "0 tokens from step 3"),
    and that start's share of its measured peak next to this start's measured peak."""
    cfg, run = micro_config(data_dir, train={"steps": 3}), tmp_path / "run"
    monkeypatch.setattr(loop, "evaluate", lambda *_a, **_k: None)  # a stop abandoned it
    first = quiet_train(cfg, run)
    assert first["interrupted"] == "SIGTERM" and first["throughput/tokens_per_s"] > 0
    monkeypatch.undo()
    s = quiet_train(cfg, run)
    assert (s["interrupted"], s["start_step"], s["tokens_this_start"]) == (None, 3, 0)
    assert s["train/loss"] == losses(run)[3]  # the state's loss, logged by the start before
    assert [s[k] for k in ("throughput/tokens_per_s", "throughput/mfu",
                           "throughput/share_of_measured_peak")] == [None, None, None]
    assert "throughput" not in format_summary(s)


def test_ctrl_c_twice_in_an_evaluation_ends_the_process_at_once(
        small_run, data_dir, tmp_path, monkeypatch):  # noqa: F811
    """Ctrl-C twice landing in an evaluation (its first call compiles, in XLA's threads) ended
    `moelab train` with a segmentation fault at interpreter shutdown instead of exit 130: the
    loop, like the setup, has the CLI end the process right after its records are written."""
    from moelab import util

    run = copy_run(small_run, tmp_path)
    monkeypatch.setattr(util, "_abandoned", [])  # what a stop in native work marks

    def aborted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", aborted)
    with pytest.raises(KeyboardInterrupt, match="nothing trained since the checkpoint at step 5"):
        quiet_train(micro_config(data_dir, train={**SMALL, "steps": 5}), run)
    assert util._abandoned  # XLA's threads may still run: the CLI ends with os._exit(130)
    assert [(e["event"], e["step"]) for e in events(run)][-2:] == [("resume", 4), ("aborted", 5)]


def test_a_summary_left_by_an_earlier_start_is_not_taken_for_the_finished_run_s(
        small_run, data_dir, tmp_path):  # noqa: F811
    """Killed after logging "finished" but before writing its summary, a run keeps the summary
    of an earlier, interrupted start: the rerun does not report that one as the run's end."""
    run = copy_run(small_run, tmp_path)
    done = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**done, "step": 2, "interrupted": "SIGINT"}))
    s = quiet_train(micro_config(data_dir, train=SMALL), run)
    assert (s["step"], s["interrupted"], s["train/loss"]) == (4, None, done["train/loss"])
    assert {k: v for k, v in s.items() if k.startswith("eval/")} == \
        {k: v for k, v in done.items() if k.startswith("eval/")}
    assert json.loads((run / "summary.json").read_text())["step"] == 4
    assert [e["event"] for e in events(run)][-2:] == ["resume", "finished"]


# ---------------------------------------------------------------------------------------------
# full disks and damaged checkpoints


def full_disk_writes(monkeypatch, is_target) -> None:
    """os.write on a descriptor ``is_target`` accepts: half of what it is given, then ENOSPC."""
    real = os.write

    def write(fd, data):
        if not is_target(fd):
            return real(fd, data)
        if len(data) > 16:
            return real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runlog.os, "write", write)


def test_a_metrics_write_on_a_full_disk_leaves_no_cut_line(tmp_path, monkeypatch):
    t = JsonlTracker(tmp_path / "m.jsonl")
    t.log(1, {"a": 1.0})
    with monkeypatch.context() as m:
        full_disk_writes(m, lambda fd: fd == t._fd)
        with pytest.raises(OSError) as e:
            t.log(2, {"a": 2.0, "b": "x" * 100})
    assert e.value.errno == errno.ENOSPC
    assert "m.jsonl: a record could not be appended" in str(e.value)
    t.log(3, {"a": 3.0})  # the writer goes on once there is space
    t.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 3]


def test_a_full_disk_under_the_metrics_log_stops_the_run_with_one_line(
        data_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    run = tmp_path / "run"
    opened = []
    real_init = JsonlTracker.__init__

    def init(self, path):
        real_init(self, path)
        opened.append(self._fd)

    monkeypatch.setattr(JsonlTracker, "__init__", init)
    full_after = itertools.count()  # the disk fills after 3 records: the failed event fails too
    full_disk_writes(monkeypatch, lambda fd: fd in opened and next(full_after) >= 3)
    yaml_path = write_config_yaml(tmp_path / "c.yaml", micro_dict(data_dir, train=SMALL))
    assert main(["train", str(yaml_path), "--run-dir", str(run)]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("moelab: error:")]
    assert "No space left on device" in line and "metrics.jsonl" in line
    assert "could not record the failed event" in err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x) for x in lines)  # whole records only


def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_leaves_nothing(
        data_dir, tmp_path, monkeypatch, capsys, caplog):  # noqa: F811
    def full_disk_save(self, directory, *args, **kw):  # what orbax does on a full disk
        Path(directory).mkdir(parents=True)
        (Path(directory) / "part").write_bytes(b"x" * 100)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:  # each of its worker threads logs its failed write with a traceback
            logging.getLogger("absl").error("array write failed", exc_info=True)
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device "
                         "[os_error_code='28']")

    monkeypatch.setattr(ocp.Checkpointer, "save", full_disk_save)
    monkeypatch.setattr(ocp.AsyncCheckpointer, "save", full_disk_save)  # train.async_ckpt
    run = tmp_path / "run"
    yaml_path = write_config_yaml(tmp_path / "c.yaml", micro_dict(data_dir, train=SMALL))
    with caplog.at_level(logging.ERROR, logger="absl"):
        assert main(["train", str(yaml_path), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not [r for r in caplog.records if r.name == "absl"]
    (line,) = [x for x in err.splitlines() if x.startswith("moelab: error:")]
    assert "checkpoint of step 2 not saved" in line and "(no space left on the device)" in line
    assert list((run / "checkpoints").iterdir()) == []  # nothing half-written
    assert events(run)[-1]["event"] == "failed"


def test_a_newest_checkpoint_without_its_manifest_is_named_when_falling_back(
        small_run, data_dir, tmp_path):  # noqa: F811
    run = copy_run(small_run, tmp_path)
    (run / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    with pytest.warns(CheckpointWarning, match=r"step_00000004 is unusable: .*no manifest.json"):
        assert quiet_train(micro_config(data_dir, train=SMALL), run)["step"] == 4
    assert [(e["event"], e["step"]) for e in events(run)][-2:] == [("resume", 2), ("finished", 4)]
    assert losses(run)[4] == losses(small_run)[4]


def test_a_run_whose_checkpoints_are_all_damaged_fails_on_record(small_run, data_dir,  # noqa: F811
                                                                 tmp_path):
    run = copy_run(small_run, tmp_path)
    for manifest in (run / "checkpoints").glob("step_*/manifest.json"):
        manifest.unlink()
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="all 2 checkpoints"):
        quiet_train(micro_config(data_dir, train=SMALL), run)
    last = events(run)[-1]
    assert last["event"] == "failed" and "all 2 checkpoints" in last["error"]
