"""bench/gpu_mfu.py, the one-command GPU benchmark, as a CPU dry run of the same driver: rows in
their own processes, the JSONL growing as rows end, the deadline, a crashing row, a parent
that never imports JAX; plus the pieces only a GPU run exercises end to end (trace readers,
kernel categories, the expert legs' reference check), on inputs made here."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # after everything else: bench/ holds generic names

import gpu_legs
import gpu_profile as gp
from helpers import VOCAB, data_dir  # noqa: F401 - data_dir is a fixture
from moelab.train.peak import CPU_FLOPS_PER_CORE, cpu_cores


def driver(args: list[str], out: Path, name: str, poll=None) -> tuple:
    """Run the driver with $OUT=out; returns (exit code, stdout + stderr, JSONL line counts
    seen while it ran)."""
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT / "src")}
    log = out / "driver.txt"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_mfu.py"), "--name",
                              name, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
        seen = []
        while poll is not None and p.poll() is None:
            seen.append(len(poll.read_text().splitlines()) if poll.exists() else 0)
            time.sleep(0.2)
        p.wait(timeout=600)
    return p.returncode, log.read_text(), seen


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def name(request):
    """A results name of this test's own; its files in bench/results are removed after."""
    name = f"test_{request.node.name}_{os.getpid()}".replace("[", "_").replace("]", "")
    name = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)
    yield name
    results = ROOT / "bench" / "results"
    for suffix in (".json", ".jsonl"):
        (results / f"{name}{suffix}").unlink(missing_ok=True)
    shutil.rmtree(results / f"{name}_logs", ignore_errors=True)


def test_dry_run_measures_each_row_in_its_own_process(tmp_path, name):
    jsonl = tmp_path / f"{name}.jsonl"
    rc, text, seen = driver(["--dry-run", "--rows", "d1024", "legs-d1024", "crash",
                             "--deadline", "500"], tmp_path, name, poll=jsonl)
    assert rc == 0, text
    rows = {r["row"]: r for r in lines(jsonl)}
    # table order, one line per row: the crash first, then peak (joined for the share)
    assert [r["row"] for r in lines(jsonl)] == ["crash", "peak", "d1024", "legs-d1024"]
    assert any(0 < n < 4 for n in seen), seen  # lines appear as rows end, not at the end
    assert lines(jsonl) == lines(ROOT / "bench" / "results" / f"{name}.jsonl")

    crash, peak, train, legs = (rows[k] for k in ("crash", "peak", "d1024", "legs-d1024"))
    assert crash["status"].startswith("failed") and "deliberate failure" in crash["status"]
    assert crash["note"].startswith("partial result")  # saved before the failure, kept
    assert all(r["status"] == "ok" for r in (peak, train, legs)), text
    pids = {r["pid"] for r in rows.values()}
    assert len(pids) == 4 and os.getpid() not in pids

    assert peak["peak_flops"] > 0  # row 1's measured figure: the others' share of it
    # MFU against the rated peak (on the dry run's CPU: the nominal per-core figure)
    assert train["rated_peak_flops"] == cpu_cores() * CPU_FLOPS_PER_CORE
    assert train["mfu"] == pytest.approx(train["model_flops_per_s"] / train["rated_peak_flops"])
    assert train["share_of_measured_peak"] == pytest.approx(
        train["model_flops_per_s"] / peak["peak_flops"])
    assert train["tokens_per_s"] > 0 and train["xla_memory_gib"]["temp"] > 0
    prof = train["profile"]
    assert prof["source"] == "jax.profiler.ProfileData"  # measured, not the estimate
    cats = prof["by_category"]
    assert set(cats) == set(gp.CATEGORIES)
    for c in (gp.GROUPED, gp.MATMUL, gp.OPTIMIZER, gp.ATTENTION, gp.MOVES):
        assert cats[c]["ms"] > 0 and prof["estimate"][c]["gb"] > 0, c
    assert prof["estimate"][gp.GROUPED]["tflop"] > 0

    status = {(r["impl"], r["leg"]): r for r in legs["legs"]}
    assert status[("mgpu", "all")]["status"] == "needs a GPU"
    checked = [r for k, r in status.items() if k[0] != "mgpu"]
    # every entry but the GPU-only one and blocks (named in its own row), three legs each
    import gpu_mfu

    assert list(gpu_mfu.LEGS_DEFAULT) == [n for n in gpu_legs.LEGS if n != "blocks"]
    assert len(checked) == 3 * (len(gpu_mfu.LEGS_DEFAULT) - 1), checked
    assert all(r["status"] == "ok" for r in checked), checked
    assert all(r["max_rel_err"] <= 2e-2 for r in checked)

    summary = json.loads((tmp_path / f"{name}.json").read_text())
    assert summary["parent_imported_jax"] is False and len(summary["rows"]) == 4
    # $OUT holds few files: the logs in one, a profiled row's raw material in its own
    logs = (tmp_path / f"{name}_logs.txt").read_text()
    assert all(f"===== {r}.log" in logs for r in rows)
    with gzip.open(tmp_path / "d1024_profile.json.gz", "rt") as f:
        raw = json.load(f)
    assert raw["hlo"].startswith("HloModule") and raw["events"]
    again = [(e["plane"], e["line"], e["name"], e["ns"],
              {"hlo_op": e["hlo_op"], "hlo_module": e["hlo_module"]}) for e in raw["events"]]
    assert gp.op_times(again, gp.Hlo(raw["hlo"])).ops  # readable again
    assert text.rstrip().splitlines()[-1].split()[0] == "legs-d1024"  # the table comes last


