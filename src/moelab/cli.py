"""The ``moelab`` command line: one entry point, a subcommand per job, ``--help`` everywhere."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from moelab.config import ConfigError, load_config, preset_names, split_overrides
from moelab.config.errors import require
from moelab.ladder.cli import register as register_ladder
from moelab.lab.cli import register as register_lab
from moelab.ops.cli import register as register_ops
from moelab.ops.drops import register as register_drops
from moelab.export.cli import register as register_export
from moelab.run.checkpoint import CheckpointError
from moelab.util import is_url, url_fs

EPILOG_OVERRIDES = ("Override any config field with SECTION.FIELD=VALUE arguments after the config, "
                    "e.g. `moelab train tiny train.steps=100 model.n_experts=16`.")


def config_epilog() -> str:
    """`train --help`'s list of config sections, pointing to `moelab config` for the fields."""
    from moelab.config.docs import section_classes, section_doc

    rows = [textwrap.fill(section_doc(cls), 88, initial_indent=f"  {name:<10}",
                          subsequent_indent=" " * 12) for name, cls in section_classes().items()]
    tail = ("`moelab config PRESET [KEY=VALUE ...]` prints every field of the resolved config "
            "with its value and meaning. " + EPILOG_OVERRIDES)
    return "\n".join(["config sections (YAML keys; SECTION.FIELD=VALUE on the command line):",
                      *rows, "", textwrap.fill(tail, 88)])


def _load(config: str | None, overrides: list[str]):
    """(config source, the config with its overrides; model.vocab_size from the tokenizer when
    0): what `train`, `plan` and `config` act on."""
    from moelab.data.prepare import with_tokenizer_vocab

    source, overrides = split_overrides(config, overrides)
    return source, with_tokenizer_vocab(load_config(source, overrides))


def cmd_train(args) -> int:
    from moelab.train.loop import format_summary, train

    source, cfg = _load(args.config, args.overrides)
    if args.distributed or args.coordinator or args.num_processes or args.process_id is not None:
        from moelab.parallel.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    if is_url(args.run_dir):  # gs://, s3://...: mirrored through a local copy (train/remote.py)
        url_fs(args.run_dir)  # an unknown protocol or a missing package, before any work
        require(not args.record, f"--record {args.record}", "reads the run folder from this "
                "disk; give a local --run-dir, or drop --record")
        run_dir = args.run_dir
    else:
        run_dir = Path(args.run_dir or Path("runs") / Path(source).stem)
        require(not run_dir.exists() or run_dir.is_dir(), f"--run-dir {run_dir}",
                "a file is in the way; give a folder (it is created when missing)")
    if args.record:
        from moelab.lab.cli import attach_from_train

        attach_from_train(args.record, run_dir, args.arm)
    summary = train(cfg, run_dir)
    print(format_summary(summary))
    print(f"results: {run_dir}/ (metrics.jsonl, summary.json, checkpoints/)")
    if summary["interrupted"]:
        return 130 if summary["interrupted"] == "SIGINT" else 143
    return 0


def check_sampling(args) -> None:
    """Sampling options, checked before the run is loaded. Temperature 0 means greedy decoding
    (as --help says); top-p 0 would keep no token, so it is refused rather than read as greedy."""
    require(args.max_tokens >= 1, f"--max-tokens {args.max_tokens}", "must be >= 1")
    require(math.isfinite(args.temperature) and args.temperature >= 0,
            f"--temperature {args.temperature}", "must be a number >= 0 (0 = greedy)")
    require(0 < args.top_p <= 1, f"--top-p {args.top_p}", "must be in (0, 1]; 1 keeps every "
            "token, 0.9 the most likely ones holding 90% of the probability")
    require(args.step is None or args.step >= 0, f"--step {args.step}",
            "must be a checkpoint step (>= 0); omit it for the newest")


def cmd_generate(args) -> int:
    from moelab.run.load import load_run

    check_sampling(args)
    run = load_run(args.run, step=args.step)  # a folder or a run URL
    text = run.generate(args.prompt, args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed)
    print(args.prompt + text)
    return 0


