"""What a resume trains with: the run folder's saved config, changed only where a resume may
change it, with a pending replan applied.

A replan request (``plan_pending.json``, written by `moelab replan`) waits in the run folder so
a live run never sees its files change under it; the next resume applies it at the step it
resumes from, then logs the application in ``ops.jsonl`` and removes the request. Binding the
change to the resume step keeps the run's past untouched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moelab.config import (
    OPERATION_FIELDS,
    ConfigError,
    RunConfig,
    config_from_dict,
    flatten_config,
    load_run_config,
)
from moelab.config.errors import INT32_MAX
from moelab.config.run import TRANSPORT_KNOBS
from moelab.data.prepare import with_tokenizer_vocab
from moelab.run.checkpoint import Checkpointer, CheckpointError
from moelab.run.identity import checkpoint_config, run_config_or_checkpoint
from moelab.run.logs import log_operation, read_metrics
from moelab.train.changes import (
    Change,
    PlanError,
    apply_change,
    check_future_only,
    inherit_operations,
    lr_curve,
    recorded_decisions,
)
from moelab.util import is_url

PENDING = "plan_pending.json"

# Fields that may change when a run is resumed: they change how a step is computed (devices,
# kernels, micro-steps, where experts sit), not the model, the data or the schedule.
RESUMABLE_CHANGES = {"train.steps", "train.log_every", "train.eval_every", "train.ckpt_every",
                     "train.keep_ckpts", "train.eval_tokens", "train.peak_flops", "train.wandb",
                     "train.wandb_project", "parallel.devices", "parallel.expert",
                     "parallel.ragged_impl", "parallel.ragged_round_cf", "model.remat",
                     "model.scan_unroll", "model.moe_impl", "model.moe_block",
                     "train.microbatch_tokens", "parallel.fsdp", "model.attention_impl",
                     "model.loss_chunk", "train.on_nonfinite", "train.skip_limit",
                     "train.tensorboard", "train.async_ckpt", "train.profile_steps",
                     "train.memory_check",
                     "parallel.replace_every",
                     # the transport and its capacities set drops, as parallel.expert does; a
                     # move to another EP degree may need other waves or budget groups
                     "parallel.transport", *(f"parallel.{k}" for k in TRANSPORT_KNOBS),
                     # where the data is may change; what it is, is checked by its fingerprints
                     "data.data_dir", "data.tokenizer", "data.source"}
# Why a field that is no new model still may not change on resume, where the generic reason
# ("a run folder trains one model") would mislead; each reason ends where "a new --run-dir"
# follows
KEPT_BECAUSE = {"optim.moment_dtype": "Its checkpoints hold the optimizer's moments in the "
                "dtype it started with, and a run keeps it: train the other dtype in"}


def resume_step(run_dir: Path | str) -> int | None:
    """The step a resume would start from now: the newest checkpoint."""
    return Checkpointer(Path(run_dir) / "checkpoints").latest_step()


def pending_problem(pending) -> str | None:
    """What is wrong with a parsed ``plan_pending.json`` (None: a request `moelab replan`
    writes), so a hand-edited or damaged file is named instead of failing mid-resume."""
    if not isinstance(pending, dict) or not isinstance(pending.get("change"), dict):
        return 'expected {"change": {...}, "requested_at_step": N, "reason": "..."}'
    change = pending["change"]
    whole = {k: change.get(k) for k in ("end", "seq_len") if change.get(k) is not None}
    for k, v in whole.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT32_MAX:
            return f"change.{k}: {v!r} is not a step count or length in 1-{INT32_MAX}"
    floor, mixture = change.get("floor"), change.get("mixture")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float))):
        return f"change.floor: {floor!r} is not a number"
    if mixture is not None and not (isinstance(mixture, dict) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in mixture.values())):
        return f"change.mixture: {mixture!r} is not a mapping of domain to weight"
    unknown = set(change) - {"end", "floor", "mixture", "seq_len"}
    if unknown:
        return f"change: unknown field(s) {sorted(unknown)}"
    at = pending.get("requested_at_step")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int)):
        return f"requested_at_step: {at!r} is not a step"
    if not isinstance(pending.get("reason", ""), str):
        return "reason: not text"
    return None


def read_pending(run_dir: Path | str) -> dict | None:
    path = Path(run_dir) / PENDING
    if not path.is_file():
        return None
    try:
        pending = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); delete it and run `moelab replan` "
                          "again") from None
    problem = pending_problem(pending)
    if problem:
        raise ConfigError(f"{path}: not a replan request ({problem}); delete it and run "
                          "`moelab replan --apply` again")
    return pending


def pending_text(pending: dict) -> str:
    """A pending replan in one phrase: its change and the step it was asked at."""
    change = ", ".join(f"{k}={v}" for k, v in pending["change"].items()) or "no change"
    at = pending.get("requested_at_step")
    return change + (f", requested at step {at:,}" if at is not None else "")


def resume_config(saved: RunConfig, cfg: RunConfig, run_dir: Path | str) -> RunConfig:
    """The config a resume of ``run_dir`` trains with: the run's operations kept, a pending
    replan applied at the resume step, and no operation allowed to rewrite the past."""
    cfg = inherit_operations(saved, cfg)
    cfg = recorded_decisions(cfg, read_metrics(Path(run_dir) / "metrics.jsonl")[1])
    at = resume_step(run_dir)
    pending = read_pending(run_dir)
    if pending is not None:
        _check_end_agrees(saved, cfg, pending, run_dir)
        try:
            cfg = apply_change(cfg, at, Change.from_dict(pending["change"]), keep_warmup=True)
        except (PlanError, ConfigError) as e:
            raise PlanError(f"{Path(run_dir) / PENDING}: cannot apply at step {at}: {e}. Run "
                            "`moelab replan` again or delete the file") from None
    check_future_only(saved, cfg, at)
    return cfg


def _check_end_agrees(saved: RunConfig, cfg: RunConfig, pending: dict, run_dir) -> None:
    """A train.steps given now (a preset's own included) other than the run's, and a pending
    replan's end, ask for two ends: refused rather than one silently dropped."""
    end, steps = pending["change"].get("end"), cfg.train.steps
    if end is None or steps in (saved.train.steps, end):
        return
    raise ConfigError(f"train.steps={steps} (given now) and the end of the replan pending in "
                      f"{Path(run_dir) / PENDING} ({end}) disagree: resume with the replan's "
                      f"end (`moelab resume {run_dir}`), or replace the plan (`moelab replan "
                      f"{run_dir} --end-steps {steps} --apply --replace`)")


def check_given_end(cfg: RunConfig, run_dir: Path | str) -> None:
    """A train.steps typed for a run whose end a replan or branch set would be dropped for that
    end (a config that restates no operation inherits them: ``inherit_operations``): refused,
    naming the way to move the end."""
    at = resume_step(run_dir)
    if at is None:
        return
    saved = recovered_config(run_dir)
    check_stop_step(saved, cfg, at, Path(run_dir))  # no replan moves it there
    if saved.optim.decays and not cfg.optim.decays and cfg.train.steps != saved.train.steps:
        raise ConfigError(f"train.steps={cfg.train.steps}: {run_dir} ends at step "
                          f"{saved.train.steps}, where its re-timed decay (a replan or branch) "
                          f"ends; to move the end: `moelab replan {run_dir} --end-steps "
                          f"{cfg.train.steps} --apply`, then `moelab resume {run_dir}`")


def commit_pending(run_dir: Path | str, cfg: RunConfig) -> None:
    """After the resumed config is saved: log the applied replan and remove the request."""
    pending, at = read_pending(run_dir), resume_step(run_dir)
    if pending is None or at is None:  # no checkpoint: a fresh start did not apply it
        return
    log_operation(run_dir, "replan_applied", at, reason=pending.get("reason", ""),
                  change=pending["change"], requested_at_step=pending.get("requested_at_step"),
                  end=cfg.train.steps, decays=[vars(d) for d in cfg.optim.decays],
                  lr_at_step=float(lr_curve(cfg, [at])[0]))
    (Path(run_dir) / PENDING).unlink()


def as_started(cfg: RunConfig) -> RunConfig:
    """A run's saved config (config.yaml, a checkpoint's meta.json) with data.sampler as the run
    draws its batches: a config without it ("") is from a run started before epochs existed,
    which drew random windows and keeps drawing them; a run never changes its data order."""
    if cfg.data.sampler:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sampler="random"))


