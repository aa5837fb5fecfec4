"""The memory check before a run's first step on an accelerator (moelab.train.preflight): the
message's figures and fixes, and, with an allocator limit stood in for on the CPU, a run refused
before it trains (and the log of one stopped during the check) and runs that train with the
check's executables (no second compile), a later data stage's step checked up front."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from jax._src import monitoring

from helpers import data_dir, micro_config, shared_run  # noqa: F401 - data_dir is a fixture
from moelab import util
from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.run.logs import OPS_LOG, read_metrics
from moelab.train import preflight, setup
from moelab.train.loop import train
from moelab.train.step import abstract_train_state

GIB = 2**30


def _mem(temp_gib: float, output_gib: float = 10.0, alias_gib: float = 10.0) -> dict:
    """An XLA memory analysis: the step's outputs written over its donated state but for
    ``output - alias``, and ``temp`` of temporaries."""
    b = lambda g: int(g * GIB)  # noqa: E731
    return {"argument": b(10.0), "output": b(output_gib), "alias": b(alias_gib),
            "temp": b(temp_gib), "peak": 0}


@pytest.fixture
def no_share(monkeypatch):
    """Neither of the variables that set JAX's share of a GPU."""
    for var in preflight.FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)


def test_a_step_that_fits_passes(data_dir, no_share):  # noqa: F811
    cfg = micro_config(data_dir)
    assert preflight.fit_problem(_mem(45.0), limit=75 * GIB, in_use=30 * GIB, cfg=cfg) is None
    # outputs beyond the donated state count too: 45 + 1 over the 45 free
    assert preflight.fit_problem(_mem(45.0, output_gib=11.0), 75 * GIB, 30 * GIB, cfg) is not None


def test_the_refusal_names_the_need_the_share_and_the_fixes(data_dir, no_share):  # noqa: F811
    cfg = micro_config(data_dir)  # remat none, batch 4 x 32: micro-steps of 2 sequences valid
    msg = preflight.fit_problem(_mem(50.0), 75 * GIB, 30 * GIB, cfg, device_kind="NVIDIA H200")
    # 30 held + 50 while running = 80 GiB of a 100 GiB device (75 GiB at JAX's 0.75)
    assert msg.startswith("the compiled train step needs 80.0 GiB on each NVIDIA H200")
    assert "30.0 GiB already held" in msg and "50.0 GiB while the step runs" in msg
    assert "JAX may use 75.0 GiB of it (JAX's default share, 0.75)" in msg
    assert "run with XLA_CLIENT_MEM_FRACTION=0.81 (the step needs 80% of the NVIDIA H200's " \
           "100.0 GiB)" in msg
    assert "model.remat=full" in msg
    # 4 sequences a step: 3 do not divide the batch, 2 do
    assert "train.microbatch_tokens=64 (fewer tokens per micro-step)" in msg
    assert "more devices with parallel.fsdp=true" in msg
    assert "train.memory_check=false starts the run anyway" in msg