def test_rows_that_cannot_fit_the_deadline_are_skipped(tmp_path, name):
    rc, text, _ = driver(["--dry-run", "--rows", "dense-d1024", "--deadline", "12"], tmp_path,
                         name)
    assert rc == 0, text
    rows = lines(tmp_path / f"{name}.jsonl")
    assert [r["row"] for r in rows] == ["peak", "dense-d1024"]
    assert all(r["status"].startswith("skipped: deadline") for r in rows), rows
    assert not any("pid" in r for r in rows)  # no child was started


@pytest.mark.parametrize("args, message", [
    (["--rows", "d768", "data.batch_size=4"], "unknown row 'data.batch_size=4' (an option"),
    (["--rows", "crash"], "unknown row 'crash'"),  # the dry run's own row
    (["--deadline", "0"], "--deadline: must be > 0"),
    (["--mem-fraction", "1.5"], "--mem-fraction: must be in (0, 1]"),
    (["--experts", "--rows", "d768"], "use --rows or --experts"),
])
def test_bad_options_fail_before_any_row(tmp_path, name, args, message):
    rc, text, _ = driver(args, tmp_path, name)
    assert rc == 2 and message in text, text
    assert not (tmp_path / f"{name}.jsonl").exists()


def test_a_kernel_that_failed_its_legs_does_not_train(tmp_path, monkeypatch):
    """The gmm kernel fails a leg in legs-d1024: the rows after it that train with it
    (d768-batch128k, whose ``auto`` is gmm on a GPU) are skipped, saying why, and the rows that
    do not (mgpu) still run. The training rows before the legs (d1024 and its ablations) run
    whatever the legs will show: they come first by importance."""
    import gpu_mfu

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_mfu, "RESULTS", tmp_path)
    legs = [{"impl": "blocks", "leg": "fwd", "status": "ok"},
            {"impl": "mgpu", "leg": "all", "status": "needs a GPU"},
            {"impl": "gmm", "leg": "wgrad", "status": "XlaRuntimeError: RESOURCE_EXHAUSTED"}]
    ran = []

    def child(spec, timeout, env, log):
        ran.append(spec["name"])
        return "ok", ({"legs": legs} if spec["kind"] == "legs" else {"peak_flops": 1.0})

    monkeypatch.setattr(gpu_mfu, "run_child", child)
    rows = gpu_mfu.all_rows()
    args = gpu_mfu.parse_args(["--rows", "legs-d1024", "dense-d1024", "d768-batch128k",
                               "d1024-mgpu", "--name", "kernels"], rows)
    records = {r["row"]: r for r in gpu_mfu.run(args, gpu_mfu.select(args, rows))[0]}
    assert ran == ["peak", "dense-d1024", "legs-d1024", "d1024-mgpu"]
    assert records["d768-batch128k"]["status"] == ("skipped: gmm failed in legs-d1024 (wgrad: "
                                                   "XlaRuntimeError: RESOURCE_EXHAUSTED)")
    assert gpu_mfu.failed_kernel(rows["d1024-mgpu"], list(records.values())) == ""
    kernels = {r.name: r.kernel for r in rows.values() if r.spec["kind"] == "train"}
    assert kernels["d1024"] == kernels["d1024-remat-dots"] == "gmm"
    assert (kernels["dense-d1024"], kernels["d1024-blocks"]) == ("", "blocks")


