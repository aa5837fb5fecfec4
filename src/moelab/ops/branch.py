"""`moelab branch`: fork a new run folder from a checkpoint, e.g. an early cooldown.

The branch gets a copy of one checkpoint (hard links where the filesystem allows: checkpoint
files are never rewritten in place, so neither run can change the other's), the parent's
tokenizer, and the parent's config with the branch's change from that step on: a linear decay
from the LR at the step to the floor over the cooldown, and optionally a new mixture or a
longer context. In the parent only its operations log gains one line naming the branch; its
checkpoints, metrics and config stay byte for byte as they were.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from moelab.config import load_run_config, save_config
from moelab.data.prepare import data_identity
from moelab.ops.schedule import check_end, steps_for_tokens
from moelab.run.checkpoint import Checkpointer
from moelab.run.identity import PROVENANCE, check_data, run_data_record
from moelab.run.lock import LOCK_FILE, run_lock
from moelab.run.logs import (
    LINEAGE,
    OPS_LOG,
    JsonlTracker,
    command_line,
    link_to,
    log_operation,
    stops_deferred,
)
from moelab.run.provenance import CODE_FIELDS, branch_provenance
from moelab.train.changes import Change, PlanError, apply_change, check_seq_len
from moelab.train.resume import as_started, check_config_identity
from moelab.util import atomic_write_bytes, atomic_write_json, check_writable, native_work


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def _clear_but_lock(folder: Path) -> None:
    """Empty what a crashed branch left in its folder, but for the lock held now."""
    for p in folder.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        elif p.name != LOCK_FILE:
            p.unlink()


def _copy_checkpoint(src: Path, dst_dir: Path, at: int, parent: Path) -> None:
    """The parent's checkpoint of ``at`` into ``dst_dir``, read under a lease (a live parent's
    trainer does not prune it meanwhile) and checked against its manifest, so a branch never
    holds a damaged or half-copied checkpoint it would fail to resume from."""
    from moelab.run.ckpt_lease import reading
    from moelab.run.ckpt_target import CheckpointError

    with reading(src.parent, at):
        try:
            shutil.copytree(src, dst_dir / src.name, copy_function=_link_or_copy)
            Checkpointer(dst_dir).check_folder(dst_dir / src.name, at)
        except (OSError, shutil.Error, CheckpointError) as e:
            shutil.rmtree(dst_dir, ignore_errors=True)  # then run_lock removes the emptied folder
            steps = Checkpointer(src.parent).steps()
            left = [s for s in steps if s != at]
            why = ("removed while it was copied (the run's trainer pruned it)" if at not in steps
                   else f"unusable ({str(e)[:200]})")
            raise PlanError(f"--at {at}: the checkpoint of {parent} at step {at} is {why}; "
                            f"branch from another: {', '.join(map(str, left)) or 'none'}") from None


def without_planned(cfg, at: int):
    """``cfg`` without the mixture changes and context stages it plans from step ``at`` on:
    from there it trains the mixture and context it trained before ``at``."""
    d = cfg.data
    return replace(cfg, data=replace(
        d, mixture_schedule=[m for m in d.mixture_schedule if m.step < at],
        context_stages=[c for c in d.context_stages if c.step < at])).validate()


def plan_branch(parent: Path | str, at: int, cooldown_tokens: int, *, floor: float | None = None,
                mixture: dict | None = None, seq_len: int | None = None,
                drop_planned: bool = False, loaded=None):
    """(the parent's config, the branch's config) for a cooldown from ``at``; the branch keeps
    the parent's mixture changes and context stages planned from ``at`` on (but those a new
    ``mixture`` or ``seq_len`` replaces) unless ``drop_planned``. ``loaded``: the parent's
    config.yaml as the caller read it (else read here)."""
    # the parent's data, as trained
    parent_cfg = (loaded or load_run_config(parent)).with_absolute_data()
    # a hand edit would be copied into a branch that cannot resume
    check_config_identity(as_started(parent_cfg), Path(parent))
    cfg = without_planned(parent_cfg, at) if drop_planned else parent_cfg
    if seq_len is not None:
        check_seq_len(cfg, seq_len, at, f"--seq-len {seq_len}")
    # checked on the numbers alone, before the checkpoint (tokens per batch stay the same)
    option = f"--cooldown {cooldown_tokens:,} tokens"
    check_end(steps_for_tokens(cfg, cfg.data.tokens_before(at) + cooldown_tokens), option)
    steps = Checkpointer(Path(parent) / "checkpoints").steps()
    if at not in steps:
        raise PlanError(f"--at {at}: {parent} has no checkpoint at that step; checkpoints: "
                        f"{', '.join(map(str, steps)) or 'none'}")
    # the cooldown's tokens are counted at the branch's batch shape (its context stage)
    shaped = apply_change(cfg, at, Change(mixture=mixture, seq_len=seq_len), keep_warmup=False)
    end = check_end(steps_for_tokens(shaped, shaped.data.tokens_before(at) + cooldown_tokens),
                    option)
    if end - at < 2:  # its one step would train at the LR it decays from
        per = shaped.data.tokens_before(at + 1) - shaped.data.tokens_before(at)
        raise PlanError(f"{option}: is {end - at} step of {per:,} tokens; a cooldown needs at "
                        f"least 2 steps to lower the LR (its first trains at the LR it starts "
                        f"from): give at least {2 * per:,} tokens")
    return parent_cfg, apply_change(cfg, at, Change(end=end, floor=floor, mixture=mixture,
                                                    seq_len=seq_len), keep_warmup=False)


def parent_data(parent: Path | str, accept: bool = False, loaded=None) -> dict:
    """The parent's provenance record with the data its folder holds now; a branch of a run
    whose data changed is refused unless ``accept``, and then its record holds the new data
    and ``"changes"`` the accepted changes. ``loaded``: as in ``plan_branch``."""
    cfg = (loaded or load_run_config(parent)).with_absolute_data()
    recorded = run_data_record(parent)  # provenance.json, else the checkpoint's or own tokenizer
    now = data_identity(cfg.data, cfg.model.vocab_size)
    changes = check_data(parent, recorded, now, cfg.data.data_dir, accept)
    recorded.pop("tokenizer_from", None)  # where the record came from: the parent's, not ours
    return {**recorded, **{f: b for f, (_, b) in changes.items()}, "changes": changes}


def _write_data_record(folder: Path, record: dict, at: int, cfg) -> None:
    """The branch's own provenance (``branch_provenance``: the code and config that made it,
    with its parent's data, which its first start compares with) and, when a data change was
    accepted, that change as its first event."""
    record = dict(record)
    changes = record.pop("changes")
    atomic_write_json(folder / PROVENANCE, branch_provenance(cfg, record))
    if changes:
        t = JsonlTracker(folder / "metrics.jsonl")
        try:
            t.event("data_change", at, accepted="--accept-data-change",
                    **{f: {"recorded": a, "now": b} for f, (a, b) in changes.items()})
        finally:
            t.close()


def branch_dir(parent: Path | str, at: int, out: Path | str | None = None) -> Path:
    """The branch's folder: ``out``, or RUN-cooldown<STEP> beside the parent; must be new."""
    parent = Path(parent)
    child = Path(out) if out else parent.with_name(f"{parent.name}-cooldown{at}")
    if child.exists():
        raise PlanError(f"--out {child}: already exists; choose another folder" if out else
                        f"branch folder {child} (the default for --at {at}): already exists; "
                        "give another with --out")
    if child.resolve().is_relative_to(parent.resolve()):
        raise PlanError(f"--out {child}: inside the parent run; choose a folder beside it")
    return child