def test_the_refusal_leaves_out_fixes_that_do_not_apply(data_dir, no_share,  # noqa: F811
                                                         monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # the older name: still read
    cfg = micro_config(data_dir, model={"remat": "full"}, data={"batch_size": 1},
                       parallel={"fsdp": True})
    # 90 GiB at 0.9: a 100 GiB device; 30 + 68 = 98% of it, over the 95% suggested at most
    msg = preflight.fit_problem(_mem(68.0), 90 * GIB, 30 * GIB, cfg)
    assert "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)" in msg
    assert "run with XLA_PYTHON_CLIENT_MEM_FRACTION" not in msg
    assert "model.remat=full" not in msg  # already
    assert "train.microbatch_tokens" not in msg  # one sequence: no smaller micro-step
    assert "more devices (parameters" in msg and "parallel.fsdp=true" not in msg  # already
    # the share the run gave under the current name; a suggestion names that variable
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.6")
    msg = preflight.fit_problem(_mem(40.0), 60 * GIB, 30 * GIB, cfg)
    assert "(XLA_CLIENT_MEM_FRACTION=0.6)" in msg and "XLA_CLIENT_MEM_FRACTION=0.71 (" in msg
    # another accelerator's allocator: no GPU share to name or change
    msg = preflight.fit_problem(_mem(50.0), 75 * GIB, 30 * GIB, cfg, gpu=False)
    assert "MEM_FRACTION" not in msg and "JAX may use 75.0 GiB of it. " in msg


def test_a_suggested_micro_step_suits_every_data_stage(data_dir, no_share):  # noqa: F811
    # 9 sequences a step: the largest smaller micro-step dividing them is 3 sequences
    msg = preflight.fit_problem(_mem(50.0), 75 * GIB, 30 * GIB,
                                micro_config(data_dir, data={"batch_size": 9}))
    assert "train.microbatch_tokens=96 (" in msg
    # 8 x 32 tokens, then 2 x 96 from step 5: 4 x 32 would be no whole sequences of 96, and
    # no micro-step is whole sequences of both that divides both batches: none suggested
    cfg = micro_config(data_dir, data={"batch_size": 8, "context_stages": [
        {"step": 5, "seq_len": 96, "batch_size": 2}]})
    msg = preflight.fit_problem(_mem(50.0), 75 * GIB, 30 * GIB, cfg)
    assert "train.microbatch_tokens" not in msg
    # a later stage's step is named in the message
    msg = preflight.fit_problem(_mem(50.0), 75 * GIB, 30 * GIB, cfg, step=5, later_stage=True)
    assert msg.startswith("the compiled train step of the data stage from step 5 (2 x 96 "
                          "tokens) needs 80.0 GiB")


def _compiles(name: str):
    """A list that collects each lowering of a jitted function called ``name`` from now on."""
    seen: list[str] = []

    def listen(event: str, duration: float, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and \
                kw.get("fun_name") == f"jit({name})":
            seen.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    return seen, listen


def test_a_run_that_does_not_fit_stops_before_training(tmp_path, data_dir,  # noqa: F811
                                                        monkeypatch, no_share):
    # a device whose allocator may use 1 MiB, half of it held: the micro step needs more
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (2**20, 2**19))
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"the compiled train step needs [\d.]+ MiB .* but JAX "
                                          r"may use 1.0 MiB of it"):
        train(micro_config(data_dir, train={"steps": 2}), run, verbose=False)
    assert not run.exists()  # refused: the new run's folder is gone with what it wrote
    mine = tmp_path / "mine"  # a folder of the user's keeps what it held, and only that
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="the compiled train step needs"):
        train(micro_config(data_dir, train={"steps": 2}), mine, verbose=False)
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoints", "notes.txt"]
    # told to start anyway, the same run trains (the CPU needs no more than it has)
    summary = train(micro_config(data_dir, train={"steps": 2, "memory_check": False}), run,
                    verbose=False)
    assert summary["step"] == 2


def test_a_refusal_is_said_where_its_files_cannot_all_go(tmp_path, data_dir,  # noqa: F811
                                                         monkeypatch, no_share):
    """A folder of the refused run that will not go (a file a tracker's helper process still
    holds on a network filesystem): the refusal is what ends the command, not that error."""
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (2**20, 2**19))

    def stuck(path, *a, **kw):
        raise OSError(39, "Directory not empty", str(path))

    monkeypatch.setattr(setup.shutil, "rmtree", stuck)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="the compiled train step needs"):
        train(micro_config(data_dir, train={"steps": 2, "tensorboard": True}), run,
              verbose=False)
    assert (run / "tensorboard").is_dir() and not (run / "config.yaml").exists()


def test_a_resume_that_does_not_fit_keeps_the_run_s_files(tmp_path_factory, tmp_path,
                                                          data_dir, monkeypatch,  # noqa: F811
                                                          no_share):
    """Refused by the compiled step's check, after its resume event: the log records the
    refusal, but config.yaml keeps the run's settings (a later plain resume would train what
    was refused) and a pending replan stays pending, not logged as applied."""
    run = shutil.copytree(shared_run(tmp_path_factory, data_dir)[0], tmp_path / "run")
    (run / "plan_pending.json").write_text(json.dumps(
        {"change": {"end": 40}, "requested_at_step": 30, "reason": "longer"}))
    names = ("config.yaml", "provenance.json", "tokenizer.json", "plan_pending.json")
    kept = {n: (run / n).read_bytes() for n in names}
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (2**20, 2**19))
    assert main(["resume", str(run), "train.log_every=5"]) == 2
    assert {n: (run / n).read_bytes() for n in names} == kept
    assert not (run / OPS_LOG).exists() or "replan_applied" not in (run / OPS_LOG).read_text()
    _, events = read_metrics(run / "metrics.jsonl")
    assert [e["event"] for e in events[-2:]] == ["resume", "failed"]
    assert "ConfigError: the compiled train step needs" in events[-1]["error"]