def cmd_eval(args) -> int:
    from moelab.harness.evaluate import (default_output, evaluate_run, format_results,
                                         save_results, split_tasks)

    require(args.output or not is_url(args.run), "--output", f"{args.run} is a URL: name a "
            "local results file (--output FILE)")
    tasks = split_tasks(args.tasks)
    results = evaluate_run(args.run if is_url(args.run) else Path(args.run),
                           tasks, limit=args.limit,
                           batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                           step=args.step, include_paths=[Path(p) for p in args.include_path])
    print(format_results(results))
    out = Path(args.output) if args.output else default_output(
        Path(args.run), tasks, results["moelab"]["step"])
    save_results(results, out)
    print(f"results: {out}")
    return 0


def cmd_data_build(args) -> int:
    from moelab.config import DataConfig
    from moelab.data import corpus
    from moelab.data.prepare import OWN_TOKENIZER, prepare_data, vocab_needed
    from moelab.data.tokenizer import MIN_VOCAB, load_tokenizer
    from moelab.util import atomic_write_bytes

    out = Path(args.out)
    require(not out.exists() or out.is_dir(), f"--out {out}", "a file is in the way; give a folder")
    require(args.tokenizer or args.vocab >= MIN_VOCAB, f"--vocab {args.vocab}",
            f"must be >= {MIN_VOCAB} (256 byte tokens, <|endoftext|> and at least one merge)")
    require(0 <= args.heldout < 1, f"--heldout {args.heldout}",
            "a fraction of the documents in [0, 1), e.g. 0.02")
    vocab = args.vocab
    if args.tokenizer:
        if not Path(args.tokenizer).exists():
            raise FileNotFoundError(f"--tokenizer {args.tokenizer}: not found; give an existing "
                                    "tokenizer.json or omit --tokenizer to train one")
        vocab = vocab_needed(load_tokenizer(args.tokenizer))
    require(args.inputs or (args.format, args.text_field, args.split) == ("files", "text", ""),
            "--format/--text-field/--split", "read your INPUT paths; give them")
    if args.inputs:  # strings: Path() would mangle gs://, memory:// URLs
        manifest = corpus.build_user_corpus(args.inputs, out / "corpus",
                                            heldout_fraction=args.heldout, fmt=args.format,
                                            text_field=args.text_field, split=args.split)
    else:
        manifest = corpus.build_builtin_corpus(out / "corpus", heldout_fraction=args.heldout)
    print(json.dumps({k: v for k, v in manifest.items() if k != "skipped"}, indent=2))
    own = out / OWN_TOKENIZER
    own.unlink(missing_ok=True)  # a rebuild chooses its tokenizer again
    prep = prepare_data(DataConfig(data_dir=str(out), tokenizer=args.tokenizer or ""), vocab,
                        progress=not args.no_progress)
    print(f"corpus: {prep.corpus_dir}\ntokenizer: {prep.tokenizer_path}\n"
          f"token store: {prep.store_dir}")
    if args.inputs or args.tokenizer:  # the folder's own tokenizer: training uses it
        atomic_write_bytes(own, prep.tokenizer_path.read_bytes())
        vocab = vocab_needed(load_tokenizer(own))
        print(f"train on it with: moelab train tiny data.data_dir={out} model.vocab_size={vocab}")
    return 0


def _fake_devices_rerun(args) -> int | None:
    """``plan --xla --devices N`` on a CPU with fewer devices: the whole command again in a
    child process with N fake CPU devices (XLA reads the flag only when JAX starts)."""
    import jax

    n = args.devices
    if not (args.xla and n > len(jax.devices()) and jax.default_backend() == "cpu"):
        return None
    if os.environ.get("MOELAB_FAKE_DEVICES"):
        raise ConfigError(f"--devices {n}: only {len(jax.devices())} fake devices came up")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "MOELAB_FAKE_DEVICES": str(n)}
    return subprocess.call([sys.executable, "-m", "moelab.cli", *args.argv[1:]], env=env)