@pytest.mark.parametrize("dry_run", [False, True])
def test_every_row_passes_the_drivers_checks(dry_run, monkeypatch):
    """Every row, those run only when named included, loads its config in the real table and in
    the dry run's: a row's own setting replaces the shared one (the config takes each field
    once), so e.g. ``model.loss_chunk=0`` or ``data.batch_size=1024`` are not refused."""
    import gpu_mfu

    monkeypatch.delenv("OUT", raising=False)  # a run's $OUT that is no folder is refused
    rows = gpu_mfu.all_rows()
    for argv in ([], ["--rows", *rows]):
        args = gpu_mfu.parse_args(argv + (["--dry-run"] if dry_run else []), rows)
        assert args.deadline > 0
    spec = rows["d1024-no-chunked-loss"].spec["overrides"]
    assert [o for o in spec if o.startswith("model.loss_chunk=")] == ["model.loss_chunk=0"]


def test_a_rows_dry_run_trains_under_its_remat_policy():
    """A row that names a remat policy (those measured under the former default pin full)
    names the same one in its dry run, where its own dry overrides replace the row's."""
    import gpu_mfu

    def remat(overrides):
        return [o.split("=", 1)[1] for o in overrides if o.startswith("model.remat=")]

    rows = [r for r in gpu_mfu.all_rows().values() if r.spec["kind"] == "train"]
    pinned = [r for r in rows if remat(r.spec["overrides"])]
    assert len(pinned) >= 10
    for r in pinned:
        assert remat(r.dry["overrides"]) == remat(r.spec["overrides"]), r.name


# ----------------------------------------------------------------------------- profile parts

HLO = """HloModule jit_step_fn, is_scheduled=true

FileNames
1 "/x/moelab/model/experts.py"
2 "/x/optax/_src/transform.py"
3 "/x/moelab/model/layers.py"
4 "/x/moelab/model/transformer.py"

FunctionNames
1 "swiglu_bank"
2 "update_fn"
3 "attend"
4 "forward_hidden"

FileLocations
1 {file_name_id=4 function_name_id=4 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=1 end_column=2}
3 {file_name_id=2 function_name_id=2 line=30 end_line=30 column=1 end_column=2}
4 {file_name_id=3 function_name_id=3 line=40 end_line=40 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=0}
4 {file_location_id=4 parent_frame_id=2}

%fused_dot (p0: bf16[8,4], p1: bf16[4,16]) -> bf16[8,16] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[4,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="dot" stack_frame_id=2}
}

%body (s: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %s = (s32[], bf16[8,4]{1,0}) parameter(0)
  %x = bf16[8,4]{1,0} get-tuple-element(%s), index=1
  %w = bf16[4,16]{1,0} constant({...})
  %gemm_fusion = bf16[8,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="f" stack_frame_id=1}
  %attn = bf16[8,4]{1,0} custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="a" stack_frame_id=4}
  %sort.2 = s32[8]{0} sort(%x), dimensions={0}, to_apply=%cmp
  %adam = bf16[8,4]{1,0} multiply(%x, %x), metadata={op_name="m" stack_frame_id=3}
  ROOT %t = (s32[], bf16[8,4]{1,0}) tuple(%i, %adam)
}

%wide (b: bf16[8,4]) -> bf16[8,16] {
  %b = bf16[8,4]{1,0} parameter(0)
  %v = bf16[4,16]{1,0} constant({...})
  ROOT %dot.2 = bf16[8,16]{1,0} dot(%b, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="w" stack_frame_id=2}
}

%narrow (c: bf16[8,4]) -> bf16[8,16] {
  %c = bf16[8,4]{1,0} parameter(0)
  ROOT %pad.1 = bf16[8,16]{1,0} pad(%c, %c), padding=0_0x0_12
}

%wide2 (b2: bf16[8,4]) -> bf16[8,16] {
  %b2 = bf16[8,4]{1,0} parameter(0)
  ROOT %pad.2 = bf16[8,16]{1,0} pad(%b2, %b2), padding=0_0x0_12
}

%narrow2 (c2: bf16[8,4]) -> bf16[8,16] {
  %c2 = bf16[8,4]{1,0} parameter(0)
  ROOT %pad.3 = bf16[8,16]{1,0} pad(%c2, %c2), padding=0_0x0_12
}

ENTRY %main (a: bf16[8,4]) -> bf16[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %loop = (s32[], bf16[8,4]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %cub = (s32[8]{0}, u8[64]{0}) custom-call(%a), custom_call_target="__cub$DeviceRadixSort"
  %pick = bf16[8,16]{1,0} conditional(%k, %a, %a), branch_computations={%wide, %narrow}
  %pick2 = bf16[8,16]{1,0} conditional(%p, %a, %a), true_computation=%wide2, false_computation=%narrow2
  ROOT %out = bf16[8,4]{1,0} add(%a, %a)
}
"""