def with_sampler_of(cfg: RunConfig, saved: RunConfig | None) -> RunConfig:
    """``cfg`` with data.sampler written out: the given one, else the run's own (``saved``, a
    resume), else epoch (a new run), so config.yaml records what the run draws."""
    kind = cfg.data.sampler or (saved.data.sampler if saved is not None else "epoch")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sampler=kind))


def recovered_config(run_dir: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """The run's config.yaml with ``overrides``; when the file was deleted but checkpoints
    remain, the config the newest of them was trained with (never a different one)."""
    return run_config_or_checkpoint(run_dir, overrides)[0]


def _differing(old: dict, new: dict, allowed) -> list[str]:
    return [k for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k) and k not in allowed]


def devices_in_use(run_dir: Path | str) -> int | None:
    """How many devices the run's last start or resume trained on (its event's ``devices``;
    None for a run that never recorded it)."""
    events = read_metrics(Path(run_dir) / "metrics.jsonl")[1]
    return next((e["devices"] for e in reversed(events) if e.get("event") in ("start", "resume")
                 and isinstance(e.get("devices"), int)), None)


def resume_changes(run_dir: Path | str, cfg: RunConfig, devices: int | None = None) -> list[str]:
    """What training ``cfg`` (as ``resolve_run_config`` resolved it) in ``run_dir`` changes
    against the run's config.yaml, one "field old -> new" each: the settings given now (a
    preset's own train.steps included) and a pending replan. Empty for a run not started.
    ``devices``: how many it trains on now; where parallel.devices is 0 (all) before or now,
    a count other than the last start's is named with it (the same 0 on other machines)."""
    if resume_step(run_dir) is None:
        return []
    saved = as_started(recovered_config(run_dir).with_absolute_data())
    old, new = flatten_config(saved.to_dict()), flatten_config(cfg.to_dict())

    def change(k: str) -> str:
        a, b = old.get(k), new.get(k)
        if isinstance(a, list) and isinstance(b, list) and a and b[:len(a)] == a:
            # entries added (a replan's decay, mixture change or stage): name them, not the
            # entries kept, which a cut text would show in their place
            return f"{k} {_cut(repr(a))} -> the same + {_cut(repr(b[len(a):]))}"
        ta, tb = repr(a), repr(b)
        # long values alike at the start (paths, lists): both cut where they first differ
        at = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        return f"{k} {_cut(ta, at)} -> {_cut(tb, at)}"

    lines = {k: change(k) for k in _differing(old, new, ())}
    k, was = "parallel.devices", devices_in_use(run_dir)
    if devices and was and was != devices and 0 in (old.get(k), new.get(k)):
        lines[k] = f"{k} {old.get(k)!r} -> {new.get(k)!r} ({was} -> {devices} devices)"
    return [lines[k] for k in sorted(lines)]


