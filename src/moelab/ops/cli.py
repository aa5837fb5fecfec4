"""Command line of run operations: replan, branch, resume, history, drops
(``register(subparsers)``)."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
from pathlib import Path

from moelab.config import ConfigError
from moelab.config.errors import INT32_MAX, require
from moelab.ops.schedule import (
    check_end,
    check_run_folder,
    parse_mixture,
    parse_tokens,
    rope_note,
    step_arg,
)
from moelab.run.logs import read_lineage
from moelab.train.changes import Change, PlanError, check_seq_len
from moelab.train.cli import add_accept_data_change, add_process_options
from moelab.util import info, is_url

WHY = "why (recorded in the run's operations log)"


def _change_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--floor", type=float, help="final LR as a fraction of peak (default: the "
                   "run's optim.floor, 0.05 unless set)")
    p.add_argument("--mixture", help="new domain weights from the step on, "
                   "e.g. prose=0.7,code=0.3")
    p.add_argument("--seq-len", type=int, help="new context length from the step on (tokens "
                   "per batch stay the same: the batch gets fewer, longer rows)")
    p.add_argument("--reason", default="", help=WHY)
    p.add_argument("--ladder", help="a fitted scaling-ladder folder (`moelab ladder plan/run`): "
                   "print its forecast of the held-out loss at the end of each plan")


def check_change_args(args) -> None:
    """The numbers of a replan or branch, checked before the run folder is read."""
    require(args.floor is None or 0 <= args.floor <= 1, f"--floor {args.floor}",
            "the final LR as a fraction of the peak, in [0, 1], e.g. 0.05")
    require(args.seq_len is None or args.seq_len >= 1, f"--seq-len {args.seq_len}",
            "must be >= 1 tokens")
    end_steps, rate = getattr(args, "end_steps", None), getattr(args, "tokens_per_s", None)
    require(end_steps is None or 1 <= end_steps <= INT32_MAX, f"--end-steps {end_steps}",
            f"must be in 1-{INT32_MAX:,} (the compiled step counts steps in int32)")
    require(rate is None or (math.isfinite(rate) and rate > 0), f"--tokens-per-s {rate}",
            "must be a number > 0")
    require(rate is None or getattr(args, "deadline", None) is not None,
            f"--tokens-per-s {rate}", "only --deadline uses it (the end it trains to by then): "
            "add --deadline, or leave it out")
    require(args.floor is None or any(getattr(args, k, None) is not None for k in
                                      ("end_steps", "end_tokens", "deadline", "cooldown")),
            f"--floor {args.floor}", "a new floor ends a new decay: add its end, --end-steps, "
            "--end-tokens or --deadline")
    at = getattr(args, "at", None)
    require(at is None or at >= 0, f"--at {at}", "must be a checkpoint step (>= 0)")
    ranks = getattr(args, "place_experts", None)
    require(ranks is None or ranks >= 2, f"--place-experts {ranks}", "must be >= 2 ranks "
            "(an EP group); leave it out to keep the experts where they are")


def _mixture(args) -> dict | None:
    return parse_mixture(args.mixture) if args.mixture else None


def _end_option(args) -> str:
    """The option a replan's new end came from, as typed."""
    if args.end_tokens is not None:
        return f"--end-tokens {args.end_tokens}"
    if args.deadline is not None:
        return f"--deadline {args.deadline}"
    return f"--end-steps {args.end_steps}"


def _check_data(cfg, args) -> str:
    """Build the samplers of every segment when the run's token store is at hand, so a bad
    mixture or a context longer than a domain's stream fails now, not at the change, and
    before anything is printed; the refusal names the options given."""
    from moelab.data.errors import DataError
    from moelab.data.prepare import prepare_data
    from moelab.data.sampler import SteppedSampler
    from moelab.data.store import TokenStore

    if cfg.data.sampler == "stream":
        return "data: streamed from data.source, which fills windows of any length"
    if not (Path(cfg.data.data_dir) / "corpus" / "manifest.json").is_file():
        return f"data: {cfg.data.data_dir} not found here; the mixture is checked at the resume"
    try:
        SteppedSampler(TokenStore(prepare_data(cfg.data, cfg.model.vocab_size, verbose=False)
                                  .store_dir), cfg.data)
    except (ConfigError, DataError) as e:
        given = [f"--{k.replace('_', '-')} {v}" for k, v in (("mixture", args.mixture),
                                                              ("seq_len", args.seq_len)) if v]
        raise type(e)(f"{' '.join(given)}: {e}" if given else str(e)) from None
    return "data: every mixture and context length can be drawn"