def _plan_xla(cfg, layout) -> dict:
    """``plan --xla``: compile the real train step at a scaled shape and compare its memory
    with the planner's: on one device, or on ``layout`` (expert parallelism, FSDP)."""
    from moelab import planner
    from moelab.train.step import compile_train_step, init_train_state, make_train_step

    if layout is None or layout.devices == 1:
        small = planner.scaled_config(cfg)
        cmp = planner.compare_with_xla(small, init_train_state, make_train_step)
        where = "one device"
    else:  # local experts must split into the waves of a pooled_wave transport
        small = planner.scaled_config(cfg, batch=layout.devices,
                                      n_experts=math.lcm(16, layout.ep * cfg.parallel.waves))
        cmp = planner.compare_sharded_with_xla(small, layout, compile_train_step)
        where = (f"{layout.devices} devices, EP {layout.ep}, FSDP {layout.fsdp}, transport "
                 f"{cmp['transport']}" + (f" W={cmp['waves']}" if layout.ep > 1 else ""))
        if cmp["cpu_gradient_all_reduce"]:
            where += (f"; + {cmp['cpu_gradient_all_reduce'] / 2**20:.1f} MiB for XLA:CPU's "
                      "full-size gradient all-reduce (a GPU reduce-scatters)")
    m = small.model
    print(f"\n  XLA check at a scaled shape (d_model {m.d_model}, {m.n_layers} layers, "
          f"{m.n_experts} experts, {small.data.batch_size} x {small.data.seq_len} tokens, "
          f"float32, {where}): estimate {cmp['estimate'] / 2**20:.1f} MiB, XLA "
          f"{cmp['xla']['peak'] / 2**20:.1f} MiB ({cmp['ratio'] - 1:+.1%})")
    return {"scaled_model": m.__dict__, "seq_len": small.data.seq_len,
            "batch": small.data.batch_size, **cmp}


def check_plan_options(args) -> None:
    """The numbers `moelab plan` takes, each finite and in range; 0 means "not given"."""
    for option, value in (("--tokens", args.tokens), ("--peak-flops", args.peak_flops),
                          ("--hbm-gib", args.hbm_gib), ("--tokens-per-s", args.tokens_per_s)):
        require(math.isfinite(value) and value >= 0, f"{option} {value:g}",
                "must be a number >= 0 (0: not given)")
    for mfu in args.mfu:
        require(0 < mfu <= 1, f"--mfu {mfu:g}", "a fraction in (0, 1], e.g. 0.2 for 20%")
    for cf in args.cf:
        require(math.isfinite(cf) and cf > 0, f"--cf {cf:g}", "capacity factors must be > 0, "
                "e.g. 1.25 2.0")
    for waves in args.waves:
        require(waves >= 1, f"--waves {waves}", "wave counts must be >= 1")


def cmd_plan(args) -> int:
    from moelab import planner
    from moelab.util import atomic_write_json

    check_plan_options(args)
    rerun = _fake_devices_rerun(args)
    if rerun is not None:
        return rerun
    source, cfg = _load(args.config, args.overrides)
    acc = planner.accelerator(args.accelerator, args.peak_flops, args.hbm_gib)
    layout = transports = None
    if args.devices:
        layout = planner.Layout(args.devices, args.ep, args.fsdp, args.optimizer,
                                tuple(args.offload))
        par = cfg.parallel
        transports = planner.transport_options(par, {
            "capacity_factor": args.cf, "waves": args.waves or sorted({1, par.waves})})
    result = planner.build_plan(cfg, tokens=args.tokens, acc=acc, devices=args.devices,
                                mfus=tuple(args.mfu), tokens_per_s=args.tokens_per_s,
                                layout=layout, transports=transports,
                                attention=args.attention,
                                loss=args.loss or ("fused" if cfg.model.loss_chunk else
                                                   "materialized"))
    print(planner.format_plan(source, result))
    if not args.devices:
        print("\n  (give --devices with --mfu or --tokens-per-s for time on a cluster, and "
              "--ep/--fsdp for memory per device)")
    if args.xla:
        result["xla"] = _plan_xla(cfg, layout)
    if args.json:
        atomic_write_json(args.json, result)
        print(f"\n  written: {args.json}")
    return 0