def test_hlo_instructions_get_their_category_from_op_and_python_stack():
    h = gp.Hlo(HLO)
    names = ("gemm_fusion", "attn", "sort.2", "cub", "adam", "out")
    cat = {n: gp.category(h, h.ins[n]) for n in names}
    assert cat == {"gemm_fusion": gp.GROUPED, "attn": gp.ATTENTION, "sort.2": gp.MOVES,
                   "cub": gp.MOVES, "adam": gp.OPTIMIZER, "out": gp.ELEMENTWISE}
    assert h.stack(h.ins["dot.1"])[0] == ("/x/moelab/model/experts.py", "swiglu_bank")
    # a loop's body runs its trip count; a conditional's two branches half a time each, in
    # either form XLA prints (an index's branch_computations, a predicate's true/false ones)
    times = h.executed()
    assert [times[n] for n in ("gemm_fusion", "dot.2", "pad.1", "pad.2", "pad.3", "out")] == [
        12, 0.5, 0.5, 0.5, 0.5, 1]
    est = gp.estimated(h, peak_flops=1e12, mem_bw=1e9)
    assert est[gp.GROUPED]["tflop"] == pytest.approx((12 + 0.5) * 2 * 8 * 16 * 4 / 1e12)


MOVES_HLO = """HloModule moves

%fused_dus (p0: f32[12,64,64], p1: f32[64,64], p2: s32[]) -> f32[12,64,64] {
  %p0 = f32[12,64,64]{2,1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  %b = f32[1,64,64]{2,1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[12,64,64]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %z, %z)
}

%fused_ds (q0: f32[12,64,64], q1: s32[]) -> f32[1,64,64] {
  %q0 = f32[12,64,64]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %y = s32[] constant(0)
  ROOT %ds = f32[1,64,64]{2,1,0} dynamic-slice(%q0, %q1, %y, %y), dynamic_slice_sizes={1,64,64}
}

%fused_scale (r0: f32[12,64,64], r1: s32[]) -> f32[1,64,64] {
  %r0 = f32[12,64,64]{2,1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %x = s32[] constant(0)
  %sl = f32[1,64,64]{2,1,0} dynamic-slice(%r0, %r1, %x, %x), dynamic_slice_sizes={1,64,64}
  %whole = f32[12,64,64]{2,1,0} multiply(%r0, %r0)
  ROOT %both = f32[1,64,64]{2,1,0} slice(%whole), slice={[0:1], [0:64], [0:64]}
}

%fused_dus_reduce (s0: f32[12,64,64], s1: f32[1,64,64], s2: s32[]) -> f32[] {
  %s0 = f32[12,64,64]{2,1,0} parameter(0)
  %s1 = f32[1,64,64]{2,1,0} parameter(1)
  %s2 = s32[] parameter(2)
  %w = s32[] constant(0)
  %d = f32[12,64,64]{2,1,0} dynamic-update-slice(%s0, %s1, %s2, %w, %w)
  %c = f32[] constant(0)
  ROOT %r = f32[] reduce(%d, %c), dimensions={0,1,2}, to_apply=%sum
}

%fused_dus_twice (t0: f32[12,64,64], t1: f32[1,64,64], t2: s32[]) -> f32[12,64,64] {
  %t0 = f32[12,64,64]{2,1,0} parameter(0)
  %t1 = f32[1,64,64]{2,1,0} parameter(1)
  %t2 = s32[] parameter(2)
  %v = s32[] constant(0)
  %d1 = f32[12,64,64]{2,1,0} dynamic-update-slice(%t0, %t1, %t2, %v, %v)
  ROOT %d2 = f32[12,64,64]{2,1,0} dynamic-update-slice(%d1, %t1, %v, %v, %v)
}

ENTRY %main (a: f32[12,64,64], u: f32[64,64], i: s32[]) -> f32[12,64,64] {
  %a = f32[12,64,64]{2,1,0} parameter(0)
  %u = f32[64,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %upd = f32[12,64,64]{2,1,0} fusion(%a, %u, %i), kind=kLoop, calls=%fused_dus
  %take = f32[1,64,64]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused_ds
  %start = ((f32[12,64,64]{2,1,0}, s32[]), f32[1,64,64]{2,1,0}, u32[]) fusion-start(%a, %i), kind=kLoop, calls=%fused_ds
  %done = f32[1,64,64]{2,1,0} fusion-done(%start)
  %mixed = f32[1,64,64]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused_scale
  %red = f32[] fusion(%a, %take, %i), kind=kInput, calls=%fused_dus_reduce
  %twice = f32[12,64,64]{2,1,0} fusion(%a, %take, %i), kind=kLoop, calls=%fused_dus_twice
  ROOT %out = f32[12,64,64]{2,1,0} add(%a, %a)
}
"""