def _check_end_after(cfg, end: int, at: int | None, option: str) -> None:
    """A new end must come after the step a resume starts at: said in the option's terms
    (``--end-tokens 10K`` is a step count the user never typed)."""
    if at is not None and end <= at:
        raise PlanError(f"{option}: ends at step {end:,} ({cfg.data.tokens_before(end):,} "
                        f"tokens), not after step {at:,} where a resume starts "
                        f"({cfg.data.tokens_before(at):,} tokens); choose a later end")


def cmd_replan(args) -> int:
    from moelab.run.lock import run_lock

    if not args.apply or not Path(args.run).is_dir():  # a dry run, or a folder that is no run
        return _replan(args)
    with run_lock(Path(args.run), shlex.join(args.argv)):  # no trainer reads a half-made plan
        return _replan(args)


def _replan(args) -> int:
    from moelab.config import load_run_config
    from moelab.ops import replan as rp
    from moelab.ops.plot import plot_file, plot_replan
    from moelab.train.resume import check_unedited, pending_text, read_pending, resume_step

    check_change_args(args)
    check_run_folder(args.run)
    run = Path(args.run)
    plot = plot_file(args.plot, run / "replan_preview.png")
    cfg = load_run_config(run)
    check_unedited(run)  # a hand edit would be planned from, then refused at the resume
    pending = read_pending(run)  # a damaged request is named before any planning
    if pending is not None and args.apply and not args.replace:
        raise PlanError(f"{run / rp.PENDING}: a plan is already pending ({pending_text(pending)}); "
                        "add --replace to replace it with this one, or resume the run first")
    if args.seq_len is not None:
        check_seq_len(cfg, args.seq_len, resume_step(run) or 0, f"--seq-len {args.seq_len}")
    now = rp.progress(run)
    seconds = (rp.parse_deadline(args.deadline, dt.datetime.now().astimezone())
               if args.deadline else None)
    end = None
    if args.end_steps is not None or args.end_tokens is not None or seconds is not None:
        tokens = parse_tokens(args.end_tokens, "--end-tokens") if args.end_tokens else None
        end = check_end(rp.end_step(cfg, steps=args.end_steps, tokens=tokens,
                                    seconds_left=seconds,
                                    tokens_per_s=args.tokens_per_s or now["tokens_per_s"],
                                    tokens_now=now["tokens"]), _end_option(args))
        _check_end_after(cfg, end, resume_step(run), _end_option(args))
    change = Change(end=end, floor=args.floor, mixture=_mixture(args), seq_len=args.seq_len)
    if change == Change():
        raise PlanError("nothing to change: give a new end (--end-steps, --end-tokens, "
                        "--deadline), --mixture or --seq-len")
    before, after, at = rp.planned(run, change)
    data_note = _check_data(after, args)  # refusals before anything is printed
    forecast = (rp.format_forecast(rp.ladder_forecast(args.ladder, {"now": before, "new": after}))
                if args.ladder else None)
    print(f"{run}: last logged step {now['step']:,} ({now['tokens']:,} tokens); a resume now "
          f"starts at checkpoint step {at:,}")
    if seconds is not None:
        rate = args.tokens_per_s or now["tokens_per_s"]
        print(f"deadline in {seconds / 3600:,.2f} h at {rate:,.0f} tokens/s -> end step {end:,}")
    print(rp.format_preview(rp.preview_rows(before, after, at)))
    for note in [*rp.past_end_note(before, after), *rp.plan_notes(before, after, at),
                 *rp.later_changes(before, after, at, f"the run's plan from step {at:,} on:",
                                   {"mixture": "--mixture replaces it",
                                    "context": "--seq-len replaces it"})]:
        print(note)
    if forecast:
        print(forecast)
    print(data_note)
    if args.seq_len:
        print(rope_note(after))
    print(f"plot: {plot_replan(before, after, at, plot)}")
    if not args.apply:
        print("dry run: the run's plan is unchanged; add --apply to apply it at the next resume"
              + (f" (a plan is pending: {pending_text(pending)}; --apply --replace replaces it)"
                 if pending is not None else "")
              + ("; --replace acts only with --apply" if args.replace else ""))
        return 0
    new = rp.request(run, change, at=now["step"], reason=args.reason,
                     command=shlex.join(args.argv))
    if pending is not None:
        print(f"replaced the pending plan ({pending_text(pending)}) with ({pending_text(new)})")
    print(f"pending: {run / rp.PENDING}; applied when the run resumes "
          f"(`moelab resume {run}`), from the step it resumes at")
    return 0


