"""The training loop: the step loop (metrics, evaluation, checkpoints, signals) and the finish
(final evaluation, summary, baseline, sample). What is built before the first step (config,
data, run folder, mesh, state, trackers, step functions) is in ``moelab.train.setup``; the
resume rules in ``moelab.train.resume``; the evaluation itself in ``moelab.train.heldout``.

A run folder holds::

    config.yaml        the resolved config (what this run is)
    tokenizer.json     a copy of the tokenizer, so the folder alone can generate text
    provenance.json    git commit and diff hash, config hash, data fingerprint, library versions
    metrics.jsonl      append-only metrics and events (the source of truth for every report)
    checkpoints/       orbax checkpoints (params, optimizer and router state, step, data position)
    summary.json       the final summary (written atomically at the end of each invocation)

Running ``train`` again on the same folder resumes from the newest valid checkpoint; one
process at a time trains a folder (``moelab.run.lock``). SIGINT, SIGTERM or SIGHUP finish the
current step (or abandon an evaluation, which a resume then does), save a checkpoint and return
(a second Ctrl-C aborts at once, naming the newest checkpoint). A console whose reader went away
is silenced, not fatal. Every step checks its loss and gradient norm for NaN/inf on the device;
the loop reads those checks where it waits for the device anyway (logs, evaluations, saves), so
a non-finite state is never saved (``train.on_nonfinite``: stop, or skip such steps).
"""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import jax

from moelab.config import RunConfig
from moelab.config.io import flatten_config
from moelab.data.prepare import data_text
from moelab.data.sampler import heldout_text
from moelab.parallel.distributed import (
    agree_any,
    agree_signal,
    barrier,
    check_same_run,
    is_main,
    lost_peer_error,
)
from moelab.planner.counts import train_flops_per_token
from moelab.run.checkpoint import Checkpointer, CheckpointError, save_failure
from moelab.run.lock import run_lock
from moelab.train.adapt import Adapter

# evaluate is called through this module's name (tests patch it)
from moelab.train.heldout import evaluate, final_eval_tokens, gzip_bpb, sample_text
from moelab.train.profile import StepTracer
from moelab.train.resume import finished_summary, resume_step
from moelab.train.setup import RunSetup, setup_run, train_step_at
from moelab.train.step import FINITE_CHECKED, drops_text, first_nonfinite, nonfinite_advice
from moelab.train.tracker import abort_text, check_trackers, fmt_time, mfu_text, stage_text
from moelab.util import (
    atomic_write_json,
    describe_error,
    info,
    is_url,
    native_work,
    silence_gone_console,
    stop_signals,
)


class _StopFlag:
    """Turns SIGINT, SIGTERM and SIGHUP (a closed terminal; unless ignored, as under nohup)
    into a polite stop request; a second SIGINT aborts at once."""

    def __init__(self):
        self.signal: str | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, *stop_signals()):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal is not None:  # the first signal names the stop (a preemption's SIGTERM)
            return
        self.signal = signal.Signals(signum).name
        try:  # steps already handed to the device finish first (it runs behind this loop)
            info(f"\n{self.signal} received: stopping after the steps under way and saving a "
                 "checkpoint (Ctrl-C again to abort without saving)")
        except (OSError, RuntimeError):  # a dead console, or a write this handler interrupted
            pass

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class _Progress:
    """What the step loop changes as it goes: read by the saves, the summary and the record of
    a failure."""

    step: int
    state: dict  # the live train state (the step function donates the previous one)
    metrics: dict = field(default_factory=dict)  # the last logged, saved with each checkpoint
    logged: bool = False  # ``metrics`` is this start's (else the checkpoint's, an earlier one's)
    t_first: float | None = None  # end of the first step since (re)compilation: the clock start
    step_first: int | None = None  # the step count then
    paused: float = 0.0  # seconds of evaluation and saves since t_first, off the clock
    stop_signal: str | None = None  # the signal that stopped the run, if one did
    unchecked: list = field(default_factory=list)  # (step, finite check on device) not yet read
    skips: int = 0  # consecutive non-finite steps skipped (train.on_nonfinite=skip)
    eval_pending: bool = False  # a scheduled evaluation not done yet (saved with a checkpoint)
    console_lost: set = field(default_factory=set)  # stdout/stderr found gone, event logged


