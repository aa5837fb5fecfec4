"""Everything a training run builds before its first step: the resolved config, the prepared
data, the run folder, the mesh, the train state (fresh or restored), the trackers and the
compiled step functions.

With several processes, process 0 alone writes the run folder and the logs; the others wait for
the data it prepares and then find it built.
"""

from __future__ import annotations

import functools
import shutil
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, RunConfig, save_config
from moelab.data.prepare import (
    PreparedData,
    data_identity,
    data_text,
    given_tokenizer,
    prepare_data,
    unused_rows_note,
    with_tokenizer_vocab,
)
from moelab.data.sampler import SteppedSampler
from moelab.data.store import TokenStore
from moelab.data.stream import StreamSampler
from moelab.data.tokenizer import load_tokenizer
from moelab.model.axes import DATA
from moelab.parallel import transport
from moelab.parallel.distributed import barrier, is_main
from moelab.parallel.mesh import check_device_count, fsdp_note, mesh_from_config, shard_batch
from moelab.run.checkpoint import Checkpointer, CheckpointError
from moelab.run.identity import (
    DATA_FIELDS,
    changes_text,
    check_data,
    check_data_found,
    check_vocab_kept,
    checkpoint_config,
    compared_fields,
    data_record,
    run_data_record,
    tokenizer_record,
)
from moelab.run.load import run_name
from moelab.run.logs import JsonlTracker
from moelab.run.provenance import provenance
from moelab.tempfiles import remove_temp_files
from moelab.train.adapt import check_adaptive, check_adaptive_heldout
from moelab.train.heldout import check_heldout
from moelab.train.peak import Peaks, model_costs
from moelab.train.preflight import (
    check_host_memory,
    check_step_memory,
    choose_remat,
    remat_candidates,
)
from moelab.train.resume import (
    PENDING,
    commit_pending,
    resolve_run_config,
    resume_changes,
    resume_step,
    say_start,
)
from moelab.train.step import (
    abstract_train_state,
    init_train_state,
    make_eval_step,
    make_train_step,
    train_state_shardings,
    transport_fns,
)
from moelab.train.tracker import (
    HardwareMonitor,
    TensorBoardTracker,
    Trackers,
    WandbTracker,
    process_identity,
)
from moelab.util import (
    atomic_write_bytes,
    atomic_write_json,
    describe_error,
    info,
    native_work,
)


@dataclass
class RunSetup:
    """What ``train`` builds once before the first step. The train state is not here: the step
    loop replaces it at every step."""

    cfg: RunConfig  # resolved: the saved config, changed only where a resume may change it
    run_dir: Path
    main: bool  # process 0: the one that writes the run folder
    say: Callable[[str], None]  # progress lines on stderr (silent unless verbose and main)
    data: PreparedData
    store: TokenStore
    tok: Any  # the tokenizer
    tok_record: dict  # its hash and size, saved in each checkpoint's meta.json
    sampler: SteppedSampler | StreamSampler  # the stream's position is restored with the state
    ckpt: Checkpointer
    put_batch: Callable  # a host batch onto the device(s), sharded over the mesh if any
    start: int  # the step training starts from: 0, or the restored checkpoint's
    restored: bool  # whether a checkpoint was restored
    eval_pending: bool  # the restored checkpoint's scheduled evaluation was not done
    metrics: dict  # the last metrics logged before it (meta.json), for a summary with no step
    trackers: Trackers
    hardware: HardwareMonitor
    counts: dict  # parameter counts: total, active per token
    peak: Peaks  # the MFU denominators: rated and measured FLOP/s of all devices
    step_fn: Callable  # the train step of cfg.parallel (train_step_at: a stage's capacities)
    eval_fn: Callable
    mesh: Any = None  # the device mesh (None on a single device)
    state_sh: Any = None  # the train state's shardings on it
    step_fns: dict = field(default_factory=dict)  # train steps of stages' parallel configs
    # model.remat=auto as chosen on the device: the (model.remat, model.scan_unroll) every step
    # is built with (cfg keeps "auto": its config.yaml, checkpoints and hash are the run's own)
    remat: tuple[str, int] | None = None