def cmd_branch(args) -> int:
    from moelab.config import load_run_config
    from moelab.ops import branch as br
    from moelab.ops import replan as rp

    check_change_args(args)
    check_run_folder(args.run)
    parent = Path(args.run)
    tokens = parse_tokens(args.cooldown, "--cooldown")
    loaded = load_run_config(parent)  # read once: the plan shown is the branch made
    if args.place_experts is not None:  # before any planning or restoring: the parent's experts
        br.placement_group(loaded, args.place_experts)
    mixture = _mixture(args)
    br.parent_data(parent, args.accept_data_change, loaded)  # refused before any planning
    child = br.branch_dir(parent, args.at, args.out)  # a used folder: refused, dry run or not
    if not args.dry_run:  # an unwritable one too where the branch would be made
        br.check_can_record(parent, child)
    before, after = br.plan_branch(parent, args.at, tokens, floor=args.floor, mixture=mixture,
                                   seq_len=args.seq_len, drop_planned=args.drop_planned,
                                   loaded=loaded)
    data_note = _check_data(after, args)  # refusals before anything is printed
    forecast = (rp.format_forecast(rp.ladder_forecast(args.ladder, {"parent": before,
                                                                    "branch": after}))
                if args.ladder else None)
    names = ("parent", "branch")
    print(rp.format_preview(rp.preview_rows(before, after, args.at), names))
    header = (f"the parent's plan from step {args.at:,} on (a branch keeps what --mixture "
              "and --seq-len do not replace, unless --drop-planned):")
    dropped_by = {k: f"{opt} replaces it" if given else "--drop-planned" for k, opt, given in (
        ("mixture", "--mixture", args.mixture), ("context", "--seq-len", args.seq_len))}
    for note in [*rp.past_end_note(before, after, names), *rp.plan_notes(before, after, args.at),
                 *rp.later_changes(before, after, args.at, header, dropped_by)]:
        print(note)
    if forecast:
        print(forecast)
    print(data_note)
    print(rope_note(after))
    if args.dry_run:
        print("dry run: nothing created")
        return 0
    child = br.branch(parent, args.at, tokens, out=args.out, floor=args.floor,
                      mixture=mixture, seq_len=args.seq_len, place_ranks=args.place_experts,
                      reason=args.reason, command=shlex.join(args.argv),
                      accept_data_change=args.accept_data_change,
                      drop_planned=args.drop_planned, loaded=loaded)
    tokens = after.data.tokens_before(after.train.steps) - after.data.tokens_before(args.at)
    print(f"branch {child}: from step {args.at} of {parent} to step {after.train.steps} "
          f"(cooldown of {tokens:,} tokens); parent untouched but for one line in its ops.jsonl")
    if args.place_experts is not None:
        lin = read_lineage(child)["placement"]
        print(f"experts re-placed for EP {lin['ranks']} ({lin['transport']}, groups of "
              f"{lin['group']}): load second moment {lin['moment_before']:.4g} -> "
              f"{lin['moment_after']:.4g} over {lin['unit']}-token sequences of held-out text")
    print(f"train it with: moelab resume {child}")
    return 0


def cmd_resume(args) -> int:
    from moelab.parallel.transport import unread_fields
    from moelab.run.lock import run_lock
    from moelab.train.cli import check_process_options, join_processes, report_summary
    from moelab.train.loop import train
    from moelab.train.preflight import claim_gpu_share
    from moelab.train.resume import recovered_config

    check_process_options(args)
    run = args.run if is_url(args.run) else Path(args.run)
    if is_url(run):  # its config from the remote; it trains in its staging copy, as `train`
        cfg = recovered_config(_remote_files(run), args.overrides)
    else:
        check_run_folder(run)
        try:
            cfg = recovered_config(run, args.overrides)
        except FileNotFoundError:  # no config yet: a start still preparing it is named first
            with run_lock(run, "moelab resume"):
                raise
    for note in unread_fields(cfg, args.overrides):
        info(note)
    claim_gpu_share()  # as moelab train: before JAX's backend starts
    join_processes(args)  # each process of a run on several hosts, as `moelab train`
    return report_summary(train(cfg, run, accept_data_change=args.accept_data_change), run)