def train(cfg: RunConfig, run_dir: Path | str, *, verbose: bool = True,
          sample_prompt: str | None = "The ", accept_data_change: bool = False) -> dict:
    """Train (or resume) the run in ``run_dir``, holding the folder's lock. Returns the
    summary dict. A URL (gs://, s3://, file://...) trains in a mirrored local copy
    (``moelab.run.remote``). ``accept_data_change``: resume on data other than the run
    recorded, logging the change (otherwise refused)."""
    check_trackers(cfg)  # before the run folder (or its local mirror) is made
    # several processes: one run folder and one config, or they hang or train apart
    check_same_run(flatten_config(cfg.to_dict()), None if is_url(run_dir) else run_dir)
    if is_url(run_dir):
        from moelab.run.remote import mirrored_run

        with mirrored_run(str(run_dir)) as mirror:
            return _train(cfg, mirror.local, verbose, sample_prompt, accept_data_change, mirror)
    with run_lock(run_dir, enabled=is_main()):
        return _train(cfg, Path(run_dir), verbose, sample_prompt, accept_data_change)


def _train(cfg: RunConfig, run_dir: Path, verbose: bool, sample_prompt: str | None,
           accept_data_change: bool, mirror=None) -> dict:
    with ExitStack() as reading:  # the data folder is marked as read by this run until the end
        return _train_reading(cfg, run_dir, verbose, sample_prompt, accept_data_change, mirror,
                              reading)


def _train_reading(cfg: RunConfig, run_dir: Path, verbose: bool, sample_prompt: str | None,
                   accept_data_change: bool, mirror, reading: ExitStack) -> dict:
    if is_main():  # a re-save of a step killed between its renames: the old one resumes
        Checkpointer(run_dir / "checkpoints").put_back()
    barrier("checkpoints-put-back")  # listed by every process from here
    url = mirror.url if mirror is not None else None  # a run URL: named by it, not its copy
    done = finished_summary(cfg, run_dir, info if verbose and is_main() else (lambda _m: None),
                            url)
    if done is not None:
        return {**done, "run_dir": url or str(run_dir)}
    try:
        run, state = setup_run(cfg, run_dir, verbose=verbose, mirror=mirror,
                               accept_data_change=accept_data_change, hold=reading)
    except KeyboardInterrupt as e:  # say what is kept (setup's own record says "aborted")
        e.args = (abort_text(e, None, resume_step(run_dir)),)
        raise
    if run.restored and run.start >= run.cfg.train.steps:
        run.say(f"{run.run_dir} is at its last step {run.start}: nothing left to train; running "
                "its final evaluation and writing its summary (a stop came before the summary)")
    progress = _Progress(step=run.start, state=state, metrics=run.metrics,
                         eval_pending=run.eval_pending)
    del state  # the loop replaces the state every step: hold no reference to the first one
    t_run = time.time()
    with _StopFlag() as flag:
        try:
            # Ctrl-C twice may land in XLA's compile or run (an evaluation's first call): the CLI
            # then ends the process at once, as interpreter shutdown would stop its threads
            with native_work():  # inside native code (a segmentation fault, not exit 130)
                _run_steps(run, progress, flag)
                summary = _finish(run, progress, t_run, sample_prompt, flag)
        except KeyboardInterrupt as e:  # Ctrl-C twice: say where a re-run resumes
            run.ckpt.close()  # a background save completes first: it may be the newest
            newest = run.ckpt.latest_step()
            e.args = (abort_text(e, progress.step if progress.step > run.start else None,
                                  newest),)
            _record_end(run, "aborted", progress.step, e, resume_from=newest)
            raise
        except BaseException as e:  # the record says why the run stopped (reports list it)
            _record_end(run, "failed", progress.step, e)
            raise
        finally:
            _close(run)
    if mirror is not None:
        summary["run_dir"] = mirror.url
    if run.main:
        atomic_write_json(run.run_dir / "summary.json", summary)
    return summary


def _record_end(run: RunSetup, kind: str, step: int, e: BaseException, **fields) -> None:
    """The event that says why the run ended; when it cannot be written (a full disk), the
    reason still reaches stderr."""
    error = describe_error(e)
    try:
        run.trackers.event(kind, step, error=error, **fields)
    except OSError as err:
        info(f"could not record the {kind} event in {run.run_dir / 'metrics.jsonl'} ({err}); "
             f"the run ended at step {step}: {error}")