def cmd_config(args) -> int:
    from moelab.config.docs import describe_config

    source, cfg = _load(args.config, args.overrides)
    print(f"# moelab config {source}: valid YAML; save it and train with `moelab train FILE`")
    print(describe_config(cfg))
    return 0


def cmd_presets(_args) -> int:
    for name in preset_names():
        print(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moelab", description="Train sparse Mixture-of-Experts "
                                "language models in the open.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train, _add_config, _add_generate, _add_eval, _add_data,
                _add_plan):
        add(sub)
    ps = sub.add_parser("presets", help="list the built-in presets")
    ps.set_defaults(fn=cmd_presets)
    register_lab(sub)
    register_ops(sub)
    register_drops(sub)
    register_ladder(sub)
    register_export(sub)
    return p


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a model (resumes from the run folder)",
                       description="Train a model; running it again on the same run folder "
                       "resumes from the newest checkpoint. Ctrl-C saves a checkpoint and stops.",
                       epilog=config_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    t.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides")
    t.add_argument("--run-dir", help="run folder, or a URL such as gs://bucket/runs/x "
                   "(default: runs/<config name>)")
    t.add_argument("--record", help="attach this run to an experiment record (id, number or "
                   "file; see `moelab lab`)")
    t.add_argument("--arm", help="the run's arm name in the record (default: run folder name)")
    mp = t.add_argument_group("several processes (one per host or per GPU; see README)")
    mp.add_argument("--distributed", action="store_true",
                    help="join JAX's multi-controller runtime, cluster detected by JAX (SLURM, "
                    "Open MPI, Kubernetes)")
    mp.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and "
                    "--process-id, for clusters JAX does not detect)")
    mp.add_argument("--num-processes", type=int)
    mp.add_argument("--process-id", type=int)
    t.set_defaults(fn=cmd_train)