def test_a_run_the_cpu_host_cannot_hold_is_refused_before_its_state(tmp_path, data_dir,  # noqa: F811
                                                                    monkeypatch):
    # a CPU reports no allocator limit: the plan against the host's memory decides, before the
    # state is built (d768 on a 23 GiB host was killed by the system without a message)
    def never(*_a, **_kw):
        raise AssertionError("the data or train state was built before the refusal")

    monkeypatch.setattr(setup, "init_sharded_state", never)
    cfg = micro_config(data_dir, train={"steps": 2})
    state = abstract_train_state(cfg)
    held = preflight.held_bytes(state) + preflight.held_bytes(state["params"])
    monkeypatch.setattr(preflight, "_host_memory", lambda: held + 2**10)  # not the activations
    with pytest.raises(ConfigError, match=r"this run needs about [\d.]+ MiB of memory \([\d.]+ "
                       r"MiB train state, .* activations with remat none\), but this host has "
                       r"[\d.]+ MiB. Fixes: model.remat=full; .*train.memory_check=false starts"):
        train(cfg, tmp_path / "run", verbose=False)
    assert not (tmp_path / "run").exists()
    # a state the host cannot hold: refused before the data is prepared (a 535B-shaped run
    # trained its 128K tokenizer first)
    monkeypatch.setattr(setup, "_prepare", never)
    monkeypatch.setattr(preflight, "_host_memory", lambda: held - 2**10)
    with pytest.raises(ConfigError, match=r"MiB gradients, before any activation\), but this "
                       r"host has [\d.]+ MiB. Fixes: a smaller model or batch; or an accelerator"):
        train(cfg, tmp_path / "run", verbose=False)
    assert not (tmp_path / "run").exists()
    preflight.check_host_memory(micro_config(data_dir, train={"memory_check": False}))
    monkeypatch.setattr(preflight, "_host_memory", lambda: 64 * GIB)
    preflight.check_host_memory(micro_config(data_dir))  # fits: nothing said