def _cut(text: str, at: int = 0, width: int = 60) -> str:
    """``text`` in at most about ``width`` characters, showing its character ``at`` (where
    two values first differ) with a little of what comes before it."""
    if len(text) <= width:
        return text
    start = max(0, at - 20)
    if start <= 3:
        return text[:width - 3] + "..."
    if start + width - 3 >= len(text):
        return "..." + text[3 - width:]
    return "..." + text[start:start + width - 6] + "..."


def check_config_identity(saved: RunConfig, run_dir: Path, name: str | None = None) -> None:
    """Refuse a config.yaml that differs from the config the newest checkpoint was trained with
    (a hand edit): name the fields and the ways to change a run that exist. ``name``: a run
    URL whose staging copy ``run_dir`` is (the file to restore is the URL's)."""
    got = checkpoint_config(run_dir)
    if got is None:
        return
    step, data = got
    trained = as_started(config_from_dict(data).with_absolute_data())
    old, new = flatten_config(trained.to_dict()), flatten_config(saved.to_dict())
    bad = _differing(old, new, RESUMABLE_CHANGES | set(OPERATION_FIELDS))
    if bad:
        what = ", ".join(f"{k} ({new.get(k)!r} in config.yaml, {old.get(k)!r} in meta.json)"
                         for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConfigError(f"{name or run_dir}/config.yaml: differs from the config the "
                          f"checkpoint of step {step} was trained with (its meta.json): {what}. "
                          "Restore config.yaml to those values" + (
                              "" if name else "; to change a run, use `moelab replan` (end, "
                              "decay, mixture, context) or `moelab branch` (a new run folder "
                              "from a checkpoint)"))
    check_future_only(trained, saved, step)  # an operation's past, edited by hand


def check_unedited(run_dir: Path | str) -> RunConfig:
    """The run's config.yaml, refused when edited by hand (``check_config_identity``): a replan
    or a branch planned from it would show, and a branch copy, settings the run never trained
    with."""
    saved = as_started(load_run_config(run_dir).with_absolute_data())
    check_config_identity(saved, Path(run_dir))
    return saved


def stop_step_text(steps: int, at: int, end: int, run_dir: Path | str,
                   name: str | None = None) -> str:
    """Why train.steps=``steps`` is refused for a run at step ``at`` that ends at ``end``, and
    the fixes: a later end, or an earlier one that a replan or a branch still can give (not to
    a run URL, ``name``: ``run_dir`` is then its staging copy, and they take local runs)."""
    shown = name or run_dir
    text = (f"train.steps={steps}: {shown} is at step {at} already, so it would train "
            f"nothing; to train it on, give a train.steps above {at} (`moelab resume {shown} "
            f"train.steps=M`)")
    if name is not None:
        return text
    if at < end:  # not at its end yet: a replan may still end it sooner than planned
        text += (f", or, to end it sooner than step {end}, `moelab replan {run_dir} --end-steps "
                 f"M --apply` with M above {at}")
    earlier = [s for s in Checkpointer(Path(run_dir) / "checkpoints").steps() if s < steps]
    if earlier:  # a step it passed: a cooldown branch from before it ends there
        text += (f"; for a model that ends by step {steps}: `moelab branch {run_dir} --at K "
                 f"--cooldown TOKENS` from a checkpoint K in {', '.join(map(str, earlier))}")
    return text


def check_stop_step(saved: RunConfig, cfg: RunConfig, at: int, run_dir: Path,
                    name: str | None = None) -> None:
    """A new train.steps at or below the step the run resumes from would train nothing."""
    steps = cfg.train.steps
    if steps != saved.train.steps and steps <= at:
        raise ConfigError(stop_step_text(steps, at, saved.train.steps, run_dir, name))


def resolve_run_config(cfg: RunConfig, run_dir: Path, name: str | None = None) -> RunConfig:
    """The config to use in ``run_dir``: the saved one, updated only where a resume allows.
    A folder without checkpoints has trained nothing yet, so any config may (re)start it.
    ``name``: a run URL whose staging copy ``run_dir`` is (its refusals name the URL)."""
    at = resume_step(run_dir)
    if at is None:
        return with_sampler_of(cfg, None).with_frozen_schedule()
    saved = as_started(recovered_config(run_dir).with_absolute_data())
    check_config_identity(saved, run_dir, name)
    if cfg.optim.schedule_steps == 0:  # "follow train.steps" means the length it started with
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, schedule_steps=saved.optim.schedule_steps,
            warmup_steps=cfg.optim.warmup_steps or saved.optim.warmup_steps))
    cfg = with_sampler_of(cfg, saved)  # not given: the run's own
    # operations (replan, branch) are kept, a pending replan applied, the past left as it was
    cfg = resume_config(saved, cfg.with_frozen_schedule(), run_dir)
    check_stop_step(saved, cfg, at, run_dir, name)
    old, new = flatten_config(saved.to_dict()), flatten_config(cfg.to_dict())
    bad = _differing(old, new, RESUMABLE_CHANGES | set(OPERATION_FIELDS))
    if bad:
        k = bad[0]
        why = KEPT_BECAUSE.get(k, "A run folder trains one model: use")
        raise ConfigError(f"{k}: {name or run_dir} was started with {old.get(k)!r}, now "
                          f"{new.get(k)!r}. {why} a new --run-dir (or, to continue this run as "
                          f"it was configured, `moelab resume {name or run_dir}`)")
    return cfg


