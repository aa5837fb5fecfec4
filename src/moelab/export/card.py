"""The model card of a Hugging Face export (its README.md), read from the run folder: what the
model is, what trained it (data, steps, held-out bits per byte and harness scores of the
exported step), where it came from (the run's provenance), how to load it and its limits. The
export's LICENSE is the Apache-2.0 text beside this module."""

from __future__ import annotations

from pathlib import Path

from moelab.config import ConfigError
from moelab.planner.counts import param_counts
from moelab.run.identity import read_provenance
from moelab.run.logs import read_lineage, read_metrics
from moelab.util import read_json_object

LICENSE = Path(__file__).parent / "LICENSE-2.0.txt"

HEADER = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [moelab, mixture-of-experts, custom_code]
---
"""

USAGE = """```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{path}"
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # pads on the left
batch = tok(["The ", "Once upon a time"], return_tensors="pt", padding=True)
out = model.generate(**batch, max_new_tokens=40, do_sample=True, top_p=0.9)
print(tok.batch_decode(out, skip_special_tokens=True))
```"""


def read_json(path: Path) -> dict | None:
    """A JSON object from the run folder; None when the file is missing."""
    return read_json_object(path, "fix or remove it (the export's model card reads it)",
                            ConfigError)


def _model_lines(m, seq_len: int) -> list[str]:
    counts = param_counts(m)
    return [f"- {counts['total']:,} parameters in all (embedding and LM head included); "
            f"{counts['active']:,} active per token (attention, router, routed and shared "
            "experts; no embedding or head)",
            f"- {m.n_layers} layers, width {m.d_model}, {m.n_heads} query / {m.n_kv_heads} "
            f"key-value heads of {m.head_dim}; {m.n_experts} routed experts, top-{m.top_k} "
            f"({m.router} router), {m.n_shared} shared",
            f"- trained context {seq_len} tokens; vocabulary {m.vocab_size}"]


def _data_source(d) -> str:
    """What the run trained on, as a card says it: data.source, else the corpus its data
    folder holds: the built-in one, or one built from the user's files (by the folder's
    manifest; a folder not at hand counts as built-in only where it is data/builtin)."""
    if d.source:
        return f"`{d.source}` ({d.format})"
    folder = Path(d.data_dir)
    try:
        manifest = read_json_object(folder / "corpus" / "manifest.json", "")
    except ValueError:  # damaged: said by where it is
        manifest = None
    kind = (manifest or {}).get("kind") or (
        "builtin" if folder.parts[-2:] == ("data", "builtin") else "user")
    if kind == "builtin":
        return "moelab's built-in corpus"
    return (f"a corpus built from the trainer's own files (`moelab data build`, folder "
            f"`{folder.name}`)")


def _batches(d, step: int) -> str:
    """The batch shapes the first ``step`` steps trained: '32 x 256', then each context
    stage's begun before ``step`` ('16 x 512 from step 1,000')."""
    out, last = [], None
    for g in d.segments():  # a mixture change starts a segment of the same shape
        if (g.batch_size, g.seq_len) != last and (g.start < step or last is None):
            last = g.batch_size, g.seq_len
            out.append(f"{g.batch_size} x {g.seq_len}"
                       + (f" from step {g.start:,}" if g.start else ""))
    return ", then ".join(out)


def _training_lines(cfg, step: int, prov: dict) -> list[str]:
    d = cfg.data
    source = _data_source(d)
    tok = prov.get("tokenizer_sha256")
    return [f"- checkpoint: step {step:,} of {cfg.train.steps:,} "
            f"({cfg.data.tokens_before(step):,} tokens of batches {_batches(d, step)})",
            f"- data: {source}" + (f", corpus fingerprint `{prov['corpus_fingerprint']}`"
                                   if prov.get("corpus_fingerprint") else ""),
            "- tokenizer: the run's `tokenizer.json`" + (f" (sha256 `{tok}`)" if tok else ""),
            f"- optimizer: AdamW, peak learning rate {cfg.optim.lr:g}"]


def _eval_domains(rec: dict) -> list[str]:
    return sorted({k.split("/")[1] for k in rec if k.startswith("eval/") and k.endswith("/bpb")})


def _heldout_lines(run_dir: Path, step: int) -> list[str]:
    """Held-out loss and bits per byte per domain recorded at the exported step: from the run's
    metrics.jsonl (scheduled and end-of-run evaluations), else its summary.json (the last)."""
    records, events = read_metrics(run_dir / "metrics.jsonl")
    evals = {r["step"]: ("metrics.jsonl", r) for r in records if _eval_domains(r)}
    summary = read_json(run_dir / "summary.json") or {}
    if _eval_domains(summary) and isinstance(summary.get("step"), int):
        evals.setdefault(summary["step"], ("summary.json", summary))
    if not evals:
        return ["No held-out evaluation recorded (the run's `metrics.jsonl` and `summary.json` "
                "have none)."]
    if step not in evals:
        near = min(evals, key=lambda s: (abs(s - step), s))
        return [f"No held-out evaluation was recorded at step {step:,}, the exported one; the "
                f"nearest is at step {near:,} (the run's `{evals[near][0]}`)."]
    source, rec = evals[step]
    final = source == "summary.json" or any(
        e["event"] == "finished" and e["step"] == step for e in events)
    lines = [f"From the run's `{source}`, step {step:,} ("
             + ("the end-of-run evaluation over the held-out split" if final else
                "a scheduled evaluation of `train.eval_tokens` tokens per domain") + "):", "",
             "| domain | loss (nats/token) | bits per byte |", "|---|---|---|"]
    lines += [f"| {d} | {rec.get(f'eval/{d}/loss', float('nan')):.4f} | "
              f"{rec[f'eval/{d}/bpb']:.3f} |" for d in _eval_domains(rec)]
    return lines