def cmd_history(args) -> int:
    from moelab.ops.record import format_history

    print(format_history(_remote_files(args.run), name=args.run) if is_url(args.run)
          else format_history(args.run))
    return 0


def _remote_files(url: str) -> Path:
    """A local copy of the run at ``url`` without its checkpoints: its config and logs (an
    unknown protocol or a missing package is said as such: ``util.url_fs``)."""
    from moelab.run.remote import fetch_run

    return fetch_run(url, checkpoint=False)


def register(sub) -> None:
    """Add the run-operation subcommands to the ``moelab`` parser's subparsers."""
    r = sub.add_parser(
        "replan", help="move a run's end and re-time its decay; change mixture or context",
        description="Plan a new end for a run (steps, tokens, or a deadline at the observed "
        "tokens/s): the LR continues from where the run is, without a jump, and decays linearly "
        "to the floor, which the schedule reaches at the new end (its last step trains one "
        "decrement above it, as a schedule gives each update its start's LR). Optionally a "
        "new mixture or context length. Prints a before/after table and plot; with --apply "
        "the plan is applied at the next resume, from the step the run resumes at.")
    r.add_argument("run", help="run folder")
    end = r.add_mutually_exclusive_group()
    end.add_argument("--end-steps", type=step_arg, help="new last step (e.g. 5000 or 5e3)")
    end.add_argument("--end-tokens", help="new end in tokens, e.g. 2.5M")
    end.add_argument("--deadline", help="'+36h', '+2d' or an ISO date/time; the end is what "
                     "the observed tokens/s trains by then")
    r.add_argument("--tokens-per-s", type=float, help="throughput for --deadline (default: "
                   "median of the run's last 20 logged values)")
    _change_args(r)
    r.add_argument("--apply", action="store_true", help="write the plan (default: dry run)")
    r.add_argument("--replace", action="store_true", help="with --apply: replace a plan that "
                   "is already pending (without it a second --apply is refused)")
    r.add_argument("--plot", help="where to save the LR plot, a .png, .pdf, .svg ... file (no "
                   "suffix: .png; default: RUN/replan_preview.png)")
    r.set_defaults(fn=cmd_replan)

    b = sub.add_parser(
        "branch", help="fork a cooldown branch from a checkpoint (the parent is untouched)",
        description="Fork a new run folder from the checkpoint at --at: the LR decays linearly "
        "from its value there to the floor over --cooldown tokens, optionally with a new "
        "mixture or a longer context. Lineage is recorded in both runs' ops.jsonl and in the "
        "branch's lineage.json.")
    b.add_argument("run", help="parent run folder")
    b.add_argument("--at", type=step_arg, required=True, help="checkpoint step to fork from")
    b.add_argument("--cooldown", required=True, help="cooldown length in tokens, e.g. 20M")
    b.add_argument("--out", help="branch folder (default: RUN-cooldown<STEP> beside the parent)")
    _change_args(b)
    b.add_argument("--place-experts", type=int, metavar="RANKS", help="re-place the experts "
                   "for an EP group of RANKS ranks, so experts whose loads offset each other "
                   "share a capacity group (fewer drops, most at long contexts; see `moelab "
                   "drops --place`); the model computes the same function")
    b.add_argument("--drop-planned", action="store_true", help="drop the parent's mixture "
                   "changes and context stages planned from --at on (kept by default; the "
                   "preview lists them): the mixture and context before --at go on")
    b.add_argument("--dry-run", action="store_true", help="print the plan, create nothing")
    add_accept_data_change(b)
    b.set_defaults(fn=cmd_branch)

    s = sub.add_parser("resume", help="continue a run folder with its saved config",
                       description="Resume a run (or a branch) from its newest checkpoint with "
                       "its saved config, applying a pending replan.")
    s.add_argument("run", help="run folder")
    s.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE for resumable fields, "
                   "e.g. train.log_every=5")
    add_accept_data_change(s)
    add_process_options(s)
    s.set_defaults(fn=cmd_resume)

    h = sub.add_parser("history", help="a run's operations, events and per-stage drop rates",
                       description="A run's starts and resumes (devices, changed settings), "
                       "operations, stops, alerts and crashes (a start with no final record), "
                       "oldest first; a branch's begins with its parent's before the fork. Then "
                       "drops per context stage, a row per EP layout a resume changed.")
    h.add_argument("run", help="run folder, or a URL such as gs://bucket/runs/x (logs only)")
    h.set_defaults(fn=cmd_history)

    from moelab.ops.drops_cli import add_drops

    add_drops(sub)