def say_start(cfg: RunConfig, run_dir: Path | str, start: int | None, changed: list[str],
              started_before: bool, say) -> None:
    """The line a resume (``start``: its step) or a restart begins with: the settings it
    changes, and steps it adds past the LR schedule's end (they train at the floor LR).
    ``run_dir``: the run as the user named it (a URL run's URL, not this machine's copy)."""
    if start is None:
        if started_before:
            say(f"{run_dir}: no checkpoint to resume from (stopped before its first); training "
                "from step 0")
        return
    say(f"resuming {run_dir} from step {start}" + (
        f", with {len(changed)} setting(s) changed from its config.yaml: " + "; ".join(changed)
        if changed else ""))
    # where the LR reaches its floor: the base schedule's end, or a replan's or branch's decay
    end, floor = cfg.floor_end
    first = max(start, end) + 1
    if cfg.train.steps >= first:
        span = (f"step {first} trains" if first == cfg.train.steps else
                f"steps {first}-{cfg.train.steps} train")
        say(f"note: its LR schedule ends at step {end}, so {span} at the floor LR ({floor:g} x "
            "peak)" + (
                f"; to decay over the longer run instead: moelab replan {run_dir} --end-steps "
                f"{cfg.train.steps} --apply" if start < end and not is_url(run_dir) else ""))


