"""model.remat=auto: moelab train takes remat none (on a GPU with the layer scan unrolled whole)
where its compiled step fits the device, else full (moelab.train.preflight.choose_remat); the
planner plans it the same way from its own figures. On the CPU an allocator limit is stood in
for, as in tests/test_preflight.py."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest
from jax._src import monitoring

from helpers import data_dir, micro_config  # noqa: F401 - data_dir is a fixture
from moelab.config import ConfigError, load_config
from moelab.parallel.mesh import make_mesh
from moelab.planner.memory import AUTO_FILL, planned_remat
from moelab.planner.xla import xla_memory
from moelab.run.identity import checkpoint_meta
from moelab.run.logs import read_metrics
from moelab.train import preflight
from moelab.train.loop import train
from moelab.train.step import abstract_train_state, make_train_step

GIB = 2**30


def _auto(data_dir, **train_kw):  # noqa: F811
    return micro_config(data_dir, model={"remat": "auto", "scan_unroll": 1},
                        train={"steps": 2, **train_kw})


def _trained_remat(run) -> tuple[str, int]:
    """(model.remat, model.scan_unroll) the run chose, as its log and last checkpoint record it;
    its config keeps "auto" (config.yaml, the checkpoint's config)."""
    step, meta = checkpoint_meta(run)
    assert meta["config"]["model"]["remat"] == "auto"
    assert load_config(str(run / "config.yaml")).model.remat == "auto"
    _, events = read_metrics(run / "metrics.jsonl")
    chosen = [e for e in events if e["event"] == "remat"]  # one per start or resume
    assert len(chosen) == sum(e["event"] in ("start", "resume") for e in events)
    assert all(e["reason"] for e in chosen)
    got = (chosen[-1]["policy"], chosen[-1]["scan_unroll"])
    assert got == (meta["remat"]["policy"], meta["remat"]["scan_unroll"])
    return got


def _lowerings():
    seen: list[str] = []

    def listen(event: str, duration: float, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and \
                kw.get("fun_name") == "jit(step_fn)":
            seen.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    return seen, listen


def test_the_candidates(data_dir):  # noqa: F811
    cfg = _auto(data_dir)
    n = cfg.model.n_layers
    gpu = preflight.remat_candidates(cfg, "gpu")
    assert [(c.model.remat, c.model.scan_unroll) for c in gpu] == [("none", n), ("full", 1)]
    cpu = preflight.remat_candidates(cfg, "cpu")  # XLA:CPU: the scan as configured
    assert [(c.model.remat, c.model.scan_unroll) for c in cpu] == [("none", 1), ("full", 1)]
    named = micro_config(data_dir, model={"remat": "dots"})
    assert preflight.remat_candidates(named, "gpu") == [named]
    # everything else is the config as given
    assert gpu[0].data == cfg.data and gpu[0].model.d_model == cfg.model.d_model


def test_a_train_step_refuses_auto_left_undecided(data_dir):  # noqa: F811
    with pytest.raises(ConfigError, match="model.remat=auto: moelab train picks the policy"):
        make_train_step(_auto(data_dir))


def _held(cfg) -> int:
    """Bytes of the train state (one device)."""
    import jax

    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract_train_state(cfg)))


def _step_memory(cfg) -> int:
    """XLA's bytes beyond the held state while ``cfg``'s train step runs (this CPU)."""
    import jax
    import jax.numpy as jnp

    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
    return preflight.while_running(xla_memory(
        make_train_step(cfg).lower(abstract_train_state(cfg), batch).compile()))