def _add_config(sub) -> None:
    c = sub.add_parser("config", help="print a resolved config with every field's meaning",
                       description="Print the config a preset or YAML file and overrides resolve "
                       "to, as YAML with each field's one-line doc; model.vocab_size 0 shows "
                       "the tokenizer's size.", epilog=EPILOG_OVERRIDES)
    c.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    c.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides")
    c.set_defaults(fn=cmd_config)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("run", help="run folder or URL (e.g. runs/tiny, gs://bucket/runs/tiny)")
    g.add_argument("--prompt", default="The ", help="text to continue")
    g.add_argument("--max-tokens", type=int, default=100, help="new tokens to sample (>= 1)")
    g.add_argument("--temperature", type=float, default=0.8, help=">= 0; 0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="in (0, 1]: sample from the most likely tokens holding this probability")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    g.set_defaults(fn=cmd_generate)


def _add_eval(sub) -> None:
    e = sub.add_parser("eval", help="score a trained run on lm-evaluation-harness tasks",
                       description="Run lm-evaluation-harness tasks (offline) on a run's "
                       "checkpoint: moelab's local tasks (group moelab_local), task YAML "
                       "folders given with --include-path, or harness built-ins whose data "
                       "is already cached. Prints the results table and saves the JSON in "
                       "RUN/eval/. Needs the eval extra: pip install -e '.[eval]'.")
    e.add_argument("run", help="run folder (e.g. runs/tiny)")
    e.add_argument("--tasks", required=True, help="comma-separated task or group names, "
                   "e.g. moelab_local or moelab_choice,moelab_heldout")
    e.add_argument("--limit", type=int, default=None, help="at most N examples per task")
    e.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    e.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples in each prompt (default: each task's own)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    e.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of extra task YAML files (repeatable)")
    e.add_argument("--output", help="results JSON (default: RUN/eval/<tasks>-step<N>.json)")
    e.set_defaults(fn=cmd_eval)


def _add_data(sub) -> None:
    from moelab.config.data import DATA_FORMATS

    d = sub.add_parser("data", help="corpus, tokenizer and token store")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    b = dsub.add_parser("build", help="build a corpus (built-in, or your own files), train a "
                        "tokenizer and tokenize", description="Without INPUT paths: the built-in "
                        "corpus from installed packages. With paths: your .txt/.md files, .jsonl "
                        "(field 'text', optional 'domain') and .parquet (column 'text'), or "
                        "Hugging Face datasets (--format). Paths may be gs://, s3://, memory:// "
                        "or file:// URLs (read through fsspec).")
    b.add_argument("inputs", nargs="*", help="your own files or folders (or URLs)")
    b.add_argument("--format", default="files", choices=DATA_FORMATS,
                   help="files: moelab's readers (default); hf-disk: folders written by "
                   "datasets' save_to_disk; hf-files: .json/.jsonl/.csv/.parquet/.txt through "
                   "datasets' builders; hf-stream: the same, streamed")
    b.add_argument("--text-field", default="text",
                   help="the field/column holding each document's text (default: text)")
    b.add_argument("--split", default="", help="datasets split to read (hf-*; default: train, "
                   "or the only one)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.add_argument("--out", default="data/builtin", help="output folder (default: data/builtin)")
    b.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size to train")
    b.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of documents")
    b.set_defaults(fn=cmd_data_build)


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="parameters, FLOPs, time on a cluster, memory per device",
                        description="Total and active parameters (per component), training "
                        "FLOPs, days on a cluster and memory per device of a config, read from "
                        "the model's own parameter tree and residuals. Formulas: docs/plan.md.",
                        epilog=EPILOG_OVERRIDES)
    pl.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--tokens", type=float, default=0.0,
                    help="training tokens (default: train.steps x data.batch_size x seq_len)")
    pl.add_argument("--accelerator", default="gb200",
                    help="gb200, b200, h200, h100 or custom (with --peak-flops)")
    pl.add_argument("--peak-flops", type=float, default=0.0,
                    help="dense bf16 FLOP/s per device (overrides the accelerator's)")
    pl.add_argument("--hbm-gib", type=float, default=0.0, help="device memory in GiB")
    pl.add_argument("--devices", type=int, default=0, help="devices that train")
    pl.add_argument("--mfu", type=float, nargs="*", default=[],
                    help="model FLOP utilisation(s) to assume, e.g. 0.20 0.23")
    pl.add_argument("--tokens-per-s", type=float, default=0.0,
                    help="measured cluster-wide tokens/s (instead of an MFU)")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    pl.add_argument("--fsdp", type=int, default=1,
                    help="FSDP degree of the non-expert weights and optimizer state")
    pl.add_argument("--optimizer", default="adamw", help="adamw or muon (optimizer state size)")
    pl.add_argument("--offload", nargs="*", default=[], choices=["master", "opt"],
                    help="kept in host memory: master (fp32 weights) and/or opt")
    pl.add_argument("--attention", default="materialized", choices=["materialized", "fused"],
                    help="attention kernel memory: this code's score chunks or a fused kernel")
    pl.add_argument("--loss", default=None, choices=["materialized", "fused"],
                    help="loss memory: float32 logits or a chunked cross-entropy (default: "
                    "fused when model.loss_chunk > 0)")
    pl.add_argument("--cf", type=float, nargs="*", default=[1.25, 2.0, 4.0],
                    help="capacity factors to compare (transports with parallel.capacity_factor)")
    pl.add_argument("--waves", type=int, nargs="*", default=[],
                    help="pooled_wave wave counts to compare (default: 1 and parallel.waves)")
    pl.add_argument("--xla", action="store_true",
                    help="also compile a scaled copy here and compare with XLA's memory analysis")
    pl.add_argument("--json", help="also write the plan as JSON to this file")
    pl.set_defaults(fn=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = ["moelab", *(sys.argv[1:] if argv is None else argv)]  # recorded by operations
    try:
        return args.fn(args)
    except (ConfigError, OSError, ValueError, CheckpointError, FloatingPointError) as e:
        print(f"moelab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoelab: aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