def finished_summary(cfg: RunConfig, run_dir: Path, say, name: str | None = None) -> dict | None:
    """The saved summary of a run that finished at the step it is at, when ``cfg`` (as a
    resume resolves it) ends there too: a resume then has nothing to do and says so, adding
    nothing to the run's records. Else None."""
    at, path = resume_step(run_dir), run_dir / "summary.json"
    if at is None or not path.is_file():
        return None
    _, events = read_metrics(run_dir / "metrics.jsonl")
    if not any(e["event"] == "finished" and e["step"] == at for e in events):
        return None
    try:  # an earlier start's summary (this one's was not written: killed) or a damaged one:
        saved = json.loads(path.read_text())  # the final evaluation is done again
    except ValueError:
        return None
    if not isinstance(saved, dict) or saved.get("step") != at or saved.get("interrupted"):
        return None
    try:  # other data or settings: setup says what differs, the data first
        resolved = resolve_run_config(with_tokenizer_vocab(cfg.with_absolute_data()), run_dir,
                                      name)
    except ConfigError:
        return None
    if resolved.train.steps > at:  # trained longer now (a new train.steps, a pending replan)
        return None
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        ckpt.check_folder(ckpt.step_dir(at), at)
    except CheckpointError:
        return None  # damaged: the resume falls back to an older one and trains it again
    pending = read_pending(run_dir)
    shown = name or run_dir
    say(f"{shown} finished at step {at} already; nothing to train. To train it longer: "
        f"`moelab resume {shown} train.steps=N` with N above {at}" + (
            f" (the pending replan, {pending_text(pending)}, applies from step {at} then)"
            if pending else ""))
    return saved
