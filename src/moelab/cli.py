"""The ``moelab`` command line: one entry point, a subcommand per job, ``--help`` everywhere."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moelab.config import ConfigError, load_config, preset_names
from moelab.train.checkpoint import CheckpointError

EPILOG_OVERRIDES = ("Override any config field with SECTION.FIELD=VALUE arguments after the config, "
                    "e.g. `moelab train tiny train.steps=100 model.n_experts=16`.")


def _split_overrides(config: str | None, overrides: list[str]) -> tuple[str, list[str]]:
    """Allow `moelab train train.steps=5` (no config given): a KEY=VALUE is never a config name."""
    if config is not None and "=" in config:
        return "tiny", [config, *overrides]
    return config or "tiny", overrides


def cmd_train(args) -> int:
    from moelab.train.loop import format_summary, train

    source, overrides = _split_overrides(args.config, args.overrides)
    cfg = load_config(source, overrides)
    if args.distributed or args.coordinator or args.num_processes or args.process_id is not None:
        from moelab.parallel.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    run_dir = Path(args.run_dir or Path("runs") / Path(source).stem)
    summary = train(cfg, run_dir)
    print(format_summary(summary))
    print(f"results: {run_dir}/ (metrics.jsonl, summary.json, checkpoints/)")
    if summary["interrupted"]:
        return 130 if summary["interrupted"] == "SIGINT" else 143
    return 0


def cmd_generate(args) -> int:
    from moelab.serve import load_run

    run = load_run(Path(args.run), step=args.step)
    text = run.generate(args.prompt, args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed)
    print(args.prompt + text)
    return 0


def cmd_data_build(args) -> int:
    from moelab.config import DataConfig
    from moelab.data import corpus
    from moelab.data.prepare import prepare_data, vocab_needed
    from moelab.data.tokenizer import load_tokenizer

    out = Path(args.out)
    vocab = args.vocab
    if args.tokenizer:
        if not Path(args.tokenizer).exists():
            raise FileNotFoundError(f"--tokenizer {args.tokenizer}: not found; give an existing "
                                    "tokenizer.json or omit --tokenizer to train one")
        vocab = vocab_needed(load_tokenizer(args.tokenizer))
    if args.inputs:
        manifest = corpus.build_user_corpus([Path(p) for p in args.inputs], out / "corpus",
                                            heldout_fraction=args.heldout)
    else:
        manifest = corpus.build_builtin_corpus(out / "corpus", heldout_fraction=args.heldout)
    print(json.dumps({k: v for k, v in manifest.items() if k != "skipped"}, indent=2))
    prep = prepare_data(DataConfig(data_dir=str(out), tokenizer=args.tokenizer or ""), vocab)
    print(f"corpus: {prep.corpus_dir}\ntokenizer: {prep.tokenizer_path}\n"
          f"token store: {prep.store_dir}")
    if args.inputs:
        hint = f"moelab train tiny data.data_dir={out} model.vocab_size={vocab}"
        if args.tokenizer:
            hint += f" data.tokenizer={args.tokenizer}"
        print(f"train on it with: {hint}")
    return 0


def cmd_plan(args) -> int:
    from moelab.flops import param_counts, train_flops_per_token

    source, overrides = _split_overrides(args.config, args.overrides)
    cfg = load_config(source, overrides)
    c = param_counts(cfg.model)
    fpt = train_flops_per_token(cfg.model, cfg.data.seq_len)
    print(f"{source}: total {c['total']:,} parameters; active per token {c['active']:,} "
          f"({c['active_blocks']:,} in blocks); train FLOPs/token {fpt:.4g}")
    return 0


def cmd_presets(_args) -> int:
    for name in preset_names():
        print(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moelab", description="Train sparse Mixture-of-Experts "
                                "language models in the open.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model (resumes from the run folder)",
                       description="Train a model; running it again on the same run folder "
                       "resumes from the newest checkpoint. Ctrl-C saves a checkpoint and stops.",
                       epilog=EPILOG_OVERRIDES)
    t.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    t.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides")
    t.add_argument("--run-dir", help="run folder (default: runs/<config name>)")
    mp = t.add_argument_group("several processes (one per host or per GPU; see README)")
    mp.add_argument("--distributed", action="store_true",
                    help="join JAX's multi-controller runtime, cluster detected by JAX (SLURM, "
                    "Open MPI, Kubernetes)")
    mp.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and "
                    "--process-id, for clusters JAX does not detect)")
    mp.add_argument("--num-processes", type=int)
    mp.add_argument("--process-id", type=int)
    t.set_defaults(fn=cmd_train)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("run", help="run folder (e.g. runs/tiny)")
    g.add_argument("--prompt", default="The ", help="text to continue")
    g.add_argument("--max-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("data", help="corpus, tokenizer and token store")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    b = dsub.add_parser("build", help="build a corpus (built-in, or your own files), train a "
                        "tokenizer and tokenize", description="Without INPUT paths: the built-in "
                        "corpus from installed packages. With paths: your .txt/.md files, .jsonl "
                        "(field 'text', optional 'domain') and .parquet (column 'text').")
    b.add_argument("inputs", nargs="*", help="your own files or folders")
    b.add_argument("--out", default="data/builtin", help="output folder (default: data/builtin)")
    b.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size to train")
    b.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of documents")
    b.set_defaults(fn=cmd_data_build)

    pl = sub.add_parser("plan", help="parameters and FLOPs of a config", epilog=EPILOG_OVERRIDES)
    pl.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    pl.add_argument("overrides", nargs="*")
    pl.set_defaults(fn=cmd_plan)

    ps = sub.add_parser("presets", help="list the built-in presets")
    ps.set_defaults(fn=cmd_presets)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError, CheckpointError, FloatingPointError) as e:
        print(f"moelab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoelab: aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
