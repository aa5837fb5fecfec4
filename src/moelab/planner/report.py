"""What ``moelab plan`` prints: the plan as a JSON-ready dict (``build_plan``) and as text
(``format_plan``)."""

from __future__ import annotations

import dataclasses

from moelab.config import RunConfig
from moelab.parallel import transport
from moelab.planner.cluster import Accelerator, GiB, MiB, cluster_estimate
from moelab.planner.counts import flops_report, param_breakdown, param_counts, run_tokens
from moelab.planner.memory import (
    AUTO_FILL,
    PLAN_FILL,
    Layout,
    memory_report,
    planned_attention,
    planned_experts,
)


def build_plan(cfg: RunConfig, *, tokens: float = 0.0, acc: Accelerator | None = None,
               devices: int = 0, mfus: tuple[float, ...] = (), tokens_per_s: float = 0.0,
               layout: Layout | None = None, transports: list[dict] | None = None,
               attention: str | None = None, loss: str = "materialized") -> dict:
    """Everything ``moelab plan`` prints, as a dict (JSON-ready). ``attention`` None: the
    kernel the config runs on ``acc`` (``planned_attention``)."""
    transport.check_config(cfg)  # the transports a training run of cfg would use
    m = cfg.model
    tokens = tokens or run_tokens(cfg)
    out = {"model": dataclasses.asdict(m), "seq_len": cfg.data.seq_len,
           "params": param_counts(m), "breakdown": param_breakdown(m),
           "flops": flops_report(m, cfg.data.seq_len, tokens)}
    if acc is not None and devices and (mfus or tokens_per_s):
        fpt = out["flops"]["per_token"]
        runs = [cluster_estimate(fpt, tokens, acc, devices, mfu=f) for f in mfus]
        if tokens_per_s:
            runs.append(cluster_estimate(fpt, tokens, acc, devices, tokens_per_s=tokens_per_s))
        out["cluster"] = {"peak_flops": acc.peak_flops, "runs": runs}
    if layout is not None:
        cuda = acc.cuda_capability if acc is not None else 0.0
        out["memory"] = memory_report(cfg, layout, transports,
                                      acc.hbm_bytes if acc is not None else 0.0,
                                      attention=attention or planned_attention(m, cuda),
                                      loss=loss, experts=planned_experts(m, cuda))
        out["memory"]["nvidia_gpu"] = cuda > 0  # what the memory margin was measured on
    return out


def _b(n: float) -> str:
    """Parameter count with its rounded form: 535,477,088,256 (535.48B)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,.0f} ({n / size:.2f}{unit})"
    return f"{n:,.0f}"


def format_plan(name: str, plan: dict) -> str:
    """``build_plan``'s dict as the text ``moelab plan`` prints."""
    m, p = plan["model"], plan["params"]
    lines = [f"{name}: total {_b(p['total'])} parameters, active {_b(p['active'])}; "
             f"{m['n_layers']} layers, d_model {m['d_model']}, {m['n_experts']} expert{'s' * (m['n_experts'] != 1)} "
             f"top-{m['top_k']}, seq {plan['seq_len']}", "",
             f"  {'parameters':<22}{'total':>24}{'active per token':>24}"]
    for comp, v in plan["breakdown"].items():
        act = "-" if comp == "embedding" else f"{v['active']:,}"
        lines.append(f"  {comp:<22}{v['total']:>24,}{act:>24}")
    lines += [f"  {'total':<22}{_b(p['total']):>24}",
              f"  {'active':<22}{_b(p['active']):>24}  attention, router, {m['top_k']} routed "
              "experts, latent projections,",
              f"  {'':<46}  shared experts; no embedding or head (the published definition)",
              f"  {'per-token extras':<22}{_b(p['per_token_extra']):>24}  norms, GatedNorms, "
              "output gates, short convs", ""]
    f = plan["flops"]
    lines += ["  training FLOPs (forward + backward, attention over each layer's window)",
              f"    per token   {f['per_token']:.4g}  (matmuls {f['matmul_per_token']:.4g}, "
              f"attention {f['attention_per_token']:.4g})",
              f"    {f['tokens']:.4g} tokens: {f['total']:.3g} FLOPs  (plain 6 x N_active x D: "
              f"{f['six_nd']:.3g})"]
    if "cluster" in plan:
        c = plan["cluster"]
        r0 = c["runs"][0]
        lines += ["", f"  cluster: {r0['devices']} x {r0['accelerator']} at "
                  f"{c['peak_flops'] / 1e15:.3g} PFLOP/s dense bf16 each",
                  f"    {'MFU':>7}{'tokens/s':>14}{'days':>9}{'device-hours':>15}"]
        for r in c["runs"]:
            lines.append(f"    {r['mfu']:>7.1%}{r['tokens_per_s']:>14,.0f}{_days(r['days']):>9}"
                         f"{_device_hours(r['device_hours']):>15}")
    if "memory" in plan:
        lines += [""] + _format_memory(plan["memory"], m)
    return "\n".join(lines)