def test_moved_bytes_count_what_a_kernel_reads_and_writes():
    """A scan's stacking (dynamic-update-slices in place, ending in the output) moves its
    updates, not the whole stack (an update whose result is read again is not in place); a
    fused slice reads the part it takes; an async fusion counts once, at its start;
    an operand also read whole counts whole."""
    h = gp.Hlo(MOVES_HLO)
    stack, layer = 12 * 64 * 64 * 4, 64 * 64 * 4
    moved = {n: gp.moved_bytes(h, h.ins[n]) for n in ("upd", "take", "start", "done", "mixed",
                                                      "red", "twice", "out")}
    assert moved == {"upd": layer + 4 + layer,  # the update read, then written in place
                     "take": layer + 4 + layer, "start": layer + 4 + layer, "done": 0,
                     "mixed": stack + 4 + layer,
                     "red": stack + layer + 4 + 4,  # updated, then read whole: not in place
                     "twice": 2 * layer + layer + 4,  # two updates in place, one operand read
                     "out": 3 * stack}
    ops = gp.estimated_ops(h, peak_flops=1e12, mem_bw=1e9)
    assert ops["upd"]["ms"] == pytest.approx(1e3 * moved["upd"] / 1e9)
    est = gp.estimated(h, peak_flops=1e12, mem_bw=1e9)
    assert sum(c["gb"] for c in est.values()) == pytest.approx(sum(moved.values()) / 1e9)


KERNELS_HLO = """HloModule kernels

ENTRY %main (q: bf16[2,64,4,32], k: bf16[2,64,1,32], m: s32[8], x: bf16[256,16], w: bf16[8,16,32], dy: bf16[256,32]) -> bf16[256,32] {
  %q = bf16[2,64,4,32]{3,2,1,0} parameter(0)
  %k = bf16[2,64,1,32]{3,2,1,0} parameter(1)
  %m = s32[8]{0} parameter(2)
  %x = bf16[256,16]{1,0} parameter(3)
  %w = bf16[8,16,32]{2,1,0} parameter(4)
  %dy = bf16[256,32]{1,0} parameter(5)
  %fwd = (bf16[2,4,64,32]{3,1,2,0}, f32[2,4,64]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "64", "64"], "tuple_shapes": []}, "mask_type": "CAUSAL", "sliding_window_length": 0}}
  %bwd = (bf16[2,64,4,32]{3,2,1,0}, bf16[2,64,1,32]{3,2,1,0}, bf16[2,64,1,32]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "64", "64"], "tuple_shapes": []}, "mask_type": "CAUSAL", "sliding_window_length": 16}}
  %gmm = bf16[256,32]{1,0} custom-call(%m, %x, %w), custom_call_target="__gpu$xla.gpu.triton"
  %wgrad = bf16[8,16,32]{2,1,0} custom-call(%m, %x, %dy), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %out = bf16[256,32]{1,0} add(%gmm, %dy)
}
"""


