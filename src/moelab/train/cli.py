"""``moelab train`` and ``moelab config``: a run from a preset or YAML file and
SECTION.FIELD=VALUE overrides, and the config such a run resolves to, every field with its
meaning (``model.vocab_size`` 0 read from the tokenizer, as training reads it)."""

from __future__ import annotations

import argparse
import functools
import signal
from pathlib import Path

from moelab.config import load_config, split_overrides
from moelab.config.cli import config_epilog, epilog_overrides
from moelab.config.docs import describe_config
from moelab.config.errors import require
from moelab.config.io import override_field
from moelab.data.prepare import resolve_config, with_tokenizer_vocab
from moelab.util import info, is_url, silence_gone_console, url_fs, writable


def check_process_options(args) -> None:
    """The several-process options (``add_process_options``), checked before any work."""
    from moelab.parallel.distributed import check_coordinator

    if args.coordinator is not None:  # a bad one makes JAX wait minutes, then crash
        check_coordinator(args.coordinator)
    require(args.coordinator_timeout is None or args.coordinator_timeout > 0,
            f"--coordinator-timeout {args.coordinator_timeout}", "seconds to wait for process 0 "
            "to answer: give a number > 0")


def join_processes(args) -> None:
    """Join JAX's multi-controller runtime when the several-process options ask for it."""
    if args.distributed or args.coordinator or args.num_processes or args.process_id is not None:
        from moelab.parallel.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id,
                   timeout=args.coordinator_timeout)


def _check_options(args) -> None:
    """Options that would fail only once work has started, or lose its results: checked first."""
    check_process_options(args)
    require(not args.arm or args.record, f"--arm {args.arm}", "names the run in an experiment "
            "record: give --record too, or drop --arm")
    # memory:// is fsspec's in-process filesystem: fine from Python (tests), lost at exit here
    require(not str(args.run_dir).startswith("memory://"), f"--run-dir {args.run_dir}",
            "memory:// lives only inside this process, so the run would be gone when `moelab "
            "train` exits; give a folder, or a gs://, s3:// or file:// URL")


def _resolved_vocab(cfg, run_dir):
    """``cfg`` with model.vocab_size from its tokenizer, checked now unless ``run_dir`` has
    checkpoints: a resume compares its data with the run's record first (train.setup)."""
    from moelab.train.resume import resume_step

    if not is_url(run_dir) and resume_step(run_dir) is not None:
        return cfg
    return with_tokenizer_vocab(cfg)


def cmd_train(args, attach_record) -> int:
    from moelab.parallel.transport import unread_fields
    from moelab.train.loop import train
    from moelab.train.preflight import claim_gpu_share
    from moelab.train.resume import check_given_end

    claim_gpu_share()  # before JAX's backend starts: this process owns its GPUs
    _check_options(args)
    source, overrides = split_overrides(args.config, args.overrides)
    piped = Path(source).exists() and not (Path(source).is_file() or Path(source).is_dir())
    require(args.run_dir or not piped, f"config {source}", "is a pipe (`<(...)`, /dev/stdin), "
            "whose name says nothing of the run: give --run-dir")
    cfg = load_config(source, overrides)
    if is_url(args.run_dir):  # gs://, s3://...: mirrored through a local copy (run/remote.py)
        fs, _ = url_fs(args.run_dir)  # an unknown protocol or a missing package, before work
        require(not {"http", "https"} & set(fs.protocol if isinstance(fs.protocol, tuple)
                                            else [fs.protocol]), f"--run-dir {args.run_dir}",
                "HTTP cannot store a run (it is read-only here); train in gs://, s3://, "
                "file:// or a local folder")
        require(not args.record, f"--record {args.record}", "reads the run folder from this "
                "disk; give a local --run-dir, or drop --record")
        run_dir = args.run_dir
    else:
        run_dir = Path(args.run_dir or Path("runs") / Path(source).stem)
        require(not run_dir.exists() or run_dir.is_dir(), f"--run-dir {run_dir}",
                "a file is in the way; give a folder (it is created when missing)")
        require(writable(run_dir), f"--run-dir {run_dir}", "cannot be made or written by this "
                "user; give a folder you can write")
    cfg = _resolved_vocab(cfg, run_dir)
    for note in unread_fields(cfg, overrides):
        info(note)
    if not is_url(run_dir) and "train.steps" in map(override_field, overrides):
        check_given_end(cfg, run_dir)
    join_processes(args)
    if args.record:
        attach_record(args.record, run_dir, args.arm)
    return report_summary(train(cfg, run_dir, accept_data_change=args.accept_data_change),
                          run_dir)


def report_summary(summary: dict, run_dir) -> int:
    """Print a run's summary and where its results are; the exit code: 0, or as a shell
    reports the signal that stopped it (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    from moelab.train.tracker import format_summary

    silence_gone_console()  # the run is saved: a reader gone (`| head`) does not fail it now
    try:
        print(format_summary(summary))
        print(f"results: {run_dir}/ (metrics.jsonl, summary.json, checkpoints/)")
    except BrokenPipeError:  # the reader left just now: the run is saved all the same
        silence_gone_console()
    if summary["interrupted"]:
        return 128 + signal.Signals[summary["interrupted"]]
    return 0


def cmd_config(args) -> int:
    source, cfg = resolve_config(args.config, args.overrides)
    print(f"# moelab config {source}: valid YAML; save it and train with `moelab train FILE`")
    print(describe_config(cfg))
    return 0


def add_accept_data_change(p: argparse.ArgumentParser) -> None:
    """The option that lets a run go on when its data folder changed (otherwise refused)."""
    p.add_argument("--accept-data-change", action="store_true",
                   help="go on although the data folder's corpus differs from what the run "
                   "recorded (provenance.json); the change is logged in metrics.jsonl. "
                   "Another tokenizer is refused even so: data.tokenizer=RUN/tokenizer.json "
                   "tokenizes the data with the run's own")


def register_train(sub, attach_record) -> None:
    """``moelab train``; ``attach_record(record, run_dir, arm)`` attaches a run to an
    experiment record for --record (``moelab.lab``, which sits above train)."""
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
    add_accept_data_change(t)
    add_process_options(t)
    t.set_defaults(fn=functools.partial(cmd_train, attach_record=attach_record))


def add_process_options(p: argparse.ArgumentParser) -> None:
    """--distributed, --coordinator ...: one process of several (``join_processes``)."""
    mp = p.add_argument_group("several processes (one per host or per GPU; see README)")
    mp.add_argument("--distributed", action="store_true",
                    help="join JAX's multi-controller runtime, cluster detected by JAX (SLURM, "
                    "Open MPI, Kubernetes)")
    mp.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and "
                    "--process-id, for clusters JAX does not detect)")
    mp.add_argument("--num-processes", type=int)
    mp.add_argument("--process-id", type=int)
    mp.add_argument("--coordinator-timeout", type=float, metavar="SECONDS",
                    help="how long the other processes wait for process 0 to answer at "
                    "--coordinator (default 300, JAX's own initialization timeout)")


def register_config(sub) -> None:
    c = sub.add_parser("config", help="print a resolved config with every field's meaning",
                       description="Print the config a preset or YAML file and overrides resolve "
                       "to, as YAML with each field's one-line doc; model.vocab_size 0 shows "
                       "the tokenizer's size.", epilog=epilog_overrides("config"))
    c.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    c.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides")
    c.set_defaults(fn=cmd_config)