def _days(days: float) -> str:
    """Days to one decimal; a run shorter than 0.1 day in hours, minutes or seconds."""
    if days >= 0.1:
        return f"{days:.1f}"
    for unit, per_day in (("h", 24), ("min", 1440), ("s", 86400)):
        if days * per_day >= 1:
            return f"{days * per_day:.3g} {unit}"
    return "<1 s"


def _device_hours(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 10 else f"{hours:.2g}"


def _fsdp_note(lay: dict) -> list[str]:
    """A line where the FSDP degree is one moelab train cannot run: it splits the non-routed
    state over the whole data axis (parallel.fsdp=true) or not at all."""
    data = lay["devices"] // lay["ep"]
    if lay["fsdp"] in (1, data):
        return []
    return [f"    (FSDP {lay['fsdp']} is a what-if: moelab train splits over the whole data axis, "
            f"--devices / --ep = {data} ways with parallel.fsdp=true, or not at all)"]


def _whole_note(st: dict, lay: dict) -> list[str]:
    """A line where FSDP leaves parameters whole: moelab train splits one only where its FSDP
    dimension divides by the degree (an FSDP of 11 splits no 6144-wide matrix)."""
    if not st.get("fsdp_whole"):
        return []
    return [f"    ({st['fsdp_whole']:,} of the rest stay whole on every device: FSDP splits a "
            f"parameter only where its largest dimension divides by {lay['fsdp']})"]


def _unit(mem: dict) -> tuple[float, str]:
    """MiB where every figure is under a GiB (a small config's read 0.00 GiB throughout, which
    no one can check against XLA or a run), else GiB; device memory is always in GiB."""
    big = max([mem["base_total"], mem["state"]["host"],
               *(t["total"] for t in mem["transports"] if "total" in t)])
    return (GiB, "GiB") if big >= GiB else (MiB, "MiB")


def _format_memory(mem: dict, m: dict) -> list[str]:
    lay, st, acts = mem["layout"], mem["state"], mem["activations"]
    wdt = "bf16" if m["compute_dtype"] == "bfloat16" else "fp32"
    host = set(lay["offload"])
    U, un = _unit(mem)

    def row(label: str, nbytes: float | None, note: str = "") -> str:
        value = f"{nbytes / U:10.2f} {un}" if nbytes is not None else f"{'-':>14}"
        return f"    {label:<30}{value}  {note}".rstrip()

    out = [f"  memory per device: {lay['devices']} device{'s' * (lay['devices'] != 1)}, "
           f"expert-parallel {lay['ep']}, "
           f"FSDP {lay['fsdp']}; {mem['sequences_per_device']} sequence"
           f"{'s' * (mem['sequences_per_device'] != 1)} = "
           f"{mem['tokens_per_device']:,} tokens per device; {wdt} compute; attention "
           f"{mem['attention']}, loss {mem['loss']}"
           + (f", experts {mem['experts']}" if lay["ep"] == 1 else ""),
           *_fsdp_note(lay),
           f"    {'parameters per device':<30}{st['params_per_device']:>14,.0f}  "
           "(routed / ep + the rest / fsdp)",
           *_whole_note(st, lay),
           row("master weights (fp32)", None if "master" in host else st["master_weights"],
               "on host" if "master" in host else ""),
           row(f"compute weights ({wdt})", st["compute_weights"] if "master" in host else None,
               "" if "master" in host else "cast layer by layer from the master"),
           row("gradients", st["gradients"]),
           row(f"optimizer state ({lay['optimizer']}"
               + (", bf16)" if mem.get("moment_dtype") == "bfloat16" else ")"),
               None if "opt" in host else st["optimizer_state"],
               "on host" if "opt" in host else "the reference's MuonH, planned: moelab trains "
               "AdamW" if lay["optimizer"] == "muon" else "")]
    if st.get("fsdp_gather"):  # none where FSDP splits no block weight
        out.append(row("FSDP gather (2 layers)", st["fsdp_gather"]))
    if "fsdp_head" in st:
        out.append(row("FSDP head + its gradient", st["fsdp_head"], "live at the loss: in the "
                       "activations below, where larger than one layer"))
    if "gradient_sum" in st:
        out.append(row("gradient sum (micro-steps)", st["gradient_sum"]))
    if st["host"]:
        out.append(row("(host memory per device)", st["host"]))
    for remat, a in acts.items():
        note = (f"saved {a['saved'] / U:.2f} + one layer {a['layer'] / U:.2f}"
                if a["layer"] else "every layer's residuals")
        if a.get("fsdp_head", 0) > a["layer"]:
            note = f"saved {a['saved'] / U:.2f} + the FSDP head {a['fsdp_head'] / U:.2f}"
        hbm = mem["hbm_bytes"]
        mark = ("" if remat != mem["remat"] else "; the config's setting"
                if mem.get("remat_setting", remat) != "auto" else "; what remat auto takes"
                + (f" (none where the step fits {AUTO_FILL:.0%} of {hbm / GiB:.1f} GiB, as "
                   "moelab train's compile decides; else full)" if hbm else ""))
        out.append(row(f"activations, remat {remat}", a["peak"], note + mark))
    out.append(row("sum (before transport buffers)", mem["base_total"]))
    if mem["hbm_bytes"]:
        best, fill = mem["least_recompute"], PLAN_FILL * mem["hbm_bytes"]
        why = ("below where XLA:GPU starts recomputing to fit" if mem.get("nvidia_gpu", True)
               else "a margin measured with XLA:GPU, not on this accelerator")
        out.append(f"    least recompute that fits {PLAN_FILL:.0%} of "
                   f"{mem['hbm_bytes'] / GiB:.1f} GiB ({why}): "
                   + (f"model.remat={best} ({(mem['fixed'] + acts[best]['peak']) / U:.2f} "
                      f"{un} before transport buffers)" if best else
                      f"no policy (full needs "
                      f"{(mem['fixed'] + acts['full']['peak']) / GiB:.2f} GiB of {fill / GiB:.1f})"
                      "; fewer tokens per device would: micro-steps "
                      "(train.microbatch_tokens), a smaller batch, more devices (--devices "
                      "with --ep/--fsdp), or state on the host (--offload)"))
    return out + _format_transports(mem, m, wdt, U, un)


def _format_transports(mem: dict, m: dict, wdt: str, U: float, un: str) -> list[str]:
    """The transport table: one MoE layer's buffers per rank and the device total, in ``un``."""
    if not mem["transports"]:
        return []
    hbm = mem["hbm_bytes"]
    width = m["latent_dim"] or m["d_model"]
    out = ["", f"    transport buffers of one MoE layer per rank ({wdt} rows of the {width}-wide "
           f"latent{', in MiB' * (un == 'MiB')}); total = device total with remat "
           f"{mem['remat']}" + (f"; HBM {hbm / GiB:.1f} GiB" if hbm else ""),
           f"    {'design':<14}{'capacity':<16}{'W':>2}{'kept':>10}{'one wave':>10}"
           f"{'peak':>10}{'bank rows':>12}{'total':>10}  fits"]
    for t in mem["transports"]:
        if "invalid" in t:  # training refuses it at this EP: no sizes
            out.append(f"    {t['kind']:<14}{_capacity(t):<16}{t.get('waves', 1):>2}  "
                       f"not runnable here: {t['invalid']}")
            continue
        out.append(f"    {t['kind']:<14}{_capacity(t):<16}{t['waves']:>2}"
                   f"{t['kept'] / U:>10.2f}{t['wave'] / U:>10.2f}{t['peak'] / U:>10.2f}"
                   f"{t['bank_rows']:>12,}{t['total'] / U:>10.2f}  "
                   + (("yes" if t["fits"] else "NO") if hbm else "-"))
    return out


def _capacity(t: dict) -> str:
    caps = [f for f in ("capacity_factor", "sender_cf", "global_sender_cf", "receiver_cf")
            if f in t]
    if "ragged_round_cf" in t:  # dropless: the factor sizes one round of its exchange
        return f"rounds of {_factor(t['ragged_round_cf'])}"
    return "cf " + "/".join(_factor(t[f]) for f in caps) if caps else "dropless"


def _factor(cf: float) -> str:
    """Two decimals, or as many as a smaller factor needs (0.001 is no 0.00)."""
    return f"{cf:.2f}" if cf >= 0.01 and round(cf, 2) == cf else f"{cf:.9g}"
