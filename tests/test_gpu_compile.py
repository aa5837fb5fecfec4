"""bench/gpu_compile.py: the GPU's compile of the benchmark rows on a machine without one. CI
has no CUDA plugin, so it checks the dry run (the same code compiling the rows' tiny CPU
forms for this CPU), the options and the message a machine without the plugin gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # after everything else: bench/ holds generic names


@pytest.fixture
def gpu_compile(monkeypatch):
    """The module, imported with this process's JAX_PLATFORMS restored afterwards (it sets
    the variable for the JAX it runs under)."""
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    import gpu_compile

    return gpu_compile


def test_the_dry_run_compiles_each_row_and_reports_its_kernels(tmp_path):
    name = f"test_gpu_compile_{os.getpid()}"
    out = ROOT / "bench" / "results" / f"{name}.json"
    try:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_compile.py"), "--dry-run",
                            "d1024", "d768-remat-none", "--top", "3", "--name", name],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert p.returncode == 0, p.stdout + p.stderr
        rows = json.loads(out.read_text())["rows"]
    finally:
        out.unlink(missing_ok=True)
    assert [r["row"] for r in rows] == ["d1024", "d768-remat-none"]
    assert "model.remat=none" in rows[1]["overrides"]
    for r in rows:
        assert r["memory_gib"] > r["arguments_gib"] > 0
        cats = r["by_category"]
        assert r["roofline_ms"] == pytest.approx(sum(c["ms"] for c in cats.values()))
        assert r["dot_tflop"] == pytest.approx(sum(c["tflop"] for c in cats.values()))
        assert r["dot_tflop"] >= r["model_tflop"] > 0  # a step runs at least its model's dots
        heavy = [k["ms"] for k in r["heaviest"]]
        assert len(heavy) == 3 and heavy == sorted(heavy, reverse=True) and heavy[0] > 0
        assert 0 < r["roofline_mfu"]
    assert "roofline MFU" in p.stdout and "d768-remat-none" in p.stdout


def test_a_dry_run_on_several_devices_compiles_the_runs_layout():
    """``--gpus 8``: the row on 8 devices (fake CPU ones in a dry run), each with the row's
    batch, laid out as --set says (expert parallelism 4, FSDP); one device's memory, model
    FLOPs and roofline, its collectives among the categories."""
    from moelab.config import load_config
    from moelab.planner.counts import train_flops_per_token

    name = f"test_gpu_compile_gpus_{os.getpid()}"
    out = ROOT / "bench" / "results" / f"{name}.json"
    try:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_compile.py"), "--dry-run",
                            "d768", "--gpus", "8", "--set", "parallel.expert=4",
                            "parallel.fsdp=true", "--top", "1", "--name", name],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
        assert p.returncode == 0, p.stdout + p.stderr
        (r,) = json.loads(out.read_text())["rows"]
    finally:
        out.unlink(missing_ok=True)
    assert "8 devices of this CPU" in p.stdout
    cfg = load_config("tiny", r["overrides"])
    assert (cfg.parallel.devices, cfg.parallel.expert, cfg.parallel.fsdp) == (8, 4, True)
    assert cfg.data.batch_size == 8 * 2  # the dry row's 2 sequences on each device
    one_device = train_flops_per_token(cfg.model, cfg.data.seq_len) * 2 * cfg.data.seq_len
    assert r["model_tflop"] == pytest.approx(one_device / 1e12)
    coll = r["by_category"]["collectives"]
    assert coll["gb"] > 0 and coll["ms"] > 0 and coll["tflop"] == 0


def test_a_dry_run_needs_as_many_cpu_devices_as_gpus(gpu_compile):
    with pytest.raises(SystemExit) as e:
        gpu_compile.cpu_devices(9)  # the suite has 8
    assert "--xla_force_host_platform_device_count=9" in str(e.value)


def test_without_the_cuda_plugin_it_says_how_to_install_it(gpu_compile, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)  # import fails
    with pytest.raises(SystemExit) as e:
        gpu_compile.gpu_devices("h200")
    assert gpu_compile.CUDA_INSTALL in str(e.value) and "--dry-run" in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["peak"], "unknown training row 'peak'"),
    (["d1024", "--set", "model.nope=1"], "row d1024 with --set"),
    (["--mem-fraction", "0"], "--mem-fraction: must be in (0, 1]"),
    (["--top", "-1"], "--top: must be >= 0"),
    (["--gpus", "0"], "--gpus: must be >= 1"),
    (["d1024", "--set", "parallel.devices=8", "parallel.expert=8"],
     "--set parallel.devices: the devices a row compiles for are --gpus N's"),
    (["d1024", "--gpus", "8", "--set", "parallel.expert=16"], "row d1024 with --set and --gpus"),
    (["d1024-ragged-fusion", "d1024"], "rows with XLA flags of their own compile one at a time"),
])
def test_bad_options_fail_before_anything_compiles(gpu_compile, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        gpu_compile.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_set_replaces_a_field_the_row_sets_itself(gpu_compile):
    """``--set model.remat=dots`` on a row that sets model.remat compiles dots (a config takes
    each field once: the row's own value goes), and with ``--gpus`` the devices and batch stay."""
    rows = gpu_compile.gpu_mfu.all_rows()
    args = gpu_compile.parse_args(["d1024-remat-full", "--gpus", "8", "--set", "model.remat=dots",
                                   "parallel.expert=8"], rows)
    spec = rows["d1024-remat-full"].spec
    assert "model.remat=full" in spec["overrides"]
    overrides = gpu_compile.row_overrides(spec, args)
    assert [o for o in overrides if o.startswith("model.remat=")] == ["model.remat=dots"]
    assert "parallel.devices=8" in overrides and overrides[-1] == "parallel.expert=8"
    cfg = gpu_compile.row_config(spec, args)
    assert (cfg.model.remat, cfg.parallel.expert, cfg.parallel.devices) == ("dots", 8, 8)


def test_a_row_fits_when_its_memory_is_within_the_share(gpu_compile):
    """``fits`` compares XLA's total (arguments + outputs - aliased + temporaries) with the
    share of the device given (the dry run's CPU has no limit, so it is tested here)."""
    import jax
    import jax.numpy as jnp

    from moelab.config import load_config

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(x).compile()
    cfg = load_config("tiny")
    total = compiled.memory_analysis().argument_size_in_bytes
    args = (compiled, cfg, gpu_compile.CPU_PEAK, 1e11)
    assert gpu_compile.analyse(*args, capacity=float("inf"), top=1)["fits"] is True
    small = gpu_compile.analyse(*args, capacity=total / 2, top=1)
    assert small["fits"] is False and small["memory_gib"] * 2**30 >= total


COLLECTIVES_HLO = """HloModule links

ENTRY %main (a: f32[4,8], b: f32[16], c: bf16[2,8], r: bf16[64,8], o: bf16[512,8], n: s64[8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %c = bf16[2,8]{1,0} parameter(2)
  %r = bf16[64,8]{1,0} parameter(3)
  %o = bf16[512,8]{1,0} parameter(4)
  %n = s64[8]{0} parameter(5)
  %ar = (f32[4,8]{1,0}, f32[16]{0}) all-reduce(%a, %b), to_apply=%add
  %ag = (bf16[2,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%c), dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done(%ag)
  %sync = bf16[16,8]{1,0} all-gather(%c), dimensions={0}
  %ra = ((bf16[64,8]{1,0}, bf16[512,8]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), bf16[512,8]{1,0}) ragged-all-to-all-start(%r, %o, %n, %n, %n, %n)
  ROOT %out = f32[4,8]{1,0} add(%a, %a)
}
"""


def test_link_bytes_count_every_operand_and_an_all_gathers_results():
    """A combined all-reduce moves all its operands (twice: reduce, then broadcast); an
    all-gather its result, whose async start also lists its operand; a ragged all-to-all its
    smaller buffer."""
    import gpu_profile as gp

    h = gp.Hlo(COLLECTIVES_HLO)
    moved = {n: gp.link_bytes(h, h.ins[n]) for n in ("ar", "ag", "sync", "ra")}
    assert moved == {"ar": 2 * (4 * 8 * 4 + 16 * 4), "ag": 16 * 8 * 2, "sync": 16 * 8 * 2,
                     "ra": 64 * 8 * 2}