def test_kernel_flops_of_fused_attention_and_grouped_gemms():
    """cuDNN attention: 4 B H T S D over what the mask keeps (causal: (T+1)/2T; a window of
    w: (w(w+1)/2 + (T-w)w)/TS), the backward 2.5 times; a grouped GEMM: 2 rows K N per
    [groups, K, N] array, whether it reads the weights or writes their gradient."""
    h = gp.Hlo(KERNELS_HLO)
    full = 4 * 2 * 4 * 64 * 64 * 32
    assert gp._attention_flops(h, h.ins["fwd"]) == pytest.approx(full * 65 / 128)
    window = (16 * 17 / 2 + 48 * 16) / (64 * 64)
    assert gp._attention_flops(h, h.ins["bwd"]) == pytest.approx(2.5 * full * window)
    assert gp._grouped_flops(h, h.ins["gmm"]) == gp._grouped_flops(h, h.ins["wgrad"]) == \
        2 * 256 * 16 * 32


def test_trace_events_map_to_hlo_ops_from_either_reader(tmp_path):
    """Kernel events name their HLO op in an annotation (GPU) or a stat (CPU); the device plane
    wins over host events; other modules' kernels are left out."""
    h = gp.Hlo(HLO)
    dev = "/device:GPU:0"
    events = [
        (dev, "Stream #1", "sm90_gemm", 5e6, {"kernel_annotation":
                                              "Thunk:#hlo_op=gemm_fusion,hlo_module=jit_step_fn#"}),
        (dev, "Stream #1", "fmha_kernel", 2e6, {"hlo_op": "attn", "hlo_module": "jit_step_fn"}),
        (dev, "Stream #1", "other", 9e6, {"hlo_op": "dot.9", "hlo_module": "jit_init"}),
        (dev, "Stream #1", "memcpy", 1e6, {}),
        (dev, "XLA Ops", "gemm_fusion", 5e6, {"hlo_op": "gemm_fusion"}),  # derived: not again
        ("/host:CPU", "python", "adam", 7e6, {"hlo_op": "adam"}),
    ]
    t = gp.op_times(events, h)
    assert t.ops == {"gemm_fusion": 5e6, "attn": 2e6} and t.unknown == {"memcpy": 1e6}
    assert not t.named

    # launched from a command buffer, kernels lose their annotation: an instruction's kernel
    # is found by its spelling, a library kernel by its name, the rest is reported by name
    graph = [(dev, "Stream #2", "gemm_fusion", 4e6, {}),
             (dev, "Stream #2", "sort_2", 3e6, {}),
             (dev, "Stream #2", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 6e6, {}),
             (dev, "Stream #2", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 2e6, {}),
             (dev, "Stream #2", "gmm_wgrad", 8e6, {}),
             (dev, "Stream #2", "redzone_checker", 1e6, {})]
    t = gp.op_times(graph, h)
    assert t.ops == {"gemm_fusion": 4e6, "sort.2": 3e6}
    assert t.named == {gp.MATMUL: 6e6, gp.ATTENTION: 2e6, gp.GROUPED: 8e6}
    assert t.unknown == {"redzone_checker": 1e6}
    out = gp._by_category(h, t, "test")
    assert out["by_category"][gp.GROUPED]["ms"] == pytest.approx(12.0)  # 4 by op, 8 by name
    assert out["busy_ms"] == pytest.approx(23.0) and out["unattributed_ms"] == pytest.approx(1)
    assert out["top_unattributed"] == [{"kernel": "redzone_checker", "ms": 1.0}]

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": dev}},
        {"ph": "X", "pid": 7, "tid": 1, "name": "k", "dur": 3000.0, "args": {"hlo_op": "sort.2"}},
    ]}
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
        json.dump(trace, f)
    out = gp.measured(h, str(tmp_path))
    assert out["source"] == "perfetto trace JSON"
    assert out["by_category"][gp.MOVES]["ms"] == pytest.approx(3.0)


def test_a_wrong_expert_kernel_fails_its_check(monkeypatch):
    """The legs' reference is a host float32 matmul, not another kernel: a kernel off by 10%
    is caught (and a correct one passes)."""
    import gpu_legs
    from moelab.model.grouped_matmul import reference_backend

    fwd, dgrad, wgrad = reference_backend()
    monkeypatch.setitem(gpu_legs.LEGS, "off", lambda: gpu_legs.Legs(
        lambda x, w, c: fwd(x, w, c) * 1.1, dgrad, wgrad))
    x, w, dy, counts = gpu_legs.problem(512, 16, 32, 8)
    rows = {r["leg"]: r for r in gpu_legs.run_impl("off", x, w, dy, counts, budget_s=0.0)}
    assert rows["fwd"]["status"] == "WRONG" and rows["fwd"]["max_rel_err"] > 0.05
    assert rows["dgrad"]["status"] == rows["wgrad"]["status"] == "ok"