def _obj(value) -> dict:
    """An entry of an eval/ file that should be an object; {} where it is not (another
    tool's file, or a hand-edited one): no score is read from it."""
    return value if isinstance(value, dict) else {}


def _harness_lines(run_dir: Path, step: int) -> list[str]:
    """`moelab eval` results (eval/*.json) of the exported step: one row per task metric, each
    task from the file that scored it on the most examples (a --limit smoke run beside a full
    one would give the same metric twice), with that count."""
    best: dict[str, tuple[int, float, dict, str]] = {}
    for path in (run_dir / "eval").glob("*.json"):
        res = read_json(path) or {}
        if _obj(res.get("moelab")).get("step") != step:
            continue
        counts = _obj(res.get("n-samples"))
        for task, metrics in _obj(res.get("results")).items():
            if not isinstance(metrics, dict):
                continue
            n = {k: v for k, v in _obj(counts.get(task)).items()  # a hand-edited file's
                 if isinstance(v, int) and not isinstance(v, bool)}  # odd counts: not shown
            seen = (f"{n['effective']:,} of {n['original']:,}" if "effective" in n
                    and "original" in n else "-")
            key = (n.get("effective", 0), path.stat().st_mtime)
            if task not in best or key > best[task][:2]:
                best[task] = (*key, metrics, seen)
    rows = [f"| {task} | {name.split(',')[0]} | {value:.4g} | {seen} |"
            for task, (_, _, metrics, seen) in sorted(best.items())
            for name, value in sorted(metrics.items())
            if isinstance(value, (int, float)) and "stderr" not in name
            and name != "sample_len"]  # the harness's example count, not a score
    if not rows:
        return []
    return ["", f"`moelab eval` of step {step:,} (lm-evaluation-harness):", "",
            "| task | metric | value | examples |", "|---|---|---|---|", *rows]


def _lineage_lines(run_dir: Path) -> list[str]:
    """A branch (``moelab branch``): its parent and step; the steps before it trained as the
    parent, with the parent's code and config when the branch was made (``parent_code`` in
    lineage.json; older branches: the parent's provenance.json as it is now)."""
    lin = read_lineage(run_dir) or {}
    if not isinstance(lin.get("parent"), str):
        return []
    parent = Path(lin["parent"])
    why = f" ({lin['reason']})" if lin.get("reason") else ""
    line = (f"- a branch of run `{parent.name}` at step {lin.get('step', '?')}{why}: the steps "
            "before it were trained as that run")
    pp = lin.get("parent_code")
    try:
        pp = pp if isinstance(pp, dict) else read_provenance(parent) if parent.is_dir() else {}
    except ConfigError:
        pp = {}
    if pp:
        line += (f" (git commit `{pp.get('git_commit') or 'unknown'}`"
                 + (" with uncommitted changes" if pp.get("git_dirty") else "")
                 + f", config hash `{pp.get('config_hash')}`)")
    return [line]


def _provenance_lines(prov: dict) -> list[str]:
    if not prov:
        return ["- no `provenance.json` in the run folder"]
    commit = prov.get("git_commit") or "unknown"
    dirty = " with uncommitted changes" if prov.get("git_dirty") else ""
    versions = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items() if v)
    return [f"- moelab code: git commit `{commit}`{dirty}",
            f"- config hash `{prov.get('config_hash')}`; data fingerprint "
            f"`{prov.get('data_fingerprint')}`",
            f"- libraries: {versions}"]


def model_card(run, run_dir: Path, name: str, title: str | None = None) -> str:
    """README.md of the export of ``run`` (a LoadedRun from ``run_dir``), loaded as ``name``;
    ``title``: the run's name (by default its folder's)."""
    cfg, step, prov = run.cfg, run.step, read_provenance(run_dir)
    seq_len = run.context  # data.seq_len, or a longer context stage's
    sections = [
        HEADER, f"# {title or Path(run_dir).resolve().name}: a moelab Mixture-of-Experts "
        "language model",
        "", "Trained with moelab and exported by `moelab export --to hf`.",
        "", "## Model", "", *_model_lines(cfg.model, seq_len),
        "", "## Training", "", *_training_lines(cfg, step, prov),
        "", "## Held-out evaluation", "", *_heldout_lines(Path(run_dir), step),
        *_harness_lines(run_dir, step),
        "", "## Provenance", "", *_provenance_lines(prov), *_lineage_lines(Path(run_dir)),
        "", "## Use", "", USAGE.format(path=name),
        "", "## Limits", "",
        f"- Trained on {seq_len}-token windows. Past them, `generate` keeps the last {seq_len} "
        "tokens (as `moelab generate`); a plain forward over more tokens runs at positions "
        "the model never saw.",
        "- The modeling code runs in transformers (eager or sdpa attention, KV cache, padded "
        "batches); no other serving engine is tested.",
        "", "## License", "", "Apache-2.0 (`LICENSE`).", ""]
    return "\n".join(sections)