def test_auto_takes_none_where_it_fits_else_full(tmp_path, data_dir, monkeypatch):  # noqa: F811
    cfg = _auto(data_dir)
    none, full = (_step_memory(c) for c in preflight.remat_candidates(cfg, "cpu"))
    assert none > full  # remat none keeps every layer's residuals
    said: list[str] = []
    monkeypatch.setattr("moelab.train.setup.info", said.append)
    # room for none: it trains, its step lowered once (by the check)
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (64 * GIB, 0))
    seen, listen = _lowerings()
    try:
        train(cfg, tmp_path / "roomy", verbose=True)
        assert _trained_remat(tmp_path / "roomy") == ("none", 1) and len(seen) == 1
        assert "remat auto: remat none" in said
        # room for full only (none's plan is no more than 1.2x the limit, so it is compiled
        # and found too big): full trains, each candidate lowered once
        seen.clear()
        said.clear()
        held = _held(cfg)
        monkeypatch.setattr(preflight, "allocator_memory",
                            lambda d: (held + (none + full) // 2, held))
        train(cfg, tmp_path / "tight", verbose=True)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert _trained_remat(tmp_path / "tight") == ("full", 1) and len(seen) == 2, "\n".join(said)
    line = next(s for s in said if s.startswith("remat auto: full (remat none needs "))
    assert "where JAX may use" in line
    # the roomy run resumed where only full fits: it chooses again, its config still auto
    train(_auto(data_dir, steps=4), tmp_path / "roomy", verbose=False)
    assert _trained_remat(tmp_path / "roomy") == ("full", 1)


def test_a_candidate_that_does_not_compile_gives_way(tmp_path, data_dir,  # noqa: F811
                                                     monkeypatch):
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (64 * GIB, 0))
    real, calls = preflight.xla_memory, []

    def first_fails(compiled):
        calls.append(compiled)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: autotuning")
        return real(compiled)

    monkeypatch.setattr(preflight, "xla_memory", first_fails)
    said: list[str] = []
    monkeypatch.setattr("moelab.train.setup.info", said.append)
    train(_auto(data_dir), tmp_path / "run", verbose=True)
    assert _trained_remat(tmp_path / "run") == ("full", 1) and len(calls) == 2
    assert "remat auto: full (remat none did not compile: RuntimeError: RESOURCE_EXHAUSTED: " \
           "autotuning)" in said


def test_auto_skips_a_none_its_plan_cannot_fit(tmp_path, data_dir, monkeypatch):  # noqa: F811
    # 1 MiB: none's plan is far above 1.2x of it, so only full is compiled, and refused
    monkeypatch.setattr(preflight, "allocator_memory", lambda d: (2**20, 0))
    seen, listen = _lowerings()
    try:
        with pytest.raises(ConfigError, match="the compiled train step needs"):
            train(_auto(data_dir), tmp_path / "run", verbose=False)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert len(seen) == 1


def test_auto_on_a_cpu_plans_against_the_host(tmp_path, data_dir, monkeypatch):  # noqa: F811
    train(_auto(data_dir), tmp_path / "host", verbose=False)  # no allocator limit: the plan
    assert _trained_remat(tmp_path / "host") == ("none", 1)
    # a host that holds the run with full remat (state, gradients, activations), and whose 70%
    # does not hold none's plan
    cfg = _auto(data_dir)
    state = abstract_train_state(cfg)
    host = (preflight.held_bytes(state) + preflight.held_bytes(state["params"])
            + preflight.planned_none(cfg, None, "cpu", remat="full"))
    assert 0.7 * host < preflight.held_bytes(state) + preflight.planned_none(cfg, None, "cpu")
    monkeypatch.setattr(preflight, "_host_memory", lambda: host)
    train(cfg, tmp_path / "small", verbose=False)
    assert _trained_remat(tmp_path / "small") == ("full", 1)


def test_auto_on_a_cpu_plans_every_device_of_the_host(tmp_path, data_dir,  # noqa: F811
                                                    monkeypatch):
    """Fake CPU devices share the host's memory: none's plan counts each device's copy."""
    cfg = micro_config(data_dir, model={"remat": "auto", "scan_unroll": 1},
                       train={"steps": 2}, parallel={"devices": 2})
    mesh = make_mesh(devices=jax.devices()[:2])
    state = abstract_train_state(cfg)
    one = preflight.held_bytes(state) + preflight.held_bytes(state["params"])
    host = 2 * (one + preflight.planned_none(cfg, mesh, "cpu", remat="full"))  # full fits
    none = preflight.planned_none(cfg, mesh, "cpu")
    assert one + none <= 0.7 * host < 2 * (one + none)  # one device's plan would fit
    monkeypatch.setattr(preflight, "_host_memory", lambda: host)
    train(cfg, tmp_path / "run", verbose=False)
    assert _trained_remat(tmp_path / "run") == ("full", 1)


def test_auto_without_the_check_takes_full_on_an_accelerator(data_dir, monkeypatch):  # noqa: F811
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    monkeypatch.setattr(preflight, "_local_devices", lambda mesh: [gpu])
    cands = preflight.remat_candidates(_auto(data_dir, memory_check=False), "gpu")
    used, said = [], []
    got = preflight.choose_remat(cands, lambda c: used.append(c) or (lambda step: None),
                                 None, 0, None, said.append)
    assert used == [cands[-1]]  # nothing compiled: full
    assert got == ("full (remat none with the layer scan unrolled only where its compiled step "
                   "shows it fits; train.memory_check=false)")
    assert said == [f"remat auto: {got}"]


def test_the_plan_of_auto():
    acts = {"none": {"peak": 60 * GIB}, "full": {"peak": 10 * GIB}}
    assert planned_remat("dots", acts, 20 * GIB, 0.0) == "dots"  # a named policy is itself
    assert planned_remat("auto", acts, 20 * GIB, 80 * GIB / AUTO_FILL) == "none"
    assert planned_remat("auto", acts, 20 * GIB, 79 * GIB / AUTO_FILL) == "full"
    assert planned_remat("auto", acts, 20 * GIB, 0.0) == "full"  # no device memory known
    # the ladder presets train with auto: d768 and d1024 plan none on an H200, as the H200
    # takes it (XLA's compile of d1024 unrolled, 107.4 GiB, fits moelab train's 90%)
    from moelab.planner.cluster import accelerator
    from moelab.planner.memory import Layout, memory_report

    for rung in ("d768", "d1024"):
        cfg = load_config(rung, ["data.batch_size=16"])
        assert cfg.model.remat == "auto"
        rep = memory_report(cfg, Layout(), hbm_bytes=accelerator("h200").hbm_bytes,
                            attention="fused", loss="fused", experts="gmm")
        assert (rep["remat"], rep["remat_setting"]) == ("none", "auto"), rung