def built_config(run: RunSetup, cfg: RunConfig) -> RunConfig:
    """``cfg`` as the run's steps are built from it: model.remat=auto as chosen."""
    if run.remat is None:
        return cfg
    policy, unroll = run.remat
    return replace(cfg, model=replace(cfg.model, remat=policy, scan_unroll=unroll))


def train_step_at(run: RunSetup, step: int) -> Callable:
    """The train step of ``step``: a context stage with its own capacities (``parallel``,
    e.g. chosen by a drop gate) trains with its own compiled step."""
    par = run.cfg.parallel_at(step)
    if par == run.cfg.parallel:
        return run.step_fn
    if par not in run.step_fns:
        cfg = built_config(run, replace(run.cfg, parallel=par))
        run.step_fns[par] = make_train_step(cfg, transport_fns(cfg, run.mesh)[0], run.mesh,
                                            run.state_sh)
    return run.step_fns[par]


def _quiet(_msg: str) -> None:
    """The ``say`` of a quiet run and of every process but the main one."""


def init_sharded_state(cfg: RunConfig, shardings) -> dict:
    """A fresh train state, created directly in its shardings so no process ever holds
    another's shards, and restores land there too."""
    init = functools.partial(init_train_state, cfg)
    return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(cfg.train.seed))


def _prepare(cfg: RunConfig, main: bool, verbose: bool, hold: ExitStack | None) -> PreparedData:
    """The corpus, tokenizer and token store, built once by the main process (under the data
    folder's lock, marking the folder as read by this run until ``hold`` closes); the others
    then find them built."""
    if main:
        data = prepare_data(cfg.data, cfg.model.vocab_size, verbose=verbose, hold=hold)
    barrier("data-prepared")
    if not main:
        data = prepare_data(cfg.data, cfg.model.vocab_size, verbose=False, lock=False)
    return data


