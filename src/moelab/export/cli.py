"""``moelab export``: the command line of the export package."""

from __future__ import annotations

from pathlib import Path

from moelab.config.errors import require
from moelab.util import is_url, stop_said


def cmd_export(args) -> int:
    from moelab.export.hf import export

    require(args.step is None or args.step >= 0, f"--step {args.step}",
            "must be a checkpoint step (>= 0); omit it for the newest")
    out = Path(args.out)
    had = (out / "config.json").is_file()  # an export already there is never taken for this one
    try:
        # a URL as given: Path() mangles it (file:///x -> file:/x)
        step, n = export(args.run if is_url(args.run) else Path(args.run), args.to, out,
                         args.step)
    except KeyboardInterrupt as e:  # the CLI prints the message and exits 128 + the signal
        e.args = (stopped(e, out, had),)
        raise
    print(f"exported {args.run} (step {step}, {n:,} parameters) to {out}/")
    print(f"load it: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          "trust_remote_code=True)")
    return 0


def stopped(e: KeyboardInterrupt, out: Path, had: bool) -> str:
    """What a stop during the export left: OUT whole (config.json, moved in last, is there) or
    as it was (the files are written elsewhere first)."""
    if not had and (out / "config.json").is_file():
        return f"{stop_said(e)} as the export ended; {out}/ is complete"
    return (f"{stop_said(e)} during the export; nothing was written to {out}: run the same "
            "command again")


def register(sub) -> None:
    p = sub.add_parser("export", help="export a run's checkpoint for other tools (Hugging Face)",
                       description="Write a run's newest checkpoint (or --step) as a Hugging Face "
                       "model folder: safetensors weights, config.json, tokenizer files, the "
                       "PyTorch modeling code (load with trust_remote_code=True), a model card "
                       "(README.md) and the Apache-2.0 LICENSE. Needs the hf extra: "
                       "pip install -e '.[hf]'.")
    p.add_argument("run", help="run folder or URL (e.g. runs/tiny, gs://bucket/runs/tiny)")
    p.add_argument("out", help="output folder (new or empty)")
    p.add_argument("--to", required=True, help="format: hf (Hugging Face transformers)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.set_defaults(fn=cmd_export)