def check_can_record(parent: Path | str, child: Path) -> None:
    """Refuse before anything is made when the branch could not be recorded: its folder
    appears beside ``child``'s name, and the parent's operations log gains a line."""
    check_writable(child.parent, f"branch folder {child}", "give --out in a folder you can "
                   "write")
    log = Path(parent) / OPS_LOG
    check_writable(log, str(log), "a branch records itself in its parent's operations log: "
                   "make the parent run writable, or branch from a copy of it", append=True)


def placement_group(child_cfg, ranks: int) -> tuple[str, int]:
    """(transport, experts sharing a capacity group) of a placement for an EP group of
    ``ranks``; refused where no placement can change the drops (checked before any work)."""
    from moelab.config.errors import require
    from moelab.parallel.transport import get

    E = child_cfg.model.n_experts
    require(ranks >= 2 and E % ranks == 0, "--place-experts",
            f"{ranks} ranks must be >= 2 and divide model.n_experts={E}")
    par = replace(child_cfg.parallel, expert=ranks, devices=ranks)
    group = get(par.transport).group(par, E // ranks)
    require(group > 1, "--place-experts", f"parallel.transport={par.transport} limits each "
            "expert on its own: no placement changes its drops")
    return par.transport, group


def plan_for_branch(state: dict, at: int, parent_cfg, child_cfg, ranks: int) -> dict:
    """The placement a branch from the parent's ``state`` at step ``at`` gets for an EP group
    of ``ranks``: fitted on its routing of held-out text, in units of the branch's context,
    grouping experts as the branch's transport shares capacity."""
    from moelab.parallel.placement import fit_placement
    from moelab.parallel.routing import at_context, heldout_spans, routed_ids, routing_fn

    E = child_cfg.model.n_experts
    transport, group = placement_group(child_cfg, ranks)
    cfg = at_context(parent_cfg, at)
    unit = child_cfg.data.segment_at(at).seq_len
    spans = heldout_spans(cfg, max(unit, cfg.data.seq_len))
    ids = routed_ids(routing_fn(cfg), state["params"], state["model_state"], spans,
                     cfg.data.seq_len)
    return {"ranks": ranks, "group": group, "unit": unit, "transport": transport,
            **fit_placement(ids, E, group, unit)}


def write_placed(state: dict, meta: dict, at: int, slots_LE, ckpt_dir) -> None:
    """``state`` with its experts re-placed, saved as the checkpoint of ``at`` in
    ``ckpt_dir``."""
    from moelab.parallel.placement import permute_experts

    with Checkpointer(ckpt_dir) as out:
        out.save(at, permute_experts(state, slots_LE), meta)


def branch(parent: Path | str, at: int, cooldown_tokens: int, *, out: Path | str | None = None,
           floor: float | None = None, mixture: dict | None = None, seq_len: int | None = None,
           place_ranks: int | None = None, reason: str = "", command: str | None = None,
           accept_data_change: bool = False, drop_planned: bool = False,
           loaded=None) -> Path:
    """Create the branch folder (it must not exist yet); returns its path. ``place_ranks``:
    re-place its experts for an EP group of that many ranks (``moelab.parallel.placement``).
    A parent whose data changed is refused unless ``accept_data_change``. ``loaded``: the
    parent's config.yaml as the caller read it, so the branch is the plan it showed."""
    from moelab.run.load import restore_state
    from moelab.train.step import abstract_train_state

    parent = Path(parent)
    loaded = loaded or load_run_config(parent)
    data = parent_data(parent, accept_data_change, loaded)
    parent_cfg, child_cfg = plan_branch(parent, at, cooldown_tokens, floor=floor,
                                        mixture=mixture, seq_len=seq_len,
                                        drop_planned=drop_planned, loaded=loaded)
    child = branch_dir(parent, at, out)  # refused before any restoring or routing
    check_can_record(parent, child)
    placed = None
    if place_ranks is not None:  # the parent's state, restored once (finite, as a load checks)
        # the model runs: a stop there ends the process at once after its message, not through
        # interpreter shutdown, which stops XLA's threads in native code (exit 139, not 130)
        with native_work():
            # the whole train state (the optimizer's moments too): routed, then saved re-placed
            _, state, meta = restore_state(parent, parent_cfg, at,
                                           abstract_train_state(parent_cfg))
            placed = plan_for_branch(state, at, parent_cfg, child_cfg, place_ranks)
    command = command or command_line()
    src = Checkpointer(parent / "checkpoints").step_dir(at)
    tmp = child.with_name(f".{child.name}.tmp")  # the branch appears whole or not at all
    # the cooldown trains whole steps: what it trains, beside what was asked
    trained = (child_cfg.data.tokens_before(child_cfg.train.steps)
               - child_cfg.data.tokens_before(at))
    change = {"end": child_cfg.train.steps, "floor": child_cfg.optim.decays[-1].floor,
              "mixture": mixture, "seq_len": seq_len, "cooldown_tokens": trained,
              "cooldown_tokens_asked": cooldown_tokens,
              **({"drop_planned": True} if drop_planned else {})}
    with run_lock(tmp, command):  # the branch's folder has one writer, locked as it appears
        _clear_but_lock(tmp)
        if placed is None:
            _copy_checkpoint(src, tmp / "checkpoints", at, parent)
        else:  # new weights: written whole, never linked to the parent's
            write_placed(state, meta, at, placed["slots"], tmp / "checkpoints")
        if (parent / "tokenizer.json").is_file():
            atomic_write_bytes(tmp / "tokenizer.json", (parent / "tokenizer.json").read_bytes())
        save_config(child_cfg, tmp / "config.yaml")
        _write_data_record(tmp, data, at, child_cfg)
        lin = {"parent": link_to(child, parent), "step": at, "reason": reason,
               "command": command, "time": time.time(), "cooldown_tokens": trained,
               "cooldown_tokens_asked": cooldown_tokens, "end": child_cfg.train.steps,
               # the code and config of the parent's newest start: the steps before the fork
               "parent_code": {k: data[k] for k in CODE_FIELDS if k in data}}
        if placed is not None:
            lin["placement"] = {**placed, "slots": placed["slots"].tolist()}
            change["place_experts"] = place_ranks
        atomic_write_json(tmp / LINEAGE, lin)
        # in the folder before it appears: a kill -9 as it appears cannot leave it without
        log_operation(tmp, "branched_from", at, reason=reason, command=command,
                      parent=link_to(child, parent), **change)
        # the branch appears with both log lines or not at all
        with stops_deferred(f"the branch {child} was written in full"):
            try:
                os.rename(tmp, child)
            except OSError:
                raise PlanError(f"--out {child}: created by another process meanwhile; choose "
                                "another folder") from None
            log_operation(parent, "branch", at, reason=reason, command=command,
                          child=link_to(parent, child), **change)
    return child