def _close(run: RunSetup) -> None:
    run.ckpt.close()  # a background save still running completes (it is a valid state)
    try:
        run.trackers.close()
    except OSError as e:  # must not hide the error that ended the run
        info(f"closing the run's logs in {run.run_dir}: {e}")


def _stop_asked(flag: _StopFlag):
    """Asked between evaluation batches: a stop signal abandons an evaluation (on every
    process at once) rather than waiting for its end."""
    return lambda: agree_any(flag.signal is not None)


def _run_steps(run: RunSetup, p: _Progress, flag: _StopFlag) -> None:
    """Train from ``p.step`` to the last step, or to the step at which a stop signal arrived;
    checkpoint on the way and at the end (unless nothing was trained since the restore). An
    evaluation that a stop left undone is done first on resume."""
    tracer = StepTracer(run.cfg.train.profile_steps, run.run_dir, run.say)
    try:
        _step_loop(run, p, flag, tracer)
        tracer.close(p.state)  # a run that ends inside the traced steps: its last ones whole
    finally:
        tracer.close()  # after an error: stop the trace, waiting for nothing
    if p.step > run.start or not run.restored:
        _save(run, p)


def _step_loop(run: RunSetup, p: _Progress, flag: _StopFlag, tracer: StepTracer) -> None:
    """The steps from ``p.step`` on, until the last step or a stop signal."""
    cfg, steps = run.cfg, run.cfg.train.steps
    stop = p.eval_pending and not _log_eval(run, p, flag)
    adapter = Adapter(run)  # drop gates and re-placement (off the clock; they record events)
    while p.step < steps and not stop:
        p.state = _paused(p, adapter.before_step, p.step, p.state,
                          settle=adapter.acts_at(p.step))
        change = run.sampler.change_at(p.step)
        if change:  # new mixture or context; a new shape recompiles: restart the clock
            run.trackers.event("data_stage", p.step, **change)
            run.say(stage_text(p.step, change))
            p.t_first, p.paused = None, 0.0
        _paused(p, tracer.before, p.step + 1, p.state,  # writing a trace is off the clock
                settle=tracer.starts_at(p.step + 1))
        step_fn = train_step_at(run, p.step)
        p.state, m = step_fn(p.state, run.put_batch(run.sampler.batch(p.step)))
        p.step += 1
        for where, why in run.sampler.new_skips():  # a stream's bad records, each said once
            run.say(f"note: the data stream skipped {where}: {why}")
            run.trackers.event("data_skipped", p.step, where=where, reason=why)
        _paused(p, tracer.after, p.step, p.state, settle=tracer.stops_at(p.step))
        p.unchecked.append((p.step, _check_values(m)))
        stop = agree_any(flag.signal is not None)  # all processes stop at the same step
        if p.t_first is None:  # exclude compilation from throughput
            jax.block_until_ready(m)
            p.t_first, p.step_first, p.paused = time.time(), p.step, 0.0  # pauses before: off
        if p.step % cfg.train.log_every == 0 or p.step == steps or stop:
            _log_metrics(run, p, m)
        p.eval_pending = p.step % cfg.train.eval_every == 0 and p.step < steps
        if p.eval_pending and not stop:
            stop = not _log_eval(run, p, flag)
        if not stop and p.step % cfg.train.ckpt_every == 0 and p.step < steps:
            # written in the background (train.async_ckpt)
            _paused(p, _save, run, p, False, settle=True)
    if stop:  # every process takes part: it may have been another process's signal
        agreed = agree_signal(flag.signal)
        p.stop_signal = flag.signal or agreed or "SIGTERM"


def _paused(p: _Progress, fn, *args, settle: bool = False):
    """Run evaluation, a save or an adaptation outside the throughput clock (before the clock
    starts, nothing is on it). ``settle``: ``fn`` reads the state (a save, a re-placement, a
    trace's start or stop), so the steps still queued on the device finish first, on the
    clock: else their compute would count as paused, and the throughput between two logged
    steps as many times what the device does. (Evaluation waits there already: it first reads
    the steps' finite checks.)"""
    if settle:
        jax.block_until_ready(p.state)
    t0 = time.time()
    out = fn(*args)
    if p.t_first is not None:
        p.paused += time.time() - t0
    return out