def _write_run_folder(cfg: RunConfig, run_dir: Path, data: PreparedData, prov: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    # a killed start's or replan --apply's writes (held the lock: a dry run's plot did not)
    remove_temp_files(run_dir, ("config.yaml", "tokenizer.json", "provenance.json",
                                "summary.json", PENDING))
    save_config(cfg, run_dir / "config.yaml")
    # A copy of the tokenizer makes the run folder self-contained for `moelab generate`.
    atomic_write_bytes(run_dir / "tokenizer.json", data.tokenizer_path.read_bytes())
    atomic_write_json(run_dir / "provenance.json", prov)
    commit_pending(run_dir, cfg)  # a replan applied by this resume: log it, drop the request


def _say_missing_records(cfg: RunConfig, run_dir: Path, at: int | None, recorded: dict,
                         say) -> None:
    """What a resume writes back that the run folder lacks (both written once it starts)."""
    if at is not None and not (run_dir / "config.yaml").is_file():
        say(f"{run_dir}/config.yaml: missing; resuming with the config the checkpoint of step "
            f"{at} was trained with (its meta.json), written back now")
    if at is not None and compared_fields(recorded) != DATA_FIELDS:
        say(f"{run_dir}: no record of the data it trained on (a run of an older moelab); "
            f"recording the corpus and tokenizer of {cfg.data.data_dir} as its data now")


def _checks_passed(run: RunSetup, at: int | None, data: PreparedData, prov: dict) -> None:
    """Once the compiled step's checks pass: a resume writes the run's files (its config with
    a pending replan applied), and what failed or killed saves left half-made goes now, not at
    the first save (as big as a checkpoint: its disk space is needed)."""
    if not run.main:
        return
    if at is not None:
        _write_run_folder(run.cfg, run.run_dir, data, prov)
    run.ckpt.remove_leftovers()


def _open_trackers(cfg: RunConfig, run_dir: Path, main: bool,
                   url: str | None = None) -> Trackers:
    """The run's trackers (the main process's only). W&B knows a run by its folder, or by its
    URL where it has one (not by this machine's copy of it)."""
    if not main:
        return Trackers()
    t = cfg.train
    where = url or str(run_dir.resolve())
    return Trackers(JsonlTracker(run_dir / "metrics.jsonl"),
                    WandbTracker(t.wandb_project, run_dir, cfg.to_dict(),
                                 run_name(where), where)
                    if t.wandb else None,
                    TensorBoardTracker(run_dir / "tensorboard")
                    if t.tensorboard else None)


def _restore(ckpt: Checkpointer, state: dict, trackers: Trackers) -> tuple[int, dict, dict] | None:
    """(step, state, meta) of the newest usable checkpoint, or None; when every checkpoint is
    damaged the run fails, and its log says so."""
    try:
        return ckpt.restore_latest(state)
    except CheckpointError as e:
        trackers.event("failed", 0, error=f"CheckpointError: {e}")
        trackers.close()
        raise


def _use(run: RunSetup, cand: RunConfig) -> Callable[[int], Callable]:
    """Switch ``run`` to ``cand``, a candidate of model.remat=auto (its step functions, none
    compiled yet); returns its ``train_step_at``."""
    chosen = (cand.model.remat, cand.model.scan_unroll)
    if chosen != run.remat:
        run.remat, run.step_fns = chosen, {}
        run.step_fn, run.eval_fn = _step_functions(cand, run.mesh, run.state_sh, _quiet)
    return lambda step: train_step_at(run, step)


def _check_memory(run: RunSetup, state, cands: list[RunConfig]) -> None:
    """Refuse, before the first step, a compiled train step of the run's data stages that
    needs more memory than JAX may use on a device (moelab.train.preflight); with
    model.remat=auto (``cands``: its candidates) first choose the policy."""
    if len(cands) > 1:
        reason = choose_remat(cands, lambda cfg: _use(run, cfg), state, run.start, run.mesh,
                              run.say)
        run.trackers.event("remat", run.start, policy=run.remat[0], scan_unroll=run.remat[1],
                           reason=reason)
    else:
        check_step_memory(lambda step: train_step_at(run, step), state, run.cfg, run.start,
                          run.mesh, run.say)


# What a start writes in its run folder: a new run refused before its first step removes them
RUN_FILES = ("config.yaml", "tokenizer.json", "provenance.json", "metrics.jsonl", "checkpoints",
             "tensorboard", "wandb")


def _new_run_files(run_dir: Path, at: int | None) -> list[Path]:
    """The run files a start of ``run_dir`` makes when it holds no run yet (no checkpoint, no
    log): each is new. Empty for a run with a record, which keeps this start's too."""
    made = [run_dir / name for name in RUN_FILES if not (run_dir / name).exists()]
    return made if at is None and run_dir / "metrics.jsonl" in made else []


@contextmanager
def _end_recorded(trackers, step: int, made: list[Path]) -> Iterator[None]:
    """However the setup ends after the run's start or resume event (a refusal, an error, a
    stop signal; the memory check compiles for minutes on a large model), its log says so;
    but a new run refused (``made``: the files it wrote) leaves none of them."""
    try:
        yield
    except BaseException as e:
        # said to every tracker (W&B would show a run closed without it as finished) ...
        trackers.event("aborted" if isinstance(e, KeyboardInterrupt) else "failed", step,
                       error=describe_error(e))
        trackers.close()
        for path in made if isinstance(e, ConfigError) else []:  # ... then a refusal's removed
            with suppress(OSError):  # as far as it can be: the refusal is what must be said
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        raise


def _step_functions(cfg: RunConfig, mesh, state_sh, say) -> tuple[Callable, Callable]:
    """(train step, eval step): the configured transport trains, the dropless one evaluates."""
    train_experts, eval_experts = transport_fns(cfg, mesh)
    step_fn = make_train_step(cfg, train_experts, mesh, state_sh)
    eval_fn = make_eval_step(cfg, eval_experts, mesh)
    fsdp = cfg.parallel.fsdp and mesh is not None and mesh.shape[DATA] > 1
    if note := fsdp_note(mesh, cfg.model, cfg.parallel.fsdp):  # where it splits less
        say(note)
    if mesh is not None:
        say(f"mesh: {dict(mesh.shape)}; transport "
            f"{transport.training_transport(cfg.parallel)} (evaluation: dropless)"
            + ("; FSDP: parameters and optimizer state split over data" if fsdp else ""))
    return step_fn, eval_fn


def _checked_data(cfg: RunConfig, run_dir: Path, recorded: dict, store: TokenStore, tok,
                  tok_path: Path, accept: bool, say) -> tuple[dict, dict]:
    """(the data record, its accepted changes) of the data as prepared: a resume trains on what
    the run recorded, or on a change accepted with --accept-data-change."""
    now = data_record(store.index["corpus_fingerprint"], tok, store.fingerprint,
                      Path(cfg.data.data_dir))
    changes = check_data(run_dir, recorded, now, cfg.data.data_dir, accept, tok_path)
    if changes:
        say(f"data changed, accepted (--accept-data-change): {changes_text(changes)}")
    return now, changes


def _check_resume_data(cfg: RunConfig, run_dir: Path, recorded: dict, accept: bool) -> None:
    """What the data folder holds now against the run's record, before anything is built or
    its config compared: found, unchanged (or the change accepted), of the model's size."""
    now = data_identity(cfg.data, cfg.model.vocab_size)
    check_data_found(run_dir, recorded, now, cfg.data.data_dir)
    check_data(run_dir, recorded, now, cfg.data.data_dir, accept)
    trained = checkpoint_config(run_dir)
    if trained is not None:
        check_vocab_kept(run_dir, trained[1].get("model", {}).get("vocab_size", 0),
                         given_tokenizer(cfg.data))


def _resolved(cfg: RunConfig, run_dir: Path, recorded: dict, accept: bool,
              name: str | None) -> tuple[RunConfig, list[str]]:
    """(the config the run trains with, the settings a resume changes), refused before
    anything is built, from the config and what the data folder holds now."""
    _check_resume_data(cfg, run_dir, recorded, accept)
    cfg = with_tokenizer_vocab(cfg)  # model.vocab_size 0: the tokenizer's
    cfg = transport.check_config(resolve_run_config(cfg, run_dir, name), len(jax.devices()))
    transport.check_backend(cfg.parallel, jax.default_backend())
    check_device_count(cfg, jax.devices())
    # said, and kept in the resume event
    changed = resume_changes(run_dir, cfg, cfg.parallel.devices or len(jax.devices()))
    check_adaptive(cfg)
    return cfg, changed


class _Inputs(NamedTuple):
    """The prepared data as the run reads it, checked against its config."""

    store: TokenStore
    tok: Any
    now: dict  # the data record: what provenance.json and each checkpoint keep
    changes: dict  # data changes accepted with --accept-data-change
    sampler: SteppedSampler | StreamSampler


def _checked_inputs(cfg: RunConfig, run_dir: Path, data: PreparedData, recorded: dict,
                    accept: bool, say) -> _Inputs:
    """Every check of the config against the prepared data: held-out text, token ids under
    the vocab, the run's data record, and each segment's sampler (a mixture change or
    context stage the data cannot serve is refused here, not at its step)."""
    store = TokenStore(data.store_dir, vocab_size=cfg.model.vocab_size)  # ids < vocab
    check_heldout(cfg, store, data.corpus_dir, say)  # evaluation must not vanish at the end
    # gates and re-placement route it, on the devices the mesh will span (0: every one)
    check_adaptive_heldout(cfg, store, cfg.parallel.devices or len(jax.devices()))
    tok = load_tokenizer(data.tokenizer_path)
    if note := unused_rows_note(cfg.data, tok, cfg.model.vocab_size):
        say(note)
    now, changes = _checked_data(cfg, run_dir, recorded, store, tok, data.tokenizer_path,
                                 accept, say)
    sampler = (StreamSampler(cfg.data, tok, data.corpus_dir) if cfg.data.sampler == "stream"
               else SteppedSampler(store, cfg.data))
    return _Inputs(store, tok, now, changes, sampler)


def setup_run(cfg: RunConfig, run_dir: Path | str, *, verbose: bool, mirror=None,
              accept_data_change: bool = False,
              hold: ExitStack | None = None) -> tuple[RunSetup, dict]:
    """(the run's setup, the train state to start from) for training ``cfg`` in ``run_dir``;
    ``mirror`` (a remote run's ``moelab.run.remote.Mirror``) uploads each checkpoint;
    ``hold``: keeps the data folder marked as read by this run until it closes.
    A resume must find the data the run recorded, unless ``accept_data_change``.

    The run folder is written only once every check on the data has passed and the train
    state is built: a start refused (or stopped) before leaves a new folder empty, which the
    run's lock then removes, and a resumed run's folder as it was. The compiled step's checks
    come after: a new run they refuse removes what it wrote; a resume writes its config and
    applies a pending replan only once they pass (its log records a refusal there)."""
    run_dir = Path(run_dir)
    cfg = cfg.with_absolute_data()  # the run's own data, wherever it is resumed from
    at = resume_step(run_dir)  # None: nothing trained yet, any data may (re)start it
    started_before = (run_dir / "config.yaml").is_file()  # a start stopped before a checkpoint
    recorded = run_data_record(run_dir) if at is not None else {}
    cfg, changed = _resolved(cfg, run_dir, recorded, accept_data_change,
                             mirror.url if mirror else None)
    main = is_main()  # with several processes, process 0 alone writes the run folder
    say = info if verbose and main else _quiet
    _say_missing_records(cfg, run_dir, at, recorded, say)
    mesh = mesh_from_config(cfg.parallel)  # refuses more devices than are visible
    shapes = functools.cache(functools.partial(abstract_train_state, cfg))  # traced once
    state_sh = train_state_shardings(cfg, mesh, shapes)
    # on a CPU: a state the host cannot hold before the data is prepared (a 535B-shaped run
    # trained its 128K tokenizer first), the activations after the data's checks
    check_host_memory(cfg, at or 0, mesh, state_sh, activations=False, shapes=shapes)
    data = _prepare(cfg, main, verbose, hold)
    inputs = _checked_inputs(cfg, run_dir, data, recorded, accept_data_change, say)
    store, tok, sampler = inputs.store, inputs.tok, inputs.sampler
    check_host_memory(cfg, at or 0, mesh, state_sh, shapes=shapes)  # before the state is built
    with native_work():  # compiles and first programs: a stop signal ends the process at once
        state = init_sharded_state(cfg, state_sh)
    prov = provenance(cfg, inputs.now)
    made = _new_run_files(run_dir, at) if main else []
    if main and at is None:  # a new run's folder holds it from here: a restart after a stop in
        _write_run_folder(cfg, run_dir, data, prov)  # the checks below says it starts over
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_ckpts,
                        every=cfg.train.ckpt_every,
                        asynchronous=cfg.train.async_ckpt)
    if mirror is not None:
        mirror.attach(ckpt)
    put_batch = (lambda b: jnp.asarray(b)) if mesh is None else (lambda b: shard_batch(b, mesh))
    trackers = _open_trackers(cfg, run_dir, main, mirror.url if mirror else None)
    restored = _restore(ckpt, state, trackers)
    start, meta = 0, {}
    if restored is not None:
        start, state, meta = restored
    say_start(cfg, mirror.url if mirror else run_dir, start if restored is not None else None,
              changed, started_before, say)
    say(f"data: {data_text(cfg.data, store, data.corpus_dir, start)}")  # what it trains on
    sampler.restore(start, meta.get("data"))
    trackers.event("resume" if start else "start", start, config_hash=cfg.hash(),
                   git_commit=prov.get("git_commit"), **process_identity(),
                   devices=1 if mesh is None else mesh.size, processes=jax.process_count(),
                   **({"changed": changed} if start and changed else {}))
    with _end_recorded(trackers, start, made), native_work():
        if inputs.changes:  # the run's record of what it trained on from here
            trackers.event("data_change", start, accepted="--accept-data-change",
                           **{f: {"recorded": a, "now": b} for f, (a, b) in inputs.changes.items()})
        hardware = HardwareMonitor()
        counts, peak = model_costs(cfg, mesh, say, start)
        cands = remat_candidates(cfg, jax.default_backend())  # [cfg] unless model.remat=auto
        step_fn, eval_fn = _step_functions(cands[0], mesh, state_sh, say)
        run = RunSetup(cfg=cfg, run_dir=run_dir, main=main, say=say, data=data, store=store,
                       tok=tok, tok_record=tokenizer_record(tok), sampler=sampler, ckpt=ckpt,
                       put_batch=put_batch, start=start, restored=restored is not None,
                       eval_pending=bool(meta.get("eval_pending")),
                       metrics=dict(meta.get("metrics") or {}), trackers=trackers,
                       hardware=hardware, counts=counts, peak=peak, step_fn=step_fn,
                       eval_fn=eval_fn, mesh=mesh, state_sh=state_sh,
                       remat=((cands[0].model.remat, cands[0].model.scan_unroll)
                              if len(cands) > 1 else None))
        _check_memory(run, state, cands)
    _checks_passed(run, at, data, prov)
    return run, state