def test_a_kernel_wrong_for_one_group_fails_its_check(monkeypatch):
    """A group outside the five checked closely (here one of 16) is still checked: a kernel
    off by 10% on that group's rows alone is caught."""
    import jax.numpy as jnp

    from moelab.model.grouped_matmul import reference_backend

    fwd, dgrad, wgrad = reference_backend()
    x, w, dy, counts = gpu_legs.problem(512, 16, 32, 16)
    spans = gpu_legs.sorted_rows(x, w, dy, counts)[4]
    start, n, g = next(s for s in spans if s[1] and s not in gpu_legs._sample(spans, 0))
    rows = jnp.arange(x.shape[0])
    off = jnp.where((rows >= start) & (rows < start + n), 1.1, 1.0)[:, None]
    monkeypatch.setitem(gpu_legs.LEGS, "off", lambda: gpu_legs.Legs(
        lambda x, w, c: (fwd(x, w, c) * off).astype(x.dtype), dgrad, wgrad))
    rows = {r["leg"]: r for r in gpu_legs.run_impl("off", x, w, dy, counts, budget_s=0.0)}
    assert rows["fwd"]["status"] == "WRONG" and rows["fwd"]["max_rel_err"] > 0.05, (g, rows)
    assert rows["dgrad"]["status"] == rows["wgrad"]["status"] == "ok"


def test_the_legs_rows_run_the_presets_expert_shapes():
    """One row per token and route, the routed width into the expert width, a group per expert,
    at the training rows' 65,536 tokens: the shape the training rows' experts run."""
    import gpu_mfu
    from moelab.config import load_config

    rows = gpu_mfu.all_rows()
    for preset in ("d768", "d1024"):
        m = load_config(preset).model
        shape = [65536 * m.top_k, m.routed_width, m.expert_dim, m.n_experts]
        assert rows[f"legs-{preset}"].spec["shape"] == shape, preset
    assert rows["legs-d1024"].spec["shape"] == [524288, 512, 512, 384]
    assert rows["gmm-tiles-d1024"].spec["shape"] == rows["legs-d1024"].spec["shape"]


@pytest.mark.parametrize("bad,message", [
    ("gmm[]", "a gmm variant is gmm[field=int,...]"),
    ("gmm[warps=8]", "unknown field 'warps'; fields: block_n"),
    ("gmm[block_n=96]", "block_n='96' must be a whole number >= 16, a power of two"),
    ("gmm[tile=8]", "tile='8' must be a whole number >= 16"),
    ("gmm[num_stages=0]", "num_stages='0' must be a whole number >= 1"),
    ("gmm[num_warps=x]", "num_warps='x' must be a whole number"),
    ("gmm-fast", "not one of ceiling, gmm, gmm_gather, dense"),
])
def test_a_bad_expert_kernel_name_says_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gpu_legs.legs_of(bad)