def _save(run: RunSetup, p: _Progress, wait: bool = True) -> None:
    """Checkpoint the state, never one a non-finite step produced; a failed save (a full disk)
    is one line naming the step, the cause and the resume point. ``wait=False``: return once
    the state is copied to host memory (the last save of a run waits: it is complete when
    ``train`` returns)."""
    _check_finite(run, p)
    meta = {"step": p.step, "data": run.sampler.state(), "config": run.cfg.to_dict(),
            "metrics": {k: float(v) for k, v in p.metrics.items()},
            "eval_pending": p.eval_pending, **run.tok_record,
            # model.remat=auto as the run chose it (the config keeps "auto")
            **({"remat": {"policy": run.remat[0], "scan_unroll": run.remat[1]}}
               if run.remat else {})}
    run.trackers.flush()  # a remote run uploads the logs with the checkpoint
    try:
        run.ckpt.save(p.step, p.state, meta, wait=wait)
    except CheckpointError:  # an earlier background save failed: reported with its own step
        raise
    except Exception as e:  # noqa: BLE001 -- any failure: the same report, the cause inside
        if lost_peer_error(e) is not None:  # another process is gone: ends this one at once
            raise
        raise CheckpointError(save_failure(run.ckpt, p.step, e)) from e


def _check_values(m: dict) -> dict:
    """The metrics a finite check reads (device arrays: nothing is fetched here)."""
    return {k: m[k] for k in ("train/finite", *FINITE_CHECKED)}


def _check_finite(run: RunSetup, p: _Progress) -> None:
    """Read the finite checks of the steps since the last read (at a log, an evaluation or a
    save: points that wait for the device anyway). A non-finite step stops the run
    (``train.on_nonfinite=stop``) or, with ``skip``, was not applied by the step function and
    is recorded; too many in a row stop the run."""
    checks, p.unchecked = jax.device_get(p.unchecked), []
    for step, c in checks:
        if bool(c["train/finite"]):
            p.skips = 0
            continue
        metric, value = first_nonfinite(c)
        p.skips += 1
        if run.cfg.train.on_nonfinite == "skip" and p.skips <= run.cfg.train.skip_limit:
            run.trackers.event("skipped", step, metric=metric, value=str(value),
                               consecutive=p.skips)
            continue
        run.trackers.event("diverged", step, metric=metric, value=str(value),
                           loss=str(c["train/loss"]))
        raise FloatingPointError(nonfinite_advice(run.cfg, step, metric, value, p.skips,
                                                  run.ckpt.latest_step()))


def _log_metrics(run: RunSetup, p: _Progress, m) -> None:
    """Log the step's metrics with throughput and hardware stats (after the finite checks; a
    skipped step has no record, only its event)."""
    _check_finite(run, p)
    cfg, step, steps = run.cfg, p.step, run.cfg.train.steps
    metrics = {k: float(v) for k, v in jax.device_get(m).items()}
    if not metrics.pop("train/finite"):
        return
    p.metrics, p.logged = metrics, True
    busy = time.time() - p.t_first - p.paused
    done = step - p.step_first
    tokens = cfg.data.tokens_before(step)
    rate = ((tokens - cfg.data.tokens_before(p.step_first)) / max(busy, 1e-9) if done else 0.0)
    seq_len = run.sampler.at(step - 1).seq_len  # metrics tagged with the context
    if rate:  # none measured yet after the clock (re)starts: a 0 would chart as a dip
        metrics["throughput/tokens_per_s"] = rate
        metrics.update(run.peak.metrics(rate * train_flops_per_token(cfg.model, seq_len)))
    metrics["train/tokens"] = tokens
    metrics["data/seq_len"] = seq_len
    run.trackers.log(step, {**metrics, **run.hardware.sample()})
    eta = (cfg.data.tokens_before(steps) - tokens) / rate if rate else float("nan")
    # the clock (re)starts after the first step of a start, a resume or a data stage (a new
    # shape compiles): no rate until a later step is logged
    speed = (f"{rate:,.0f} tok/s | {mfu_text(metrics, run.peak)} | ETA {fmt_time(eta)}"
             if rate else "no rate yet (clock restarted)")
    run.say(f"step {step:>6}/{steps} | loss {metrics['train/loss']:.4f} | "
            f"lr {metrics['train/lr']:.2e} | gnorm {metrics['train/grad_norm']:.2f} | "
            + (f"drops {drops} | " if (drops := drops_text(cfg, metrics)) else "") + speed)
    _note_console(run, p)