def test_the_host_check_counts_what_every_cpu_device_holds(tmp_path, data_dir,  # noqa: F811
                                                             monkeypatch):
    # 8 fake CPU devices share the host's memory and each holds a copy of what is not split:
    # a host that holds the state once, but not 8 copies of it, cannot hold the run

    def never(*_a, **_kw):
        raise AssertionError("the data or train state was built before the refusal")

    cfg = micro_config(data_dir, data={"batch_size": 8}, parallel={"devices": 8})
    state = abstract_train_state(cfg)
    once = (preflight.held_bytes(state) + preflight.held_bytes(state["params"])
            + preflight.planned_none(cfg, None, "cpu"))
    monkeypatch.setattr(setup, "init_sharded_state", never)
    monkeypatch.setattr(preflight, "_host_memory", lambda: 2 * once)
    with pytest.raises(ConfigError, match=r"gradients, before any activation, on its 8 "
                       r"devices together\), but this host has .* fewer parallel.devices, or "
                       r"parallel.fsdp=true .*`moelab plan CONFIG --devices 8 --accelerator "
                       r"custom --peak-flops 1e12 --hbm-gib [\d.e-]+` sizes each option as this "
                       r"check does"):
        train(cfg, tmp_path / "run", verbose=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("devices", [1, 2])  # 2: a mesh, whose shardings need the shapes too
def test_a_start_traces_the_abstract_train_state_once(tmp_path, data_dir, monkeypatch,  # noqa: F811
                                                      devices):
    # both host checks (before and after the data's) and the shardings share one trace of the
    # whole model's init, not one each
    from moelab.train import step

    traced, init = [], step.init_train_state
    monkeypatch.setattr(step, "init_train_state", lambda *a: traced.append(1) or init(*a))

    class Built(Exception):
        pass

    def built(*_a):
        raise Built

    monkeypatch.setattr(setup, "init_sharded_state", built)  # both checks passed: stop here
    monkeypatch.setattr(preflight, "_host_memory", lambda: 64 * GIB)
    with pytest.raises(Built):
        train(micro_config(data_dir, parallel={"devices": devices}), tmp_path / "run",
              verbose=False)
    assert len(traced) == 1


def test_the_host_check_counts_the_gradient_sum_of_micro_steps(data_dir, monkeypatch):  # noqa: F811
    # gradient accumulation keeps a float32 sum of the gradients beside each micro-step's (the
    # plan's "gradient sum (micro-steps)"): a host that holds the rest but not it is refused

    from moelab.train.step import abstract_train_state

    micro = micro_config(data_dir, train={"microbatch_tokens": 64})  # 2 of the 4 sequences
    state = abstract_train_state(micro)
    grads = preflight.held_bytes(state["params"])
    rest = (preflight.held_bytes(state) + grads
            + preflight.planned_none(micro, None, "cpu", remat="none"))
    monkeypatch.setattr(preflight, "_host_memory", lambda: rest + grads // 2)
    with pytest.raises(ConfigError, match=r"MiB gradients, [\d.]+ MiB their sum over "
                       r"micro-steps, [\d.]+ MiB activations"):
        preflight.check_host_memory(micro)
    whole = micro_config(data_dir)  # no micro-steps, no sum: the state, gradients and
    monkeypatch.setattr(preflight, "_host_memory", lambda: (  # activations fit exactly
        preflight.held_bytes(state) + grads + preflight.planned_none(whole, None, "cpu")))
    preflight.check_host_memory(whole)
    # with several processes the plan it names has every process's devices, and each device of
    # this one its share of this host's memory
    mesh = SimpleNamespace(devices=np.empty(8), local_devices=[None] * 4)
    cfg = micro_config(data_dir, data={"batch_size": 8},
                       parallel={"devices": 8, "expert": 2, "fsdp": True})
    assert preflight._cpu_plan(cfg, mesh, 4 * GIB) == (
        "`moelab plan CONFIG --devices 8 --ep 2 --fsdp 4 --accelerator custom --peak-flops 1e12 "
        "--hbm-gib 1`")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_plan_of_a_mesh_is_the_planners(data_dir, remat):  # noqa: F811
    """The activations the host check and remat auto plan on a mesh are those `moelab plan`
    counts for it: the transport's buffers and FSDP's gathered weights and head included."""
    from moelab.planner import memory

    cfg = micro_config(data_dir, model={"remat": remat},
                       parallel={"devices": 4, "expert": 2, "fsdp": True, "waves": 2})
    mesh = SimpleNamespace(devices=np.empty(4), local_devices=[None] * 4)
    m = cfg.model
    rows = [t for t in memory.transport_options(cfg.parallel) if t["kind"] ==
            cfg.parallel.transport]
    report = memory.memory_report(cfg, memory.Layout(devices=4, ep=2, fsdp=2), rows,
                                  attention=memory.planned_attention(m),
                                  loss="fused" if m.loss_chunk else "materialized",
                                  experts=memory.planned_experts(m))
    (row,) = report["transports"]
    gather = report["state"]["fsdp_gather"]
    assert gather > 0 and row["peak"] > 0
    assert preflight.planned_none(cfg, mesh, "cpu", remat=remat) == pytest.approx(
        row["total"] - report["fixed"] + gather)


def test_the_plan_of_a_context_stage_takes_its_own_capacities():
    """A context stage that trains with its own receiver_cf (a drop gate's fallback writes one)
    sizes its transport's buffers with it: the plan took the run's base capacities."""
    base = ["parallel.devices=2", "parallel.expert=2", "parallel.transport=pooled_wave",
            "data.batch_size=4", "data.seq_len=64", "train.steps=10"]
    stage = "data.context_stages=[{step: 5, seq_len: 128, batch_size: 2%s}]"
    own = load_config("tiny", [*base, stage % ", parallel: {receiver_cf: 8.0}"])
    same = load_config("tiny", [*base, "parallel.receiver_cf=8.0", stage % ""])
    mesh = SimpleNamespace(devices=np.empty(2), local_devices=[None] * 2)
    plans = [preflight.planned_none(c, mesh, "cpu", start=5) for c in (own, same)]
    assert plans[0] == pytest.approx(plans[1])
    assert plans[0] > preflight.planned_none(load_config("tiny", [*base, stage % ""]), mesh,
                                             "cpu", start=5)


def test_a_stop_during_the_check_is_recorded(tmp_path, data_dir, monkeypatch):  # noqa: F811
    monkeypatch.setattr(util, "_abandoned", [])  # what a stop in native work marks (below)
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (64 * GIB, GIB))

    def interrupted(compiled):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "xla_memory", interrupted)  # Ctrl-C while it compiles
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(micro_config(data_dir, train={"steps": 2}), run, verbose=False)
    _, events = read_metrics(run / "metrics.jsonl")
    assert [e["event"] for e in events] == ["start", "aborted"]
    assert util._abandoned  # XLA's threads may still run: the CLI ends with os._exit(130)