def test_the_gmm_tile_sweep_runs_each_variant_and_lowers_each_for_cuda():
    """The sweep's variants (gpu_mfu.GMM_TILES) read as the GmmBlocks and row tile they name; a
    row tile and block sizes off the defaults compute the right legs (interpret mode, checked
    against the host reference); and every variant's three kernels lower for CUDA at the d1024
    expert shape: Triton accepts each tile shape (whether it fits shared memory, only the GPU
    row can tell)."""
    import dataclasses

    import gpu_mfu
    from moelab.model.grouped_gemm import GmmBlocks, GroupTiles, gmm_backend
    from moelab.planner.as_gpu import traced_as_gpu

    assert gpu_legs.gmm_variant("gmm[tile=256,num_warps=8]") == (256, GmmBlocks(num_warps=8))
    variants = [n for n in gpu_mfu.GMM_TILES if n.startswith("gmm[")]
    assert len(set(map(gpu_legs.gmm_variant, variants))) == len(variants) >= 8
    assert (gpu_legs.BLOCK, GmmBlocks()) not in map(gpu_legs.gmm_variant, variants)

    x, w, dy, counts = gpu_legs.problem(1024, 32, 64, 8)
    for name in ("gmm[tile=16,block_k=16]", "gmm[tile=64,block_n=16,wgrad_k=16,wgrad_n=32]"):
        rows = gpu_legs.run_impl(name, x, w, dy, counts, budget_s=0.0)
        assert [r["status"] for r in rows] == ["ok"] * 3, rows

    _, K, N, G = gpu_mfu.expert_shape("d1024")
    T = 8  # row tiles: the grid's length, not its shape
    tiles = GroupTiles(*(jax.ShapeDtypeStruct((n,), "int32") for n in (T, T, G, G)))
    kernels = [(tile, gmm_backend(dataclasses.replace(blocks, interpret=False)))
               for tile, blocks in map(gpu_legs.gmm_variant, variants)]

    def legs(w, tiles, *xs):
        out = []
        for (_, (fwd, dgrad, wgrad)), x in zip(kernels, xs):
            y = fwd(x, w, tiles)
            out += [y, dgrad(y, w, tiles), wgrad(x, y, tiles)]
        return out

    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, "bfloat16")
    with traced_as_gpu():
        hlo = jax.jit(legs).trace(bf16(G, K, N), tiles, *(bf16(T * t, K) for t, _ in kernels)
                                  ).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3 * len(variants)


def test_every_gpu_training_row_lowers_for_cuda(monkeypatch):
    """Each training row of the real table (not the dry run's), at its own shapes, traced with
    a GPU's choices and lowered for CUDA here: the custom calls it asks of a GPU are there
    (cuDNN attention unless the row asks for chunked; Triton kernels exactly in the rows that
    train with gmm, the GPU's default, Mosaic GPU kernels exactly in the mgpu row, the one row
    the dry run cannot run). A row that fails this would fail on the GPU before its first
    step."""
    import gpu_mfu
    import gpu_rows
    from moelab.config.model import RAGGED_FUSION_FLAG

    rows = [r for r in gpu_mfu.all_rows().values() if r.spec["kind"] == "train"]
    assert [r.name for r in rows if r.gpu_only] == ["d1024-mgpu"]
    flags = os.environ.get("XLA_FLAGS", "")
    for row in rows:
        # the row's own flags, as its process starts with them (read when tracing)
        monkeypatch.setenv("XLA_FLAGS", f"{flags} {row.spec['xla_flags']}".strip())
        hlo = gpu_rows.lowered_for_cuda(row.spec)
        chunked = "model.attention_impl=chunked" in row.spec["overrides"]
        assert ("__cudnn$fmha" in hlo) != chunked, row.name
        assert ("__gpu$xla.gpu.triton" in hlo) == (row.kernel == "gmm"), row.name
        assert ("@mosaic_gpu" in hlo) == (row.name == "d1024-mgpu"), row.name
        if RAGGED_FUSION_FLAG in row.spec["xla_flags"]:
            assert "ragged_dot" in hlo, row.name


def test_the_moelab_train_row_runs_a_whole_run(tmp_path, data_dir):  # noqa: F811
    """``moelab-train-tiny``'s kind, here on the suite's data at micro shapes: a whole
    ``moelab train`` run (steps, final evaluation, summary) in a temporary run folder, its
    figures saved in the row."""
    import gpu_mfu
    import gpu_rows

    row = gpu_mfu.all_rows()["moelab-train-tiny"]
    assert (row.spec["kind"], row.spec["preset"], row.spec["overrides"]) == (
        "moelab_train", "tiny", [])  # the README's first run, as it is
    spec = {**row.dry, "overrides": [f"data.data_dir={data_dir}", f"model.vocab_size={VOCAB}",
                                     "model.n_layers=2", "data.seq_len=32", "data.batch_size=4",
                                     "train.steps=3", "train.eval_every=1000",
                                     "train.ckpt_every=1000", "train.log_every=1"]}
    gpu_rows.moelab_train(spec, gpu_rows.Row(str(tmp_path / "row.json")))
    saved = json.loads((tmp_path / "row.json").read_text())
    assert saved["step"] == saved["steps"] == 3 and saved["run_s"] > 0
    assert set(saved["heldout_bpb"]) == {"prose", "code", "logs"}
    assert all(0 < v < 20 for v in saved["heldout_bpb"].values())
    assert saved["train_loss"] > 0 and saved["tokens_per_s"] > 0