def _note_console(run: RunSetup, p: _Progress) -> None:
    """A console whose reader went away (`moelab train ... | head`, a closed terminal) is
    silenced, not a reason to lose the run's work; its log says so, once per stream."""
    gone = silence_gone_console() - p.console_lost
    if gone:
        p.console_lost |= gone
        run.trackers.event("console_lost", p.step, streams=sorted(gone),
                           note="output to the console is discarded from here on")


def _log_eval(run: RunSetup, p: _Progress, flag: _StopFlag) -> bool:
    """The scheduled held-out evaluation (off the throughput clock), logged and shown; False
    when a stop signal abandoned it (it stays pending, and a resume does it)."""
    cfg = run.cfg
    _check_finite(run, p)
    evals = _paused(p, evaluate, cfg, run.eval_fn, p.state, run.store, cfg.train.eval_tokens,
                    run.put_batch, _stop_asked(flag))
    if evals is None:
        return False
    p.eval_pending = False
    run.trackers.log(p.step, evals)
    run.say("  eval " + "  ".join(f"{k.split('/')[1]} {v:.3f}"
                                  for k, v in evals.items() if k.endswith("/bpb"))
            + " bits/byte")
    return True


def _summary(run: RunSetup, p: _Progress, t_run: float) -> dict:
    """The summary of the steps trained (before the end-of-run evaluation)."""
    cfg = run.cfg
    summary = {"run_dir": str(run.run_dir), "step": p.step, "steps": cfg.train.steps,
               "interrupted": p.stop_signal, "config_hash": cfg.hash(),
               "params_total": run.counts["total"], "params_active": run.counts["active"],
               "tokens_trained": cfg.data.tokens_before(p.step), "start_step": run.start,
               "tokens_this_start": cfg.data.tokens_before(p.step) - cfg.data.tokens_before(
                   run.start), "wall_time_s": time.time() - t_run, "peak_flops": run.peak.rated,
               "peak_source": run.peak.source, "measured_peak_flops": run.peak.measured}
    summary["train/loss"] = p.metrics.get("train/loss")  # the state's, whichever start logged it
    # a rate only as this start measured it: a start that trained no step has none
    summary.update({k: p.metrics.get(k) if p.logged else None for k in (
        "throughput/tokens_per_s", "throughput/mfu", "throughput/share_of_measured_peak")})
    summary["drops"] = drops_text(cfg, p.metrics) or None
    summary["data"] = data_text(cfg.data, run.store, run.data.corpus_dir, max(p.step - 1, 0))
    return summary


def _final_eval(run: RunSetup, p: _Progress, flag: _StopFlag) -> dict | None:
    """The end-of-run evaluation over the whole held-out split; a stop signal abandons it (the
    run is then interrupted, and running it again does the evaluation)."""
    evals = evaluate(run.cfg, run.eval_fn, p.state, run.store,
                     final_eval_tokens(run.cfg, run.store), run.put_batch, _stop_asked(flag))
    if evals is None:
        p.stop_signal = flag.signal or "SIGTERM"
    return evals


def _finish(run: RunSetup, p: _Progress, t_run: float, sample_prompt: str | None,
            flag: _StopFlag) -> dict:
    """The summary; a run that was not stopped also gets the final evaluation over the whole
    held-out split, the gzip baseline and a sample, and is recorded as finished."""
    evals = None if p.stop_signal is not None else _final_eval(run, p, flag)
    summary = _summary(run, p, t_run)
    if p.stop_signal is not None:
        run.trackers.event("interrupted", p.step, signal=p.stop_signal)
        return summary
    run.trackers.log(p.step, evals)
    summary.update(evals)
    if "prose" in run.store.domains("heldout") and run.main:
        summary["baseline/prose/gzip9_bpb"] = gzip_bpb(heldout_text(run.data.corpus_dir, "prose"))
    if sample_prompt is not None and jax.process_count() == 1:
        summary["sample"] = sample_text(run.cfg, run.tok, p.state, sample_prompt)
    run.trackers.event("finished", p.step)
    return summary