def test_a_stop_during_setup_is_recorded_and_a_restart_says_it_starts_over(
        tmp_path, data_dir, monkeypatch, capsys):  # noqa: F811
    """A stop signal after the run's start event and before the first step (here while the
    step functions are built) is in its log, marks the process to end without interpreter
    shutdown (XLA's threads: a segmentation fault), and the next start says there was no
    checkpoint to resume from."""
    monkeypatch.setattr(util, "_abandoned", [])
    built = setup._step_functions

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(setup, "_step_functions", interrupted)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(micro_config(data_dir, train={"steps": 2}), run, verbose=False)
    _, events = read_metrics(run / "metrics.jsonl")
    assert [e["event"] for e in events] == ["start", "aborted"]
    assert events[-1]["error"] == "KeyboardInterrupt" and util._abandoned
    monkeypatch.setattr(setup, "_step_functions", built)
    capsys.readouterr()
    assert train(micro_config(data_dir, train={"steps": 2}), run)["step"] == 2
    assert f"{run}: no checkpoint to resume from (stopped before its first); training from " \
           "step 0" in capsys.readouterr().err


@pytest.mark.parametrize("devices, stages", [
    (1, []), (2, []),  # 2: a mesh, the batch sharded over it
    (1, [{"step": 2, "seq_len": 64, "batch_size": 2}])])  # a later data stage, its own shape
def test_a_run_that_fits_trains_with_the_checked_executables(tmp_path, data_dir,  # noqa: F811
                                                             monkeypatch, devices, stages):
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (64 * GIB, GIB))
    checked = []  # what the check returned: XLA's memory analysis of each step it compiled
    monkeypatch.setattr(setup, "check_step_memory",
                        lambda *a: checked.extend(preflight.check_step_memory(*a)))
    seen, listen = _compiles("step_fn")
    try:
        summary = train(micro_config(data_dir, train={"steps": 4}, parallel={"devices": devices},
                                     data={"context_stages": stages}),
                        tmp_path / "run", verbose=False)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert summary["step"] == 4
    assert len(checked) == 1 + len(stages) and all(m["temp"] > 0 for m in checked)
    if stages:  # the stage's batch (2 x 64) is not the first (4 x 32): another program
        assert checked[0] != checked[1]
    # lowered once each, by the check: every step then reused its executable
    assert len(seen) == 1 + len(stages)


def test_moelab_train_claims_its_share_of_a_gpu_unless_given_one(no_share, monkeypatch):
    import os

    for var in preflight.FRACTION_VARS:  # restored after the test, whatever it sets
        monkeypatch.setenv(var, "")
    assert preflight.claim_gpu_share() == "XLA_CLIENT_MEM_FRACTION=0.90"
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.90"
    assert preflight.claim_gpu_share() is None  # set now: kept
    for var in preflight.FRACTION_VARS:  # either name, given by the user, is left alone
        for other in preflight.FRACTION_VARS:
            monkeypatch.setenv(other, "")
        monkeypatch.setenv(var, "0.6")
        assert preflight.claim_gpu_share() is None and os.environ[var] == "0.6"


def test_the_plan_on_a_gpu_follows_its_capability(monkeypatch):
    """auto runs blocks before Hopper: the plan sizes the kernel that GPU runs, and an H200's
    where none is attached (a deviceless compile)."""
    from moelab.planner.memory import planned_experts
    from moelab.train import planned

    cfg = load_config("d1024")
    plans = {}
    for cap in (8.0, 9.0, 0.0):
        monkeypatch.setattr(planned, "cuda_capability", lambda cap=cap: cap)
        plans[cap] = planned.planned_none(cfg, None, "gpu")
    assert (planned_experts(cfg.model, 8.0), planned_experts(cfg.model, 9.0)) == ("blocks", "gmm")
    assert plans[8.0] != plans[9.0] == plans[0.0]
